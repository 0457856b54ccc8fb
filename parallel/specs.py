"""HF config.json -> Megatron TransformerConfig + layer spec, per architecture family.

Families (values from each model's HF config.json and transformers configuration class):
- qwen3_moe: GQA with per-head q/k RMSNorm, softmax top-k router (top-k renormalised when
  norm_topk_prob), no shared expert, every layer MoE, full RoPE.
- glm4_moe (GLM-4.5 / Air): first ``first_k_dense_replace`` layers dense, one shared expert, sigmoid router
  with expert-score-correction bias (noaux_tc), routed_scaling_factor, QKV bias, partial RoPE 0.5.
- glm5 (GLM-5-class 750B-A40B, model_type glm_moe_dsa / deepseek_v3): multi-latent attention through
  Megatron's MLATransformerConfig, first dense layers, shared expert, sigmoid router with bias.
  The DSA sparse indexer is not modelled: attention is dense MLA. MLA needs the TE spec (GPU):
  the local spec's attention cannot run it in Megatron-Core 0.16.1. MLA weights follow the name
  map in checkpoints/name_map.py (TE's fused q/kv norms included); their logits are unchecked.

Local (torch) layer specs on CPU, Transformer Engine specs on GPU: ``use_transformer_engine`` is the
single place that chooses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from .dims import ParallelDims

ARCH_OF_MODEL_TYPE = {"qwen3_moe": "qwen3_moe", "glm4_moe": "glm4_moe", "glm_moe_dsa": "glm5",
                      "deepseek_v3": "glm5"}
VOCAB_PAD_MULTIPLE = 128


class SpecError(ValueError):
    """An HF config this module cannot map; the message names the key."""


@dataclass(frozen=True)
class ArchShape:
    """The numbers layout validation needs (ParallelDims.validate)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    top_k: int
    vocab_size: int
    first_dense_layers: int = 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers


def arch_of(hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type", "")
    if model_type not in ARCH_OF_MODEL_TYPE:
        raise SpecError(f"config.json model_type {model_type!r} is not supported; "
                        f"use one of {sorted(ARCH_OF_MODEL_TYPE)}")
    return ARCH_OF_MODEL_TYPE[model_type]


def _get(hf: Mapping[str, Any], *keys, default=None):
    for key in keys:
        if key in hf and hf[key] is not None:
            return hf[key]
    if default is None:
        raise SpecError(f"config.json lacks {keys[0]!r}")
    return default


def rope_theta(hf: Mapping[str, Any]) -> float:
    """transformers 5 moved rope_theta into rope_parameters; accept both spellings."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def arch_shape(hf: Mapping[str, Any]) -> ArchShape:
    arch = arch_of(hf)
    dense = int(hf.get("first_k_dense_replace", 0)) if arch != "qwen3_moe" else 0
    return ArchShape(
        arch=arch, num_layers=int(hf["num_hidden_layers"]), hidden_size=int(hf["hidden_size"]),
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=int(_get(hf, "num_key_value_heads", default=hf["num_attention_heads"])),
        num_experts=int(_get(hf, "num_experts", "n_routed_experts", "num_local_experts")),
        top_k=int(hf["num_experts_per_tok"]), vocab_size=int(hf["vocab_size"]), first_dense_layers=dense)


def padded_vocab_size(vocab: int, tp: int) -> int:
    """Pad to a multiple of 128 (or 128*tp when tp does not divide 128) so every TP shard is equal."""
    multiple = VOCAB_PAD_MULTIPLE if VOCAB_PAD_MULTIPLE % tp == 0 else VOCAB_PAD_MULTIPLE * tp
    return -(-vocab // multiple) * multiple


def use_transformer_engine(impl: str = "auto") -> bool:
    """The one place that picks Transformer Engine (GPU) or local torch layers (CPU)."""
    if impl == "local":
        return False
    have_te = torch.cuda.is_available() and _te_importable()
    if impl == "transformer_engine" and not have_te:
        raise SpecError("model.transformer_impl = transformer_engine needs CUDA and transformer_engine: "
                        "pip install transformer-engine[pytorch] on a GPU node, or use 'auto'/'local'")
    return have_te


def _te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _common_kwargs(hf, dims: ParallelDims, dtype: torch.dtype, dispatcher: str, replay: bool) -> dict:
    shape = arch_shape(hf)
    return dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
        ffn_hidden_size=int(hf["intermediate_size"]), moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        num_moe_experts=shape.num_experts, moe_router_topk=shape.top_k,
        normalization="RMSNorm", layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        hidden_dropout=0.0, attention_dropout=0.0,
        # Fusions need CUDA kernels (and the norm fusions assert on the torch norm).
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
        moe_token_dispatcher_type=dispatcher, moe_enable_routing_replay=replay,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp_or_none, expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp, context_parallel_size=dims.cp,
        sequence_parallel=dims.sequence_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        # VPP with batched p2p gives silently wrong grads (Megatron-LM #750/#1450).
        # Micro-batches differ in shape, so pipeline p2p must exchange shapes first.
        batch_p2p_comm=dims.vpp == 1, variable_seq_lengths=dims.pp > 1,
    )


def _router_kwargs_sigmoid(hf) -> dict:
    return dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # RL keeps the pretrained correction bias fixed
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_num_groups=hf.get("n_group") if (hf.get("n_group") or 1) > 1 else None,
        moe_router_group_topk=hf.get("topk_group") if (hf.get("n_group") or 1) > 1 else None,
        moe_router_pre_softmax=False, moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=int(hf.get("n_shared_experts", 1)) * int(hf["moe_intermediate_size"]),
        moe_layer_freq=[0] * int(hf.get("first_k_dense_replace", 0))
        + [1] * (int(hf["num_hidden_layers"]) - int(hf.get("first_k_dense_replace", 0))),
    )


def transformer_config(hf: Mapping[str, Any], dims: ParallelDims, dtype: torch.dtype = torch.float32,
                       dispatcher: str = "alltoall", routing_replay: bool = True, fp8: str = "none"):
    """The Megatron TransformerConfig for an HF config dict under `dims`."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from .fp8 import fp8_config_kwargs

    arch = arch_of(hf)
    if dispatcher == "allgather" and dims.pp > 1:
        raise SpecError("parallel.dispatcher = allgather cannot run with pp > 1 (Megatron's allgather dispatcher "
                        "needs fixed sequence lengths, RL micro-batches vary): use alltoall")
    kwargs = _common_kwargs(hf, dims, dtype, dispatcher, routing_replay)
    kwargs.update(fp8_config_kwargs(fp8))
    if arch == "qwen3_moe":
        if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
            raise SpecError("qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                            "is not supported; every layer must be MoE")
        kwargs.update(num_query_groups=int(hf["num_key_value_heads"]),
                      kv_channels=int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
                      qk_layernorm=True, add_qkv_bias=bool(hf.get("attention_bias", False)),
                      moe_router_score_function="softmax",
                      moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", True)))
        return TransformerConfig(**kwargs)
    kwargs.update(_router_kwargs_sigmoid(hf))
    if arch == "glm4_moe":
        kwargs.update(num_query_groups=int(hf["num_key_value_heads"]),
                      kv_channels=int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
                      qk_layernorm=bool(hf.get("use_qk_norm", False)),
                      add_qkv_bias=bool(hf.get("attention_bias", True)))
        return TransformerConfig(**kwargs)
    kwargs.update(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=int(hf["kv_lora_rank"]),
                  qk_head_dim=int(hf["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
                  v_head_dim=int(hf["v_head_dim"]), qk_layernorm=True, rope_type="rope",
                  rotary_base=rope_theta(hf), num_query_groups=int(hf["num_attention_heads"]))
    return MLATransformerConfig(**kwargs)


def rotary_kwargs(hf: Mapping[str, Any]) -> dict:
    """GPTModel's RoPE arguments (MLA models carry RoPE in their config)."""
    if arch_of(hf) == "glm5":
        return dict(position_embedding_type="rope", rotary_base=int(rope_theta(hf)))
    percent = float(hf.get("partial_rotary_factor", 1.0))
    params = hf.get("rope_parameters") or {}
    percent = float(params.get("partial_rotary_factor", percent))
    return dict(position_embedding_type="rope", rotary_base=int(rope_theta(hf)), rotary_percent=percent)


def layer_spec(config, impl: str = "auto", vp_stage: Optional[int] = None):
    """The decoder block spec for this pipeline (and virtual) stage: TE on GPU, local torch on CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = use_transformer_engine(impl)
    if getattr(config, "multi_latent_attention", False) and not use_te:
        raise SpecError("multi-latent attention (GLM-5-class) needs the Transformer Engine layer spec: "
                        "Megatron-Core 0.16.1's local DotProductAttention cannot run MLA; use a CUDA node with TE")
    if config.context_parallel_size > 1 and not use_te:
        raise SpecError(f"parallel.cp={config.context_parallel_size} needs the Transformer Engine layer spec "
                        f"(the local attention asserts cp == 1): set parallel.cp = 1 on CPU")
    return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                      normalization="RMSNorm", vp_stage=vp_stage)
