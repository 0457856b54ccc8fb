"""check_equal: after a weight sync, does every engine hold the trainer's tensors?

Each engine reports per-rank tensor checksums through SGLang 0.5.23's /weights_checker (action
"checksum", rollout/weights/checksum.py); the trainer hashes its own exported HF tensors the same way
in the engine's layout and compares. The layout is read from the names the engine reports:

- "hf": the engine holds HF names, except that routed experts may be fused as transformers 5 does
  (`mlp.experts.gate_up_proj` [E, 2I, H] = per expert cat(gate, up); `mlp.experts.down_proj`
  [E, H, I]): the reference server (`sao serve`) and the LoopbackEngine. EVERY tensor is compared, in
  the dtype the trainer sends (or `dtype`), and the two name sets must match both ways (a trainer
  tensor the engine lacks is allowed only when its bytes equal a tensor the engine has: tied embeddings).
  The routed-expert tensors of the export are held until the stream ends to build the fused ones.
- "sglang": a real SGLang engine (names such as `qkv_proj`, `gate_up_proj`, `experts.w13_weight`).
  SGLang stacks q/k/v and gate/up, stacks experts (possibly with the shared expert fused in), shards
  them over TP ranks, pads the vocabulary and may re-layout weights for its MoE kernel, none of which
  the reply describes (it carries names and hashes, no shapes). So the trainer compares only the
  tensors SGLang keeps whole and replicated under their HF names: RMSNorm weights (input/post-attention
  layernorms, q/k norms, MLA q_a/kv_a layernorms, final norm), the router `mlp.gate.weight` and
  `mlp.gate.e_score_correction_bias`, on every rank that holds them. SGLang's storage dtype may differ
  from the trainer's (GLM-4.5's router is float32 in SGLang, models/glm4_moe.py Glm4MoeGate), so a
  match in any of `dtype`/the trainer's dtype, float32, bfloat16, float16 counts. Every other tensor
  is NOT compared with the trainer: the check is that each trainer tensor has a home on the engine
  (q_proj -> qkv_proj, experts.J.gate_proj -> experts.w13_weight, ...), that every TP rank of a
  pipeline stage hashed the same names, and that engines with the same layout agree rank by rank.

Hash kind: SGLang hashes a CUDA tensor with its triton hash and a CPU tensor with sha256, and the
reply does not say which; a trainer checksum matches when either kind does.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from rollout.engines.engine import EngineError
from rollout.weights.checksum import EngineChecksums, is_skipped, tensor_checksums

from .calls import run_all
from .receiver import WeightReceiver

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_SGLANG_MARKS = re.compile(r"(\.qkv_proj\.weight|\.gate_up_proj\.weight|\.experts\.w13_weight|\.experts\.w2_weight"
                           r"|\.fused_qkv_a_proj_with_mqa\.weight)$")
_REPLICATED = re.compile(r"^(model\.norm\.weight|.+\.(input_layernorm|post_attention_layernorm)\.weight"
                         r"|.+\.self_attn\.(q_norm|k_norm|q_a_layernorm|kv_a_layernorm)\.weight"
                         r"|.+\.mlp\.gate\.(weight|e_score_correction_bias))$")
_SGLANG_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WeightMismatchError(AssertionError):
    """An engine serves a tensor that differs from the trainer's (or from another engine's)."""


@dataclass
class EngineWeightCheck:
    """What was checked on one engine: (rank, tensor) checksums compared with the trainer's, and those
    only checked for presence and agreement across engines and ranks."""

    engine: str
    layout: str
    ranks: int
    compared: int
    unverified: int


def engine_layout(reply: EngineChecksums) -> str:
    """'sglang' when any reported name is one of SGLang's fused parameters, else 'hf'."""
    names = (n for r in reply.ranks for n in r.checksums)
    return "sglang" if any(_SGLANG_MARKS.search(n) for n in names) else "hf"


def fused_experts(experts: dict[str, dict[int, dict[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers 5 fused experts from per-expert HF tensors {prefix: {expert: {proj: tensor}}}:
    prefix.gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows), prefix.down_proj [E, H, I]."""
    for prefix, by_expert in experts.items():
        count = max(by_expert) + 1
        gaps = [e for e in range(count) if set(by_expert.get(e, {})) != {"gate_proj", "up_proj", "down_proj"}]
        if gaps:
            raise ValueError(f"trainer export: {prefix} lacks gate/up/down tensors of expert {gaps[0]} "
                             f"(of {count}); cannot build the fused expert tensors")
        parts = [by_expert[e] for e in range(count)]
        yield f"{prefix}.gate_up_proj", torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]) for p in parts])
        yield f"{prefix}.down_proj", torch.stack([p["down_proj"] for p in parts])


def sglang_homes(name: str) -> tuple[str, ...]:
    """The SGLang parameter names an HF tensor may be loaded into (models/qwen3_moe.py, glm4_moe.py,
    deepseek_v2.py load_weights: stacked_params_mapping and FusedMoE.make_expert_params_mapping)."""
    m = _EXPERT.match(name)
    if m and ".shared_experts." not in name:
        return (f"{m['prefix']}.{'w2_weight' if m['proj'] == 'down_proj' else 'w13_weight'}",)
    homes = [name]
    for pattern, repl in ((r"\.(q|k|v)_proj\.(weight|bias)$", r".qkv_proj.\2"),
                          (r"\.(gate|up)_proj\.weight$", r".gate_up_proj.weight"),
                          (r"\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", r".fused_qkv_a_proj_with_mqa.weight")):
        if re.search(pattern, name):
            homes.append(re.sub(pattern, repl, name))
    shared = re.match(r"^(.+\.mlp)\.shared_experts\.(gate|up|down)_proj\.weight$", name)
    if shared:   # SGLang may fuse the shared expert into the routed stack as one more expert
        homes.append(f"{shared[1]}.experts.{'w2_weight' if shared[2] == 'down' else 'w13_weight'}")
    if name == "lm_head.weight":
        homes.append("model.embed_tokens.weight")   # tied embeddings: one parameter
    return tuple(homes)


class _TrainerSums:
    """The trainer's candidate checksums {name: set of hex}, built from one pass over the export."""

    def __init__(self, hf_names: set[str], sglang: bool, dtype: Optional[torch.dtype]):
        self.hf_names, self.sglang, self.dtype = hf_names, sglang, dtype
        self.hf: dict[str, set[str]] = {}
        self.replicated: dict[str, set[str]] = {}
        self.exported: list[str] = []
        self._experts: dict = defaultdict(lambda: defaultdict(dict))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.exported.append(name)
        tensor = tensor.detach()
        want = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
        if self.hf_names:
            fused = _fused_name(name)
            if fused is None or name in self.hf_names:   # expert sums only for engines that keep HF names
                self.hf[name] = _sums(tensor.to(want))
            if fused in self.hf_names:
                m = _EXPERT.match(name)
                self._experts[m["prefix"]][int(m["expert"])][m["proj"]] = tensor.to(want).cpu()
        if self.sglang and _REPLICATED.match(name):
            casts = {want, *(_SGLANG_DTYPES if tensor.is_floating_point() else ())}
            self.replicated[name] = set().union(*(_sums(tensor.to(d)) for d in casts))

    def finish(self) -> None:
        for name, tensor in fused_experts(self._experts):
            self.hf[name] = _sums(tensor)
        self._experts.clear()


def _sums(tensor: torch.Tensor) -> set[str]:
    return set(tensor_checksums(tensor).values())


def _where(rank, engine: str) -> str:
    pp, pp_size, tp, tp_size = rank.placement
    return f"engine {engine} (tp_rank {tp} of {tp_size}" + (f", pp_rank {pp} of {pp_size})" if pp_size > 1 else ")")


def _compare_hf(engine: str, reply: EngineChecksums, trainer: _TrainerSums) -> int:
    """Every rank of an hf-layout engine against the trainer, both name sets and every checksum."""
    compared = 0
    for rank in reply.ranks:
        for name, got in rank.checksums.items():
            want = trainer.hf.get(name)
            if want is None:
                raise WeightMismatchError(f"{_where(rank, engine)}: tensor {name} is not among the trainer's "
                                          "exported tensors (a name the trainer does not update)")
            if got not in want:
                raise WeightMismatchError(f"{_where(rank, engine)}: {name} differs from the trainer "
                                          f"(engine checksum {got}, trainer {' or '.join(sorted(want))})")
            compared += 1
        have = set(rank.checksums.values())
        for name in trainer.exported:
            if name not in rank.checksums and _fused_name(name) not in rank.checksums \
                    and not (trainer.hf.get(name, set()) & have):
                raise WeightMismatchError(f"{_where(rank, engine)}: trainer tensor {name} is missing from the "
                                          "engine's checksums (not loaded, or skipped by skip_tensor_list)")
    return compared


def _fused_name(name: str) -> Optional[str]:
    """The transformers 5 fused tensor a per-expert HF name lives in (None for other names)."""
    m = _EXPERT.match(name)
    return f"{m['prefix']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}" if m else None


def _compare_sglang(engine: str, reply: EngineChecksums, trainer: _TrainerSums) -> tuple[int, int]:
    """Replicated tensors against the trainer on every rank holding them; homes for the rest."""
    compared = unverified = 0
    for rank in reply.ranks:
        for name, got in rank.checksums.items():
            want = trainer.replicated.get(name)
            if want is None:
                unverified += 1
            elif got not in want:
                raise WeightMismatchError(f"{_where(rank, engine)}: {name} differs from the trainer "
                                          f"(engine checksum {got} is no cast of the trainer's tensor)")
            else:
                compared += 1
    reported = {n for r in reply.ranks for n in r.checksums}
    for name in trainer.exported:
        if not any(home in reported for home in sglang_homes(name)):
            raise WeightMismatchError(f"engine {engine}: trainer tensor {name} has no home among the engine's "
                                      f"checksums (looked for {', '.join(sglang_homes(name))})")
    return compared, unverified


def _check_ranks_agree(checks: list[tuple[str, str, EngineChecksums]]) -> None:
    """Within an engine, the TP ranks of a pipeline stage hash the same names; across engines of one
    layout, ranks at the same (pp, tp) place hold identical checksums (they got the same update)."""
    first: dict[tuple, tuple[str, object]] = {}
    for engine, layout, reply in checks:
        stage_names: dict[int, tuple[object, set[str]]] = {}
        for rank in reply.ranks:
            pp = rank.placement[0]
            seen = stage_names.setdefault(pp, (rank, set(rank.checksums)))
            if set(rank.checksums) != seen[1]:
                odd = sorted(set(rank.checksums) ^ seen[1])[0]
                raise WeightMismatchError(f"{_where(rank, engine)}: hashed a different set of tensors than "
                                          f"tp_rank {seen[0].placement[2]} of the same stage (e.g. {odd})")
            key = (layout, *rank.placement)
            if key not in first:
                first[key] = (engine, rank)
                continue
            other, ref = first[key]
            for name in sorted(set(rank.checksums) | set(ref.checksums)):
                if rank.checksums.get(name) != ref.checksums.get(name):
                    raise WeightMismatchError(f"{_where(rank, engine)}: {name} differs from engine {other}'s "
                                              f"(checksum {rank.checksums.get(name)} vs {ref.checksums.get(name)})")


async def check_weight_update_equal(engines: list[WeightReceiver], named_tensors: Iterable[tuple[str, torch.Tensor]],
                                    dtype: Optional[torch.dtype] = None,
                                    timeout_s: float = 120.0) -> list[EngineWeightCheck]:
    """Compare every engine's /weights_checker checksums with the trainer's `named_tensors` (the HF
    export, consumed once, also when `engines` is empty: other ranks take part in the export).
    `dtype` is the engine's storage dtype (None: the dtype the trainer sends). Returns one
    EngineWeightCheck per engine; raises WeightMismatchError naming the engine, rank and tensor of the
    first difference, EngineError when an engine fails to answer."""
    if not engines:
        for _ in named_tensors:
            pass
        return []
    replies = await run_all({f"engine {e.name}": e.check_weights(selector="target") for e in engines},
                            "/weights_checker (checksum)", timeout_s)
    for engine, reply in zip(engines, replies):
        if not reply.ranks:
            raise EngineError(f"engine {engine.name}: /weights_checker answered without per-rank checksums "
                              f"('ranks' empty; message {reply.message!r})")
    layouts = [engine_layout(r) for r in replies]
    hf_names = {n for r, lay in zip(replies, layouts) if lay == "hf" for rank in r.ranks for n in rank.checksums}
    trainer = _TrainerSums(hf_names, "sglang" in layouts, dtype)
    for name, tensor in named_tensors:
        if not is_skipped(name):
            trainer.add(name, tensor)
    trainer.finish()
    results = []
    for engine, layout, reply in zip(engines, layouts, replies):
        if layout == "hf":
            compared, unverified = _compare_hf(engine.name, reply, trainer), 0
        else:
            compared, unverified = _compare_sglang(engine.name, reply, trainer)
        results.append(EngineWeightCheck(engine.name, layout, len(reply.ranks), compared, unverified))
    _check_ranks_agree([(e.name, lay, r) for e, lay, r in zip(engines, layouts, replies)])
    return results
