"""Block-FP8 weights for FP8 engines: what the trainer sends an engine that serves a block-FP8 model.

SGLang 0.5.23 serving a checkpoint whose config.json carries ``quantization_config = {quant_method:
"fp8", weight_block_size: [128, 128], ...}`` (GLM-4.5-FP8 re-blocked, GLM-5-FP8, DeepSeek-V3) holds
each quantized linear layer as ``weight`` float8_e4m3fn [out, in] plus ``weight_scale_inv`` float32
[ceil(out/128), ceil(in/128)] (layers/quantization/fp8.py:613-690), routed experts as
``experts.w13_weight`` / ``w2_weight`` float8_e4m3fn with ``w13_weight_scale_inv`` /
``w2_weight_scale_inv`` (fp8.py:1566, :1720-1746). A reload copies whatever arrives into those
parameters (``param.data.copy_``, layers/parameter.py:145-317): bf16 values copied into a float8 parameter
are cast without a scale, and the old scale stays, so the engine would serve wrong weights. Hence
the sender quantizes: every tensor the engine holds in FP8 travels as float8_e4m3fn blocks under its
own name and its scale as ``<name>_scale_inv``, which SGLang's loaders route like the weight
(``experts.J.gate_proj.weight_scale_inv`` -> ``experts.w13_weight_scale_inv`` by the prefix mapping
of FusedMoE.make_expert_params_mapping, layers/moe/fused_moe_triton/layer.py:1797-1822;
``q_proj.weight_scale_inv`` -> ``qkv_proj.weight_scale_inv`` by the stacked-params mapping).

The scale convention is the one SGLang dequantizes with (fp8_utils.py:2044-2066,
``block_quant_dequant``: ``w = q.float() * scale`` repeated over each 128x128 block), so per block
``scale = amax(|w|) / 448`` (448 = the largest finite float8_e4m3fn) and ``q = w / scale`` rounded to
e4m3; a block's last rows/columns may be short (shapes not divisible by 128). A block of zeros gets
scale 1.0: any positive scale dequantizes its zeros to zero, and 1.0 keeps the scale finite.

Which tensors are FP8: the linear layers SGLang builds with Fp8LinearMethod / Fp8MoEMethod
(Fp8Config.get_quant_method, fp8.py:389-476): attention and MLA projections, dense and shared-expert
MLPs, routed experts, unless the checkpoint's ``ignored_layers`` / ``modules_to_not_convert`` lists
them (fp8.py:356-364, matched as layers/quantization/utils.py:48-124 does). Not FP8: embeddings and
the LM head (VocabParallelEmbedding gets no FP8 method: vocab_parallel_embedding.py:302-306), the
router (GLM-4.5 Glm4MoeGate and DeepSeek MoEGate are plain parameters, glm4_moe.py:381-395,
deepseek_v2.py:497-518), norms, biases and the router's e_score_correction_bias.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from . import memory

BLOCK = (memory.FP8_BLOCK, memory.FP8_BLOCK)
E4M3_MAX = 448.0                  # torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"       # `X.weight` -> `X.weight_scale_inv`
WIRE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32

# HF names of the linear weights SGLang quantizes in a block-FP8 model of our families
# (Qwen3-MoE, GLM-4.5, GLM-5 / DeepSeek-V3 MLA); group "module" is the module prefix.
_LINEAR = re.compile(
    r"^(?P<module>.+\.(?:self_attn\.(?:q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
    r"|mlp\.(?:gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(?:gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)))\.weight$")
_EXPERT_LAYER = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.\d+\.")


def scale_name(name: str) -> str:
    """The scale's name for the weight `name` (SGLang's `weight_scale_inv`)."""
    return name + SCALE_SUFFIX


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK,
                       max_temp_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [n, k], scale float32 [ceil(n/bn), ceil(k/bk)]) with weight ~= q * scale per block.

    Chunks of whole block rows, so the float32 temporaries (memory.FP8_TEMP_BYTES per element: the float32
    copy and its quotient, or its abs) stay within max(max_temp_bytes, one block row) (default
    memory.FP8_TEMP_CHUNK), as the weight-sync sender's bound counts them (memory.py, read at each call).
    No block straddles a chunk, so q and scale are the bytes one pass over the whole tensor makes."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    (n, k), (bn, bk) = weight.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    budget = memory.FP8_TEMP_CHUNK if max_temp_bytes is None else max_temp_bytes
    step = max(1, int(budget // (memory.FP8_TEMP_BYTES * bn * cols * bk)))
    q = torch.empty(n, k, dtype=WIRE_DTYPE, device=weight.device)
    scale = torch.empty(rows, cols, dtype=SCALE_DTYPE, device=weight.device)
    for r in range(0, rows, step):
        _quantize_rows(weight[r * bn: (r + step) * bn], q[r * bn: (r + step) * bn], scale[r: r + step], block)
    return q, scale


def _quantize_rows(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """One chunk of block rows of quantize_block_fp8, written into q and scale."""
    (n, k), (bn, bk) = weight.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    x = weight.detach().to(torch.float32)
    if n % bn or k % bk:   # zero padding leaves every block's amax as it is
        x = torch.nn.functional.pad(x, (0, cols * bk - k, 0, rows * bn - n))
    tiles = x.view(rows, bn, cols, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    if not torch.isfinite(amax).all():
        raise ValueError("weight has inf or nan values; FP8 blocks cannot carry them")
    # a tensor divisor, not the float: CUDA divides by a Python scalar as a multiply by its reciprocal,
    # one ulp off the CPU's quotient for some amax (the GPU kit saw it on an H200); tensor / tensor is
    # the correctly rounded quotient on both, so a GPU trainer sends the bytes the CPU tests pin
    block_scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    scaled = (tiles / block_scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)   # amax / scale may round past 448
    q.copy_(scaled.view(rows * bn, cols * bk)[:n, :k])
    scale.copy_(block_scale)


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                         block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """q * scale per block, in `dtype` (what SGLang's block_quant_dequant computes)."""
    (n, k), (bn, bk) = q.shape, block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight {tuple(q.shape)} in "
                         f"{bn}x{bk} blocks (expected {expected})")
    full = scale.to(torch.float32).repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    return (q.to(torch.float32) * full).to(dtype)


def _module_path_match(ignored: str, prefix: str) -> bool:
    """SGLang's dotted-boundary match (layers/quantization/utils.py:48-59)."""
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


@dataclass(frozen=True)
class Fp8Layout:
    """Which HF tensors an FP8 engine holds in FP8, and its block size."""
    block: tuple[int, int] = BLOCK
    ignored: tuple[str, ...] = ()

    def holds_fp8(self, name: str) -> bool:
        match = _LINEAR.match(name)
        if match is None:
            return False
        module = match["module"]
        expert = _EXPERT_LAYER.match(name)
        if expert is not None:   # SGLang decides per MoE layer (FusedMoE prefix `...mlp.experts`)
            layer = expert["layer"]
            return not any(_module_path_match(i, layer) or layer in i for i in self.ignored)
        return not any(_module_path_match(i, module) for i in self.ignored)


def layout_from_quantization_config(config: dict, where: str = "config.json") -> Fp8Layout:
    """The Fp8Layout of a block-FP8 checkpoint's `quantization_config` (as Fp8Config.from_config reads it,
    fp8.py:346-386). ValueError naming `where` for anything our sender cannot match."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        raise ValueError(f"{where} has no quantization_config: SGLang would serve it in bf16 (or, with "
                         "--quantization fp8, quantize it per channel at load, replacing the parameters "
                         "that updates load into); point it at a block-FP8 checkpoint")
    method = str(quant.get("quant_method", "")).lower()
    if "mxfp8" in method or method != "fp8":
        raise ValueError(f"{where}: quant_method {method!r} is not supported for FP8 weight updates (only "
                         "'fp8' with 128x128 blocks; mxfp8 uses 1x32 E8M0 scales this sender does not make)")
    block = quant.get("weight_block_size")
    if list(block or []) != list(BLOCK):
        raise ValueError(f"{where}: weight_block_size {block!r} is not [128, 128]; this sender makes "
                         "128x128 blocks only (per-tensor/per-channel FP8 checkpoints: re-block them first)")
    ignored = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or []
    names = []
    for layer in ignored:   # both spellings, as Fp8Config.from_config keeps them (fp8.py:356-364)
        base = str(layer).removeprefix("model.")
        names += [base, f"model.{base}"]
    return Fp8Layout(tuple(block), tuple(names))


def layout_from_model_dir(path: str | Path) -> Fp8Layout:
    """Fp8Layout of the checkpoint at `path` (its config.json's quantization_config)."""
    config_path = Path(path) / "config.json"
    return layout_from_quantization_config(json.loads(config_path.read_text()), str(config_path))


def quantize_stream(named: Iterable[tuple[str, torch.Tensor]], layout: Fp8Layout,
                    max_temp_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each FP8-held weight becomes (name, float8 blocks) immediately followed by (name_scale_inv,
    float32 scales); every other tensor passes unchanged (bf16 as exported). The quantizer's float32
    temporaries stay within max(max_temp_bytes, one block row) (quantize_block_fp8; default memory.FP8_TEMP_CHUNK)."""
    for name, tensor in named:
        if not layout.holds_fp8(name):
            yield name, tensor
            continue
        try:
            q, scale = quantize_block_fp8(tensor, layout.block, max_temp_bytes)
        except ValueError as err:
            raise ValueError(f"weight {name!r}: {err}") from None
        del tensor   # the export's copy need not wait while its blocks travel
        yield name, q
        yield scale_name(name), scale


def round_trip_stream(named: Iterable[tuple[str, torch.Tensor]], layout: Fp8Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """What an FP8 engine serves for each tensor: FP8-held weights quantized and dequantized back into
    their own dtype, the rest unchanged (the trainer side of check_equal against the reference server)."""
    for name, tensor in named:
        if layout.holds_fp8(name):
            q, scale = quantize_block_fp8(tensor, layout.block)
            tensor = dequantize_block_fp8(q, scale, tensor.dtype, layout.block)
        yield name, tensor
