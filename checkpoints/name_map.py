"""The name map: one `Rule` per Megatron (local-spec) tensor, saying which HF tensors it is made of.

Megatron names here are *global*: `decoder.layers.{L}` with the global layer index and
`mlp.experts.local_experts.{g}` with the global expert index; checkpoints/convert.py renames them to
a rank's local indices. Table (HF on-disk names, prefix model.layers.L):

| Megatron (decoder.layers.L.)               | HF (model.layers.L.)                         | split |
|--------------------------------------------|----------------------------------------------|-------|
| input_layernorm.weight                     | input_layernorm.weight                       | rep   |
| self_attention.linear_qkv.weight/.bias     | self_attn.{q,k,v}_proj.weight/.bias (grouped)| col   |
| self_attention.{q,k}_layernorm.weight      | self_attn.{q,k}_norm.weight                  | rep   |
| self_attention.linear_proj.weight          | self_attn.o_proj.weight                      | row   |
| pre_mlp_layernorm.weight                   | post_attention_layernorm.weight              | rep   |
| mlp.linear_fc1.weight (dense layers)       | mlp.{gate,up}_proj.weight                    | glu   |
| mlp.linear_fc2.weight (dense layers)       | mlp.down_proj.weight                         | row   |
| mlp.router.weight                          | mlp.gate.weight                              | rep   |
| mlp.router.expert_bias (GLM)               | mlp.gate.e_score_correction_bias             | rep   |
| mlp.experts.local_experts.g.linear_fc1.weight | mlp.experts.g.{gate,up}_proj.weight       | glu (expert TP) |
| mlp.experts.local_experts.g.linear_fc2.weight | mlp.experts.g.down_proj.weight            | row (expert TP) |
| mlp.shared_experts.linear_fc{1,2}.weight   | mlp.shared_experts.{gate,up / down}_proj.weight | glu / row |
| embedding.word_embeddings.weight           | model.embed_tokens.weight                    | vocab |
| decoder.final_layernorm.weight             | model.norm.weight                            | rep   |
| output_layer.weight                        | lm_head.weight (embed_tokens when tied)      | vocab |

Multi-latent attention (GLM-5-class, DeepSeek-V3) replaces the QKV rows with
| self_attention.linear_q_down_proj / linear_q_up_proj | self_attn.q_a_proj / q_b_proj        | col |
| self_attention.q_layernorm / kv_layernorm  | self_attn.q_a_layernorm / kv_a_layernorm     | rep   |
| self_attention.linear_kv_down_proj / linear_kv_up_proj | self_attn.kv_a_proj_with_mqa / kv_b_proj | col |
and DSA layers with their own indexer (GLM-5) add, replicated over TP (parallel/mla_attention.py)
| self_attention.core_attention.indexer.{wq_b,wk,weights_proj}.weight | self_attn.indexer.{same}.weight | rep |
| self_attention.core_attention.indexer.k_norm.{weight,bias} | self_attn.indexer.k_norm.{weight,bias} | rep |
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .arch.spec import ArchSpec

EMBED, FINAL_NORM, OUTPUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"


@dataclass(frozen=True)
class Rule:
    mcore: str                      # global Megatron name
    hf: tuple                       # HF names, in pack order
    pack: str                       # "copy" | "qkv" | "glu"
    split: str                      # "rep" | "col" | "row" | "glu" | "vocab"
    layer: Optional[int] = None     # global decoder layer, None for embedding / final norm / output
    expert: Optional[int] = None    # global expert index for routed-expert tensors


def layer_rules(spec: ArchSpec, L: int) -> list[Rule]:
    """All rules of decoder layer L; routed experts last, in global expert order."""
    m, h = f"decoder.layers.{L}.", f"model.layers.{L}."

    def rule(mc, hf, pack="copy", split="rep", expert=None):
        return Rule(m + mc, tuple(h + n for n in hf), pack, split, L, expert)

    rules = [rule("input_layernorm.weight", ["input_layernorm.weight"])]
    rules += _mla_attention(rule, spec, L) if spec.mla else _gqa_attention(rule, spec)
    rules.append(rule("pre_mlp_layernorm.weight", ["post_attention_layernorm.weight"]))
    if L not in spec.moe_layers:
        return rules + _glu_mlp(rule, "mlp.", "mlp.")
    rules.append(rule("mlp.router.weight", ["mlp.gate.weight"]))
    if spec.expert_bias:
        rules.append(rule("mlp.router.expert_bias", ["mlp.gate.e_score_correction_bias"]))
    if spec.shared_experts:
        rules += _glu_mlp(rule, "mlp.shared_experts.", "mlp.shared_experts.")
    for g in range(spec.num_experts):
        rules += _glu_mlp(rule, f"mlp.experts.local_experts.{g}.", f"mlp.experts.{g}.", expert=g)
    return rules


def _gqa_attention(rule, spec: ArchSpec) -> list[Rule]:
    rules = []
    for kind in ["weight"] + (["bias"] if spec.qkv_bias else []):
        rules.append(rule(f"self_attention.linear_qkv.{kind}",
                          [f"self_attn.{p}_proj.{kind}" for p in "qkv"], "qkv", "col"))
    if spec.qk_norm:
        rules += [rule("self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"]),
                  rule("self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"])]
    return rules + [rule("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"], split="row")]


INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def _mla_attention(rule, spec: ArchSpec, L: int) -> list[Rule]:
    """Multi-latent attention, Megatron local spec: the down projections are ColumnParallelLinear
    (gather_output=False, gathered inside MLA), so under TP they split on dim 0 like the up projections;
    the latent norms are replicated. Head layouts agree ([nope, rope] per head in q, [nope, v] per head
    in kv_up, [kv_lora, rope] in kv_down), so every tensor is a plain copy."""
    a = "self_attention."
    if spec.q_lora_rank:
        rules = [rule(a + "linear_q_down_proj.weight", ["self_attn.q_a_proj.weight"], split="col"),
                 rule(a + "q_layernorm.weight", ["self_attn.q_a_layernorm.weight"]),
                 rule(a + "linear_q_up_proj.weight", ["self_attn.q_b_proj.weight"], split="col")]
    else:
        rules = [rule(a + "linear_q_proj.weight", ["self_attn.q_proj.weight"], split="col")]
    rules += [rule(a + "linear_kv_down_proj.weight", ["self_attn.kv_a_proj_with_mqa.weight"], split="col"),
              rule(a + "kv_layernorm.weight", ["self_attn.kv_a_layernorm.weight"]),
              rule(a + "linear_kv_up_proj.weight", ["self_attn.kv_b_proj.weight"], split="col"),
              rule(a + "linear_proj.weight", ["self_attn.o_proj.weight"], split="row")]
    if L in spec.indexer_layers:
        rules += [rule(a + "core_attention.indexer." + t, ["self_attn.indexer." + t]) for t in INDEXER_TENSORS]
    return rules


def _glu_mlp(rule, mc: str, hf: str, expert=None) -> list[Rule]:
    return [rule(mc + "linear_fc1.weight", [hf + "gate_proj.weight", hf + "up_proj.weight"], "glu", "glu", expert),
            rule(mc + "linear_fc2.weight", [hf + "down_proj.weight"], "copy", "row", expert)]


def embedding_rule() -> Rule:
    return Rule(EMBED, ("model.embed_tokens.weight",), "copy", "vocab")


def final_rules(spec: ArchSpec, include_tied_output: bool = False) -> list[Rule]:
    """Final norm and output layer. A tied output layer exists in Megatron only on a last pipeline stage
    that does not also hold the embedding (pp > 1); it is a copy of the embedding."""
    rules = [Rule(FINAL_NORM, ("model.norm.weight",), "copy", "rep")]
    if not spec.tie_embeddings:
        rules.append(Rule(OUTPUT, ("lm_head.weight",), "copy", "vocab"))
    elif include_tied_output:
        rules.append(Rule(OUTPUT, ("model.embed_tokens.weight",), "copy", "vocab"))
    return rules


def all_rules(spec: ArchSpec) -> list[Rule]:
    """Every rule of the model in HF stream order: embedding, layers, final norm, output."""
    rules = [embedding_rule()]
    for L in range(spec.num_layers):
        rules += layer_rules(spec, L)
    return rules + final_rules(spec)


def expected_hf_names(spec: ArchSpec) -> set[str]:
    return {n for r in all_rules(spec) for n in r.hf}


# Transformer Engine layer specs fuse a norm into the linear after it and may group the expert GEMMs;
# these are the same tensors under the local spec's names, so one rule table serves both specs.
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",                  # dense layers
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",    # MLA
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",  # MLA
}
_TE_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$")


def canonical_mcore_name(name: str) -> str:
    """The local-spec name of a Megatron tensor name that may come from a Transformer Engine spec
    (fused layer norms, grouped experts `mlp.experts.linear_fc1.weight{j}`); other names unchanged."""
    for te, local in _TE_FUSED_NORMS.items():
        if name.endswith("." + te) or name == te:
            return name[: len(name) - len(te)] + local
    grouped = _TE_GROUPED_EXPERT.match(name)
    if grouped:
        prefix, fc, j = grouped.groups()
        return f"{prefix}.local_experts.{j}.{fc}.weight"
    return name


def is_expert_hf_name(name: str) -> bool:
    """Routed-expert tensors (sent after all others by weight sync, like slime does)."""
    return ".mlp.experts." in name
