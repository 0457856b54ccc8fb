"""Architecture shapes of the large MoE models, and exact parameter counts from an HF config.

`SHAPES` holds HF-``config.json``-like dicts (HF key names) for the models whose weights are not on
this machine, gathered from each family's entry in checkpoints/arch (``Family.shapes``); recipes name
one with ``model.shape_preset``. `count_parameters(cfg)` works on any of them and on a real
``config.json`` (the tiny Qwen3-MoE included), so the planner and the tests use one counting rule.

Counting rules (untied embeddings; SwiGLU MLP = 3·H·F; shapes from each model's HF config.json and
transformers configuration class; totals checked against the advertised sizes in tests/unit/parallel/test_model_shapes.py):
- GQA attention: H·nh·hd + 2·H·nkv·hd + nh·hd·H (+ q/k/v bias nh·hd + 2·nkv·hd) (+ q/k norm 2·hd).
- MLA: H·qr + qr + qr·nh·(nope+rope) + H·(kvr+rope) + kvr + kvr·nh·(nope+v) + nh·v·H
  (the two lone terms are the q_a / kv_a latent RMSNorms).
- DSA indexer (GLM-5): qr·ih·id + H·id + H·ih + 2·id (wq_b, wk, weights_proj, k LayerNorm w+b), in the layers
  that run their own indexer ("full" in indexer_types) and in MTP layers; a "shared" layer reuses the previous
  full layer's selection and has none (transformers modeling_glm_moe_dsa.py:332-333; SGLang deepseek_v2.py:2117).
- MoE layer: routed E·3·H·Fm, shared S·3·H·Fm, router E·H (+E correction bias for sigmoid routers).
- Norms: 2·H per layer plus the final H.
- MTP layer (DeepSeek/GLM style): a full decoder layer + enorm H + hnorm H + eh_proj 2H·H + head norm H;
  its embedding and head are shared with the main model and not counted again.
- Active: routed experts counted top-k instead of E; everything else as in total.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields

from checkpoints.arch import BY_MODEL_TYPE, named_shapes
from checkpoints.arch.glm5 import indexer_types
from sao_megatron.core.shape import is_mla
from sao_megatron.core.shape import routed_experts as num_experts

SHAPES: dict[str, dict] = named_shapes()


def get_shape(name: str) -> dict:
    """A copy of the named shape; unknown names raise with the list of known ones."""
    if name not in SHAPES:
        raise KeyError(f"model.shape_preset {name!r} is unknown; use one of {', '.join(SHAPES)}")
    return copy.deepcopy(SHAPES[name])


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, split by how the trainer shards them."""

    attention: int = 0        # q/k/v/o (or MLA) projections: split over TP
    attention_norms: int = 0  # q/k head norms and MLA latent norms: replicated
    indexer: int = 0          # DSA indexer projections: replicated in Megatron's GLM-5 spec
    dense_mlp: int = 0        # dense SwiGLU of non-MoE layers: split over TP
    shared_experts: int = 0   # always-on experts: split over TP like a dense MLP
    routed_experts: int = 0   # split over EP x ETP
    router: int = 0           # gate weight (+ correction bias): replicated
    norms: int = 0            # input and post-attention RMSNorm: replicated
    mtp_extra: int = 0        # MTP only: enorm, hnorm, eh_proj, head norm
    routed_active: int = 0    # routed expert parameters one token uses (top-k of E)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "routed_active")

    @property
    def active(self) -> int:
        return self.total - self.routed_experts + self.routed_active


def is_moe_layer(cfg: dict, layer: int) -> bool:
    """HF rules: DeepSeek/GLM use `first_k_dense_replace`; Qwen3-MoE uses decoder_sparse_step/mlp_only_layers."""
    if not num_experts(cfg):
        return False
    if "first_k_dense_replace" in cfg:
        return layer >= cfg["first_k_dense_replace"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    return layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def attention_params(cfg: dict) -> tuple[int, int]:
    """(projection parameters, norm parameters) of one attention block."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    if is_mla(cfg):
        qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        proj = h * qr + qr * nh * (nope + rope) + h * (kvr + rope) + kvr * nh * (nope + v) + nh * v * h
        return proj, qr + kvr
    hd = cfg.get("head_dim") or h // nh
    nkv = cfg.get("num_key_value_heads", nh)
    proj = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
    if cfg.get("attention_bias"):
        proj += nh * hd + 2 * nkv * hd
    norms = 2 * hd if has_qk_norm(cfg) else 0
    return proj, norms


def has_qk_norm(cfg: dict) -> bool:
    """Per-head q/k RMSNorm: the family decides (Qwen3 always, GLM-4.5 with use_qk_norm); configs of an
    unregistered model_type count them when use_qk_norm says so."""
    family = BY_MODEL_TYPE.get(cfg.get("model_type", ""))
    return family.qk_norm(cfg) if family else bool(cfg.get("use_qk_norm"))


def indexer_params(cfg: dict) -> int:
    """GLM-5 DSA indexer: wq_b (qr -> ih·id), wk (H -> id), weights_proj (H -> ih), k LayerNorm (w + b)."""
    ih, idim = cfg.get("index_n_heads", 0), cfg.get("index_head_dim", 0)
    if not ih:
        return 0
    h = cfg["hidden_size"]
    return cfg["q_lora_rank"] * ih * idim + h * idim + h * ih + 2 * idim


def indexer_layers(cfg: dict) -> list[bool]:
    """Per decoder layer: runs its own DSA indexer (a "full" layer of indexer_types)."""
    if not cfg.get("index_n_heads"):
        return [False] * cfg["num_hidden_layers"]
    return [kind == "full" for kind in indexer_types(cfg)]


def layer_params(cfg: dict, layer: int, mtp: bool = False, own_indexer: bool | None = None) -> LayerParams:
    """Parameters of decoder layer `layer` (MTP layers are MoE layers with the MTP extras)."""
    h = cfg["hidden_size"]
    attn, attn_norms = attention_params(cfg)
    if own_indexer is None:
        own_indexer = mtp or indexer_layers(cfg)[layer]
    parts = dict(attention=attn, attention_norms=attn_norms, indexer=indexer_params(cfg) if own_indexer else 0,
                 norms=2 * h)
    if mtp or is_moe_layer(cfg, layer):
        e, fm, k = num_experts(cfg), cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
        shared = cfg.get("n_shared_experts") or 0
        bias = e if cfg.get("scoring_func") == "sigmoid" else 0
        parts.update(routed_experts=e * 3 * h * fm, routed_active=k * 3 * h * fm,
                     shared_experts=shared * 3 * h * fm, router=e * h + bias)
    else:
        parts.update(dense_mlp=3 * h * cfg["intermediate_size"])
    if mtp:
        parts.update(mtp_extra=3 * h + 2 * h * h)
    return LayerParams(**parts)


def all_layers(cfg: dict, include_mtp: bool = False) -> list[LayerParams]:
    # Layers of one kind (dense or MoE, own indexer or not) are alike: count each kind once (the planner calls
    # this often).
    kinds: dict[tuple[bool, bool], LayerParams] = {}
    layers = []
    for i, own_indexer in enumerate(indexer_layers(cfg)):
        kind = (is_moe_layer(cfg, i), own_indexer)
        if kind not in kinds:
            kinds[kind] = layer_params(cfg, i, own_indexer=own_indexer)
        layers.append(kinds[kind])
    if include_mtp:
        layers += [layer_params(cfg, cfg["num_hidden_layers"] + i, mtp=True)
                   for i in range(cfg.get("num_nextn_predict_layers") or 0)]
    return layers


def embedding_params(cfg: dict) -> int:
    return cfg["vocab_size"] * cfg["hidden_size"]


def head_params(cfg: dict) -> int:
    """Output head (0 when tied to the embedding)."""
    return 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"]


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int                     # per token, with embedding and head
    active_without_embeddings: int  # per token, decoder layers and final norm only
    routed_experts: int             # part of total that lives in routed experts


def count_parameters(cfg: dict, include_mtp: bool = False) -> ParamCount:
    """Exact parameter count of an HF MoE config (see the module docstring for the rules)."""
    layers = all_layers(cfg, include_mtp)
    emb = embedding_params(cfg) + head_params(cfg)
    body_total = sum(p.total for p in layers) + cfg["hidden_size"]
    body_active = sum(p.active for p in layers) + cfg["hidden_size"]
    return ParamCount(total=emb + body_total, active=emb + body_active, active_without_embeddings=body_active,
                      routed_experts=sum(p.routed_experts for p in layers))
