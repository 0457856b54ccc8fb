"""The two model-shape records every family fills from an HF config.json:

- `ArchSpec`: the shapes and optional parts of one checkpoint that the name map needs. Each family
  module (qwen3_moe.py, glm4_moe.py, glm5.py) reads a config into one; checkpoints/name_map.py and
  convert.py do the rest generically, because the families share the on-disk HF layout
  `model.layers.L.{self_attn,mlp}.*` and differ only in which optional tensors exist.
- `ArchShape` (defined in sao_megatron/core/shape.py, re-exported by checkpoints.arch): the numbers layout validation
  needs (ParallelDims.validate), built by checkpoints.arch.arch_shape without the name map's per-tensor
  checks. It lives in the bottom layer because the recipe check validates layouts too.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    moe_layers: frozenset          # decoder layer indices whose MLP is MoE; the rest are dense GLU MLPs
    shared_experts: bool = False   # GLM: an always-on GLU MLP next to the routed experts
    qkv_bias: bool = False         # GLM-4.5: q/k/v projections have biases
    qk_norm: bool = True           # per-head RMSNorm on q and k (Qwen3: always; GLM: use_qk_norm)
    expert_bias: bool = False      # GLM: router e_score_correction_bias (aux-loss-free balancing)
    tie_embeddings: bool = False
    mla: bool = False              # GLM-5 / DeepSeek-V3 multi-latent attention instead of grouped QKV
    q_lora_rank: int = 0           # MLA: 0 = plain q_proj, else q_a_proj -> q_a_layernorm -> q_b_proj
    indexer_layers: frozenset = frozenset()  # DSA: layers with their own indexer (self_attn.indexer.*)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.arch}: num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def config_get(cfg: dict, arch: str, *keys: str, default=None):
    """First present key of `keys` in an HF config dict; a missing required key names the field."""
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    if default is not None:
        return default
    raise ValueError(f"{arch} config.json has none of {keys}; fix: is this an {arch} checkpoint?")
