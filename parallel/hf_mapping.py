"""HF (on-disk names) <-> Megatron local-spec tensors for one rank: qwen3_moe and glm4_moe layouts.

Used by RLModel.load_hf_state_dict / export_hf. A Megatron parameter's *full* tensor (before TP) is
built from HF tensors, then this rank's TP slice is taken along the parameter's ``partition_dim``
(attributes Megatron sets on every parallel linear). Rules (see ../shared/notes/bridges.md):

- linear_qkv = concat over KV groups g of [q heads of g; k head g; v head g]; TP splits whole groups.
- linear_fc1 = [gate; up]; under TP each rank holds [gate_r; up_r] (gate and up split separately).
- Row-parallel weights (linear_proj, fc2) split on dim 1; the vocabulary is padded with zero rows.
- Layer and expert indices are global: from each layer's ``layer_number`` and its MoE layer's
  ``local_expert_indices`` (so PP, VPP and EP offsets come from Megatron itself).
"""
from __future__ import annotations

import re
from typing import Callable, Iterator, Mapping

import torch

from checkpoints.tensor_layouts import pack_qkv, unpack_qkv  # one definition of Megatron's QKV layout

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")

# Megatron suffix -> HF suffix for one-to-one tensors (prefix model.layers.L.)
_LAYER_COPY = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec fuses the norm
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_LAYER_GLU = {"mlp.linear_fc1.weight": "mlp", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts"}
_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


class MappingError(KeyError):
    """A Megatron tensor with no HF source (or an HF tensor missing from the state dict)."""


def _unpack_qkv(qkv: torch.Tensor, groups: int, q_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_qkv given q_rows = nh*hd (head sizes derived from the packed rows)."""
    q_per_group = q_rows // groups
    head_dim = (qkv.shape[0] // groups - q_per_group) // 2
    return unpack_qkv(qkv, groups, q_per_group // head_dim, head_dim)


class HFMapping:
    """Name/shape rules for one model; `layer_of` / `expert_of` give global indices of local modules."""

    def __init__(self, num_query_groups: int, q_rows: int, vocab_size: int,
                 layer_of: Callable[[int], int] = lambda i: i, expert_of: Callable[[int, int], int] = lambda i, j: j):
        self.groups, self.q_rows, self.vocab = num_query_groups, q_rows, vocab_size
        self.layer_of, self.expert_of = layer_of, expert_of

    def for_module(self, module: torch.nn.Module) -> "HFMapping":
        """A copy whose local layer/expert indices resolve through `module` (a GPTModel chunk)."""
        layers = module.decoder.layers

        def expert_of(local: int, j: int) -> int:
            return int(layers[local].mlp.local_expert_indices[j])

        return HFMapping(self.groups, self.q_rows, self.vocab, lambda i: int(layers[i].layer_number) - 1, expert_of)

    def hf_names(self, mcore_name: str) -> tuple[str, list[str]]:
        """(pack kind, HF source names) of a local Megatron name: kind is copy | qkv | glu | vocab."""
        if mcore_name in _TOP:
            kind = "vocab" if "embed" in mcore_name or "output" in mcore_name else "copy"
            return kind, [_TOP[mcore_name]]
        match = _LAYER.match(mcore_name)
        if not match:
            raise MappingError(f"no HF name for Megatron tensor {mcore_name!r}")
        local, suffix = int(match.group(1)), match.group(2)
        pre = f"model.layers.{self.layer_of(local)}."
        if suffix in _LAYER_COPY:
            return "copy", [pre + _LAYER_COPY[suffix]]
        if suffix in _LAYER_GLU:
            base = pre + _LAYER_GLU[suffix]
            return "glu", [f"{base}.gate_proj.weight", f"{base}.up_proj.weight"]
        if suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            return "qkv", [pre + f"self_attn.{p}_proj.{kind}" for p in "qkv"]
        expert = _EXPERT.match(suffix)
        if expert:
            j, fc = int(expert.group(1)), expert.group(2)
            base = pre + f"mlp.experts.{self.expert_of(local, j)}"
            if fc == "linear_fc1":
                return "glu", [f"{base}.gate_proj.weight", f"{base}.up_proj.weight"]
            return "copy", [f"{base}.down_proj.weight"]
        raise MappingError(f"no HF name for Megatron tensor {mcore_name!r}")

    def full_tensor(self, mcore_name: str, hf: Mapping[str, torch.Tensor], padded_rows: int = 0) -> tuple[str, list]:
        """(kind, source tensors) with the vocabulary padded to `padded_rows`."""
        kind, names = self.hf_names(mcore_name)
        missing = [n for n in names if n not in hf]
        if missing:
            raise MappingError(f"HF state dict lacks {missing[0]!r} (needed for {mcore_name})")
        tensors = [hf[n] for n in names]
        if kind == "vocab" and padded_rows > tensors[0].shape[0]:
            pad = tensors[0].new_zeros(padded_rows - tensors[0].shape[0], *tensors[0].shape[1:])
            tensors = [torch.cat([tensors[0], pad])]
        return kind, tensors

    def shard(self, kind: str, tensors: list, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's slice, shaped like `param`."""
        dim = getattr(param, "partition_dim", 0) if getattr(param, "tensor_model_parallel", False) else None
        if kind == "qkv":
            full = pack_qkv(*tensors, self.groups)
        elif kind == "glu":
            if dim is None or size == 1:
                full = torch.cat(tensors)
            else:  # gate and up are split separately, then re-joined per rank
                return torch.cat([t.chunk(size, dim=0)[rank] for t in tensors])
        else:
            full = tensors[0]
        if dim is None or size == 1:
            return full
        return full.chunk(size, dim=dim)[rank]

    def unshard(self, kind: str, pieces: list[torch.Tensor], dim) -> torch.Tensor:
        """Inverse of shard over the TP pieces (rank order): the full Megatron tensor."""
        if dim is None or len(pieces) == 1:
            return pieces[0]
        if kind == "glu":
            halves = [p.chunk(2, dim=0) for p in pieces]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(pieces, dim=dim)

    def to_hf(self, mcore_name: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors of one full Megatron tensor (vocab padding removed)."""
        kind, names = self.hf_names(mcore_name)
        if kind == "qkv":
            yield from zip(names, _unpack_qkv(full, self.groups, self.q_rows))
        elif kind == "glu":
            yield from zip(names, full.chunk(2, dim=0))
        elif kind == "vocab":
            yield names[0], full[: self.vocab]
        else:
            yield names[0], full
