"""Build this rank's model chunks (one per virtual pipeline stage) for the policy or the critic.

The critic is the same GPT backbone whose output layer is replaced by a scalar value head
(``ValueHead``: hidden -> 1, replicated over TP, zero-initialised so the first values are 0).
``freeze_attention`` (SAO's frozen-attention critic) leaves trainable only the MoE experts (routed
and shared), dense MLPs, the layer norms outside attention and the value head; embedding, attention
(incl. q/k norms) and the router are frozen, so the critic routes exactly as the policy it was
initialised from.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from . import specs
from .mla_attention import link_shared_layers


class ValueHead(torch.nn.Module):
    """Scalar head on the final hidden states, with GPTModel's output-layer call signature.

    Under sequence parallel the hidden states arrive split over TP along the sequence; they are
    gathered first (backward: take this rank's slice, since the loss is replicated on TP ranks).
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return hidden_states.float() @ self.weight.float().t(), None


def read_hf_config(model_path: str | Path) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"model.path {model_path}: no config.json (create a tiny model with "
                                f"`sao init-model --arch qwen3_moe --preset tiny DIR`)")
    return json.loads(path.read_text())


def build_chunks(hf: Mapping[str, Any], config, critic: bool, impl: str = "auto",
                 max_seq_len: int = 4096) -> list[torch.nn.Module]:
    """GPTModel per virtual stage of this pipeline rank, with the critic head on the last stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    define_missing_te_names()
    vpp = config.virtual_pipeline_model_parallel_size or 1
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model = GPTModel(config, specs.layer_spec(config, impl, vp_stage=stage),
                         vocab_size=specs.padded_vocab_size(int(hf["vocab_size"]), tp),
                         max_sequence_length=max_seq_len, pre_process=pre, post_process=post,
                         share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
                         vp_stage=stage, **specs.rotary_kwargs(hf))
        if critic and post:
            model.output_layer = ValueHead(config.hidden_size, config.sequence_parallel)
        link_shared_layers(model)
        if not getattr(config, "dsa_indexer_loss_coeff", None):
            freeze_indexers(model)
        if torch.cuda.is_available():   # never under the CPU shim (parallel/cpu_shim.py: CUDA absent)
            # Megatron's own get_model does this: its linears allocate on current_device(), but torch
            # norms (no TE, no Apex) and the value head are built on the CPU
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def define_missing_te_names() -> None:
    """Megatron-Core 0.16.1 without Transformer Engine: moe_utils imports `te_general_gemm` inside a
    try and only defines it there, yet the router GEMM tests `te_general_gemm is not None`, a NameError
    on any machine without TE (the GPU kit hit it on an H200 with transformer_impl = "local"). Define
    the name as None, which is what the check means; a machine with TE keeps TE's function."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Without TE, megatron.core.extensions.transformer_engine still imports and leaves MagicMock
    # placeholders, so multi_latent_attention sets HAVE_TE = True and MLASelfAttention's
    # `isinstance(self.linear_proj, TELinear)` raises TypeError on a mock; say what is true.
    if not specs._te_importable():
        multi_latent_attention.HAVE_TE = False


def freeze_indexers(chunk: torch.nn.Module) -> None:
    """DSA indexers train only through their own KL loss (model.indexer_loss_coeff > 0); otherwise their
    weights stay exactly as loaded (no gradient, and no weight decay either)."""
    for name, param in chunk.named_parameters():
        if ".core_attention.indexer." in name:
            param.requires_grad_(False)


_CRITIC_TRAINABLE = ("mlp.experts.", "mlp.shared_experts.", "mlp.linear_fc1", "mlp.linear_fc2",
                     "input_layernorm", "pre_mlp_layernorm", "final_layernorm", "output_layer.")


def freeze_attention(chunks: list[torch.nn.Module]) -> None:
    """Freeze everything but experts/MLPs, the non-attention norms and the value head."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad_(any(key in name for key in _CRITIC_TRAINABLE))


def moe_layer_pattern(config) -> list[int]:
    """1 for MoE layers, 0 for dense, over all global layers."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)
