"""HF config.json -> Megatron TransformerConfig + layer spec.

What differs per family (router, attention kind, dense first layers, RoPE) is the family's entry in
checkpoints/arch (`Family.megatron`, `.mla`, `.rotary`); this module adds what every family shares:
sizes, RMSNorm, SwiGLU, parallel sizes, dtype; kernels and fusions per implementation come from
parallel/fusions.py.

Local (torch) layer specs on CPU, Transformer Engine specs on GPU: ``use_transformer_engine`` is the
single place that chooses. Multi-latent attention (GLM-5, DeepSeek-V3) runs our core attention
(parallel/mla_attention.py) on the local spec, where Megatron's DotProductAttention cannot take a q/k
head wider than the v head, and in every DSA layer on either spec (TE has no sparse attention). Other local
layers get parallel/packed_attention.py's core attention, which adds packed (THD) input to Megatron's.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from checkpoints.arch import ArchShape, SpecError, arch_shape, family_of_config
from checkpoints.arch.glm5 import indexer_types
from checkpoints.arch.megatron_parts import rope_theta

from sao_megatron.core.dims import ParallelDims
from sao_megatron.core.shape import VOCAB_PAD_MULTIPLE, padded_vocab_size   # one rule: the sender's memory reads it too


def arch_of(hf: Mapping[str, Any]) -> str:
    """The registered family name of an HF config dict (SpecError for an unsupported model_type)."""
    return family_of_config(hf).name


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
        # Kernels and fusions (grouped GEMM, permute/SwiGLU/RoPE fusion, dispatcher) come from
        # fusions.kernel_kwargs, per implementation.
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_enable_routing_replay=replay,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp_or_none, expert_model_parallel_size=dims.ep,
        num_layers_in_last_pipeline_stage=dims.megatron_last_stage_layers(shape.num_layers),
        expert_tensor_parallel_size=dims.etp, context_parallel_size=dims.cp,
        sequence_parallel=dims.sequence_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        # VPP with batched p2p gives silently wrong grads (Megatron-LM #750/#1450).
        # Micro-batches differ in shape, so pipeline p2p must exchange shapes first.
        batch_p2p_comm=dims.vpp == 1, variable_seq_lengths=dims.pp > 1,
    )


def transformer_config(hf: Mapping[str, Any], dims: ParallelDims, dtype: torch.dtype = torch.float32,
                       dispatcher: str = "alltoall", routing_replay: bool = True, fp8: str = "none",
                       impl: str = "auto"):
    """The Megatron TransformerConfig for an HF config dict under `dims`; `impl` is
    model.transformer_impl (its kernels and fusions: parallel/fusions.py)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from . import fusions
    from .fp8 import fp8_config_kwargs

    fam = family_of_config(hf)
    if dispatcher == "allgather" and dims.pp > 1:
        raise SpecError("parallel.dispatcher = allgather cannot run with pp > 1 (Megatron's allgather dispatcher "
                        "needs fixed sequence lengths, RL micro-batches vary): use alltoall")
    if hf.get("index_topk") and dims.cp > 1:
        raise SpecError(f"parallel.cp = {dims.cp} with a DSA model (index_topk in config.json): sparse attention "
                        "selects keys over the whole sequence on one rank (Megatron's DSAttention asserts cp == 1 "
                        "too); fix: set parallel.cp = 1")
    use_te = use_transformer_engine(impl)
    fusions.check_dispatcher(dispatcher, use_te, dims.tp, dims.ep, torch.cuda.is_available(),
                             dispatcher == "flex" and fusions.deep_ep_importable())
    kwargs = _common_kwargs(hf, dims, dtype, dispatcher, routing_replay)
    kwargs.update(fusions.kernel_kwargs(use_te, fam.mla, dispatcher, use_te and fusions.wgrad_kernel_importable()))
    kwargs.update(fp8_config_kwargs(fp8))
    kwargs.update(fam.megatron(hf))
    config = (MLATransformerConfig if fam.mla else TransformerConfig)(**kwargs)
    # per layer "none" | "full" | "shared": which MLA layers select keys with a DSA indexer
    config.sao_indexer_types = indexer_types(hf) if fam.mla else ["none"] * config.num_layers
    return config


def rotary_kwargs(hf: Mapping[str, Any]) -> dict:
    """GPTModel's RoPE arguments (MLA models carry RoPE in their config)."""
    return family_of_config(hf).rotary(hf)


def layer_spec(config, impl: str = "auto", vp_stage: Optional[int] = None):
    """The decoder block spec for this pipeline (and virtual) stage: TE on GPU, local torch on CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = use_transformer_engine(impl)
    if config.context_parallel_size > 1 and not use_te:
        raise SpecError(f"parallel.cp={config.context_parallel_size} needs the Transformer Engine layer spec "
                        f"(the local attention asserts cp == 1): set parallel.cp = 1 on CPU")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                       normalization="RMSNorm", vp_stage=vp_stage)
    if getattr(config, "multi_latent_attention", False):
        _use_mla_core_attention(block, config, use_te, vp_stage)
    elif not use_te:
        _use_packed_core_attention(block)
    return block


def _use_packed_core_attention(block) -> None:
    """The local core attention with THD input (parallel/packed_attention.py) in every layer: packed
    micro-batches then attend per sample; padded ones run Megatron's DotProductAttention unchanged."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    from .packed_attention import PackedDotProductAttention

    for i, spec in enumerate(block.layer_specs):
        spec = block.layer_specs[i] = copy.deepcopy(spec)
        attention = spec.submodules.self_attention.submodules
        attention.core_attention = ModuleSpec(module=PackedDotProductAttention)


def _use_mla_core_attention(block, config, use_te: bool, vp_stage: Optional[int]) -> None:
    """Put parallel/mla_attention.py's core attention, with this layer's indexer kind, in every MLA layer
    spec of this stage (always on the local spec; on TE in DSA layers). The specs Megatron returns share
    one object per layer kind, so each layer gets its own copy."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from .mla_attention import MLACoreAttention

    kinds = getattr(config, "sao_indexer_types", None) or ["none"] * config.num_layers
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    for i, spec in enumerate(block.layer_specs):
        kind = kinds[offset + i]
        if use_te and kind == "none":
            continue   # TE's fused attention takes MLA's head widths
        spec = block.layer_specs[i] = copy.deepcopy(spec)
        attention = spec.submodules.self_attention.submodules
        attention.core_attention = ModuleSpec(module=MLACoreAttention, params={"indexer_kind": kind})
        if use_te:
            _unfuse_q_norm(attention)


def _unfuse_q_norm(attention) -> None:
    """TE's spec fuses the q-latent norm into the q up projection, so MLA would hand the indexer the
    latent before its norm; transformers' indexer reads it after (q_resid = q_a_layernorm(q_a_proj(x))).
    A separate norm and a plain column-parallel up projection give the indexer the normed latent; the
    weight names stay those of the local spec (checkpoints/name_map.py)."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

    attention.linear_q_up_proj = TEColumnParallelLinear
    attention.q_layernorm = TENorm


__all__ = ["ArchShape", "SpecError", "VOCAB_PAD_MULTIPLE", "arch_of", "arch_shape", "layer_spec", "padded_vocab_size",
           "rope_theta", "rotary_kwargs", "transformer_config", "use_transformer_engine"]
