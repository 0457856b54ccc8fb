"""Rollout engine memory per GPU (SGLang): weights, the static pool and the KV cache it leaves."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..model_shapes import count_parameters, embedding_params, is_mla, indexer_layers


@dataclass(frozen=True)
class EngineOptions:
    tp: int = 1                 # GPUs per engine (SGLang --tp-size)
    ep: int = 1                 # --ep-size (experts are split over all tp GPUs either way)
    dp_attention: int = 0       # --attn-dp-size (0 = off)
    mem_fraction: float = 0.7   # --mem-fraction-static
    fp8_weights: bool = False
    kv_dtype: str = "bf16"      # bf16 | fp8
    include_mtp: bool = False   # speculative decoding with the MTP layer


@dataclass(frozen=True)
class EngineMemory:
    weights: float              # bytes per GPU
    static_pool: float          # mem_fraction · capacity: weights + KV cache
    kv_pool: float              # bytes per GPU left for KV
    kv_bytes_per_token: float   # per GPU, all layers
    tokens_per_engine: float    # KV capacity of one engine

    @property
    def fits(self) -> bool:
        return self.kv_pool > 0


def engine_memory(cfg: dict, opts: EngineOptions, capacity: float) -> EngineMemory:
    """SGLang memory: weights split over tp (experts) and the attention-tp group (the rest);
    the static pool (mem_fraction of the GPU) holds weights and the KV cache."""
    attn_tp = opts.tp // max(opts.dp_attention, 1)
    counts = count_parameters(cfg, include_mtp=opts.include_mtp)
    linear_bytes = 1 if opts.fp8_weights else 2
    other = counts.total - counts.routed_experts - 2 * embedding_params(cfg)
    weights = (counts.routed_experts * linear_bytes / opts.tp + other * linear_bytes / attn_tp
               + 2 * embedding_params(cfg) * 2 / attn_tp)
    kv_token = kv_bytes_per_token(cfg, attn_tp, 1 if opts.kv_dtype == "fp8" else 2)
    static = opts.mem_fraction * capacity
    kv_pool = static - weights
    groups = opts.tp // attn_tp
    return EngineMemory(weights, static, kv_pool, kv_token, max(kv_pool, 0) / kv_token * groups)


DSA_QUANT_BLOCK = 128   # SGLang DSATokenToKVPool.quant_block_size (mem_cache/memory_pool.py:5279-5282)


def kv_bytes_per_token(cfg: dict, attn_tp: int, kv_bytes: int) -> float:
    """KV cache per token on one GPU: MLA caches the latent (kv_lora + rope) whole on every attention-TP
    rank; GQA caches k and v of ceil(nkv / attn_tp) heads; DSA adds the index keys (index_key_bytes)."""
    layers = cfg["num_hidden_layers"]
    if is_mla(cfg):
        per_layer = latent_bytes(cfg, kv_bytes)
    else:
        nh = cfg["num_attention_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
        per_layer = 2 * math.ceil(cfg.get("num_key_value_heads", nh) / attn_tp) * hd * kv_bytes
    return per_layer * layers + index_key_bytes(cfg)


def latent_bytes(cfg: dict, kv_bytes: int) -> int:
    """One token's MLA latent in one layer. An fp8 DSA cache keeps a fp32 scale per 128 latent channels and
    the rope part in bf16 (656 bytes for GLM-5: mem_cache/kv_cache_configurator.py:3457-3475, the layout
    of the default CUDA DSA kernels; trtllm and tilelang keep the raw 576, :3439-3455)."""
    kvr, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    if kv_bytes == 1 and cfg.get("index_topk"):
        return kvr + kvr // DSA_QUANT_BLOCK * 4 + rope * 2
    return (kvr + rope) * kv_bytes


def index_key_bytes(cfg: dict) -> int:
    """One token's DSA index keys, all layers: an fp8 key of index_head_dim and a fp32 scale per 128 channels
    (mem_cache/index_key_cache.py:41-47) in each layer with its own indexer; a layer that reuses the previous
    layer's top-k keeps none (index_key_cache.py:56-60)."""
    if not cfg.get("index_topk"):
        return 0
    dim = cfg["index_head_dim"]
    own = sum(indexer_layers(cfg))
    return own * (dim + dim // DSA_QUANT_BLOCK * 4)
