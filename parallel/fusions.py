"""Which Megatron kernels and fusions a model runs: a pure function of (implementation, family, dispatcher).

The GPU path is what the RL anchors on Megatron run: under Transformer Engine, grouped GEMM experts
(TEGroupedMLP instead of SequentialMLP's Python loop over the local experts), fused token permutation,
the fused SwiGLU, gradient-accumulation fusion and RoPE fusion (not for multi-latent attention). The local
(CPU) path turns every fusion off: they are CUDA kernels, and the norm fusions assert on torch norms.

Each choice and the Megatron-Core 0.16.1 constraint it meets (transformer/transformer_config.py):
- moe_grouped_gemm -> TEGroupedMLP (models/gpt/moe_module_specs.py get_moe_module_spec_for_backend reads
  config.moe_grouped_gemm through get_gpt_decoder_block_spec, gpt_layer_specs.py:542).
- moe_permute_fusion: TE >= 2.1 (transformer_config.py:1834 raises otherwise).
- bias_activation_fusion (the fused bias-SwiGLU): silu with a gated linear unit is allowed without a bias
  (:1485-1516); it must not be combined with use_te_activation_func (left False).
- gradient_accumulation_fusion: TE linears fuse the weight-gradient accumulation into main_grad
  themselves (extensions/transformer_engine.py:626), but GPTModel's output layer is Megatron's own
  ColumnParallelLinear, which raises without APEX's fused_weight_gradient_mlp_cuda
  (tensor_parallel/layers.py:924): so it is on only where that kernel imports (`wgrad_kernel`).
- apply_rope_fusion: not for MLA (MLA allows it only with YaRN, :2068, and DSA asserts it off, :1991; our
  MLA core attention applies RoPE itself).
- masked_softmax_fusion, persist_layer_norm, bias_dropout_fusion stay off: TE's attention has its own
  softmax, the layers use RMSNorm, and there is no bias and no dropout to fuse.
- moe_router_fusion stays off on every path: the fused top-k (moe_utils.py topk_routing_with_score_function,
  `if fused:` before compute_topk) never consults RouterReplay, so routing replay would be skipped.
- dispatcher "flex": moe_token_dispatcher_type="flex" with moe_flex_dispatcher_backend="deepep" (0.16.1's
  spelling; moe_enable_deepep is deprecated, :1063). DeepEP needs CUDA, the deep_ep package and TP x EP > 1
  (token_dispatcher.py:1346).

Routing replay with each: RouterReplay sits inside the router's top-k (moe_utils.py compute_topk ->
router_replay.get_replay_topk), and the router returns (probs, routing_map) built from those indices. Every
expert kernel downstream consumes only that pair: MoELayer.preprocess hands it to the dispatcher
(moe_layer.py:246-272); permute fusion permutes by routing_map; TEGroupedMLP gets the tokens per expert
the dispatcher counted from it; the flex dispatcher takes top-k of the dense probs (token_dispatcher.py:1161),
which are non-zero exactly at the replayed experts. tests/unit/parallel/test_fusions.py pins this against the source.
"""
from __future__ import annotations

DISPATCHERS = ("alltoall", "allgather", "flex")


class DispatcherError(ValueError):
    """parallel.dispatcher cannot run here."""


def kernel_kwargs(use_te: bool, mla: bool, dispatcher: str, wgrad_kernel: bool = False) -> dict:
    """TransformerConfig fields for the kernels and fusions of one implementation (Transformer Engine or
    local), family kind (multi-latent attention or not) and token dispatcher. Pure: no probing here;
    `wgrad_kernel` says whether APEX's fused weight-gradient kernel imports (see the module docstring)."""
    if dispatcher not in DISPATCHERS:
        raise DispatcherError(f"parallel.dispatcher = {dispatcher!r}; use one of {', '.join(DISPATCHERS)}")
    out = dict(masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
               moe_router_fusion=False, moe_token_dispatcher_type=dispatcher)
    out.update(moe_grouped_gemm=use_te, moe_permute_fusion=use_te, bias_activation_fusion=use_te,
               gradient_accumulation_fusion=use_te and wgrad_kernel, apply_rope_fusion=use_te and not mla)
    if dispatcher == "flex":
        out["moe_flex_dispatcher_backend"] = "deepep"
    return out


def check_dispatcher(dispatcher: str, use_te: bool, tp: int, ep: int, cuda: bool, deep_ep: bool) -> None:
    """One-line error when `dispatcher` cannot run here (pure: the caller probes cuda and deep_ep)."""
    if dispatcher != "flex":
        return
    if not (cuda and deep_ep and use_te):
        missing = "CUDA" if not cuda else "the deep_ep package (DeepEP)" if not deep_ep else "Transformer Engine"
        raise DispatcherError(f"parallel.dispatcher = flex needs {missing}; fix: use parallel.dispatcher = "
                              "alltoall here, or install DeepEP on a GPU node")
    if tp * ep <= 1:
        raise DispatcherError("parallel.dispatcher = flex needs tp * ep > 1 (Megatron's flex dispatcher "
                              "exchanges tokens over the TP x EP group); fix: use alltoall on one rank")


def deep_ep_importable() -> bool:
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False
    return True


def wgrad_kernel_importable() -> bool:
    """APEX's fused weight-gradient kernel, which Megatron's own ColumnParallelLinear needs for
    gradient_accumulation_fusion (tensor_parallel/layers.py:44-48, :924)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True
