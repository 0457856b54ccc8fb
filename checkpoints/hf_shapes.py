"""config.json against the weights: every HF tensor the name map needs has the shape the config implies.

A config that contradicts its safetensors (a wrong hidden_size, head count, vocab or expert width)
converts without complaint, slicing and copying as told, and leaves shards no model can load. Shapes
come from the safetensors headers (nothing is read), so `sao convert` checks a whole checkpoint before
it writes anything. Errors are one line naming the tensor, both shapes and the config keys involved.
"""
from __future__ import annotations

from typing import Mapping, Optional

from .arch.spec import ArchSpec
from .name_map import all_rules

ANY = None   # a dimension the config does not fix (checked for agreement between tensors elsewhere)


def header_shapes(ckpt) -> dict[str, tuple]:
    """{name: shape} of an hf_io.HFCheckpoint, from the safetensors headers only."""
    return {name: tuple(ckpt._file(ckpt.weight_map[name]).get_slice(name).get_shape()) for name in ckpt.weight_map}


def check_hf_shapes(shapes: Mapping[str, tuple], spec: ArchSpec, cfg: dict) -> None:
    """Raise ValueError (one line) for the first needed tensor that is missing or misshapen."""
    for name in dict.fromkeys(n for rule in all_rules(spec) for n in rule.hf):   # model order: embedding first
        if name not in shapes:
            raise ValueError(f"HF checkpoint lacks {name}, which config.json implies ({spec.arch}, "
                             f"{spec.num_layers} layers, {spec.num_experts} experts); fix: check config.json "
                             "against the weights")
        want, keys = expected_shape(name, spec, cfg)
        got = tuple(shapes[name])
        if want is not None and not _fits(got, want):
            shown = tuple("*" if d is ANY else d for d in want)
            raise ValueError(f"{name} has shape {list(got)} but config.json ({', '.join(keys)}) implies "
                             f"{list(shown)}; fix: correct config.json or use the weights it belongs to")


def _fits(got: tuple, want: tuple) -> bool:
    return len(got) == len(want) and all(w is ANY or g == w for g, w in zip(got, want))


def expected_shape(name: str, spec: ArchSpec, cfg: dict) -> tuple[Optional[tuple], tuple[str, ...]]:
    """(shape, config keys it follows) for one HF tensor name; (None, ()) for a tensor left unchecked."""
    h, v = spec.hidden_size, spec.vocab_size
    top = {"model.embed_tokens.weight": ((v, h), ("vocab_size", "hidden_size")),
           "lm_head.weight": ((v, h), ("vocab_size", "hidden_size")),
           "model.norm.weight": ((h,), ("hidden_size",))}
    if name in top:
        return top[name]
    part = name.split(".", 3)[3] if name.startswith("model.layers.") else name
    for table in (_norm_and_router(spec), _mla(spec, cfg) if spec.mla else _gqa(spec)):
        if part in table:
            return table[part]
    return _mlp(part, spec, cfg)


def _norm_and_router(spec: ArchSpec) -> dict:
    h, e = spec.hidden_size, spec.num_experts
    return {"input_layernorm.weight": ((h,), ("hidden_size",)),
            "post_attention_layernorm.weight": ((h,), ("hidden_size",)),
            "mlp.gate.weight": ((e, h), ("num_experts", "hidden_size")),
            "mlp.gate.e_score_correction_bias": ((e,), ("num_experts",))}


def _gqa(spec: ArchSpec) -> dict:
    h, q, kv, d = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.head_dim
    qk, kvk = ("num_attention_heads", "head_dim", "hidden_size"), ("num_key_value_heads", "head_dim", "hidden_size")
    return {"self_attn.q_proj.weight": ((q, h), qk), "self_attn.k_proj.weight": ((kv, h), kvk),
            "self_attn.v_proj.weight": ((kv, h), kvk), "self_attn.o_proj.weight": ((h, q), qk),
            "self_attn.q_proj.bias": ((q,), qk[:2]), "self_attn.k_proj.bias": ((kv,), kvk[:2]),
            "self_attn.v_proj.bias": ((kv,), kvk[:2]),
            "self_attn.q_norm.weight": ((d,), ("head_dim",)), "self_attn.k_norm.weight": ((d,), ("head_dim",))}


def _mla(spec: ArchSpec, cfg: dict) -> dict:
    h, n = spec.hidden_size, spec.num_heads
    rope, nope = cfg.get("qk_rope_head_dim"), cfg.get("qk_nope_head_dim")
    kv_lora, q_lora, v_dim = cfg.get("kv_lora_rank"), spec.q_lora_rank, cfg.get("v_head_dim")
    qk = n * (nope + rope) if nope and rope else ANY
    return {"self_attn.q_a_proj.weight": ((q_lora, h), ("q_lora_rank", "hidden_size")),
            "self_attn.q_a_layernorm.weight": ((q_lora,), ("q_lora_rank",)),
            "self_attn.q_b_proj.weight": ((qk, q_lora), ("num_attention_heads", "qk_*_head_dim", "q_lora_rank")),
            "self_attn.q_proj.weight": ((qk, h), ("num_attention_heads", "qk_*_head_dim", "hidden_size")),
            "self_attn.kv_a_proj_with_mqa.weight": ((kv_lora + rope if kv_lora and rope else ANY, h),
                                                    ("kv_lora_rank", "qk_rope_head_dim", "hidden_size")),
            "self_attn.kv_a_layernorm.weight": ((kv_lora or ANY,), ("kv_lora_rank",)),
            "self_attn.kv_b_proj.weight": ((n * (nope + v_dim) if nope and v_dim else ANY, kv_lora or ANY),
                                           ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank")),
            "self_attn.o_proj.weight": ((h, n * v_dim if v_dim else ANY), ("hidden_size", "num_attention_heads",
                                                                        "v_head_dim"))}


def _mlp(part: str, spec: ArchSpec, cfg: dict) -> tuple[Optional[tuple], tuple[str, ...]]:
    """GLU projections: routed experts moe_intermediate_size wide, shared experts n_shared_experts times
    that, dense layers intermediate_size."""
    if part.startswith("mlp.experts."):
        width, key = cfg.get("moe_intermediate_size"), "moe_intermediate_size"
    elif part.startswith("mlp.shared_experts."):
        moe = cfg.get("moe_intermediate_size")
        width, key = (moe * int(cfg.get("n_shared_experts", 1) or 1) if moe else ANY), "moe_intermediate_size"
    elif part.startswith("mlp."):
        width, key = cfg.get("intermediate_size"), "intermediate_size"
    else:
        return None, ()
    h, keys = spec.hidden_size, (key, "hidden_size")
    if part.endswith(("gate_proj.weight", "up_proj.weight")):
        return (width or ANY, h), keys
    if part.endswith("down_proj.weight"):
        return (h, width or ANY), keys
    return None, ()
