"""`--quantization fp8`: the reference server as SGLang 0.5.23 serving a block-FP8 model.

SGLang serving a block-FP8 checkpoint holds its quantized linear layers as float8_e4m3fn 128x128
blocks with float32 `weight_scale_inv` (rollout/weights/fp8_blocks.py has the facts and the layout).
This server runs a float model on CPU, so it keeps the model in its dtype and holds what an FP8
engine serves in it:
- at start, every FP8-held weight of the (bf16) checkpoint is quantized into 128x128 blocks and
  dequantized back in place: the model serves the block-FP8 version of the checkpoint, as SGLang
  serves a checkpoint re-blocked by a conversion tool;
- an update must bring each FP8-held weight as float8_e4m3fn with its `<name>_scale_inv` (float32,
  one per block) in the same call; the pair is dequantized (SGLang's block_quant_dequant: q * scale
  per block) into the model's dtype, so the model serves exactly what an FP8 engine computes with.
Refused with a 400 naming the tensor, before anything is written: a FP8-held weight in another dtype
(real SGLang would `param.data.copy_()` the bf16 values into its float8 parameter without a scale,
layers/parameter.py:145-317, and keep the old scale: wrong weights, no error; that silent failure is why
we refuse), a FP8 weight without its scale in the same call, a scale of a weight the engine holds
unquantized, a float8 tensor for a weight that is not FP8-held, and a scale of the wrong shape.
Keeping float parameters instead of FP8 ones is our choice: torch has no FP8 matmul on CPU, and the
dequantized values are bit-for-bit what the FP8 weight means, so logprobs and /weights_checker
(which hashes the served float model) stay those of the FP8 engine's values.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from rollout.weights.fp8_blocks import (SCALE_DTYPE, SCALE_SUFFIX, WIRE_DTYPE, Fp8Layout, dequantize_block_fp8,
                                        layout_from_quantization_config, quantize_block_fp8, scale_name)

from .weights import WeightMap

_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def layout_for_model(model_dir: str | Path, config: dict) -> Fp8Layout:
    """The checkpoint's own block-FP8 layout when its config.json has one, else the default layout
    (every linear layer FP8): the block-FP8 version of a bf16 checkpoint."""
    if isinstance(config.get("quantization_config"), dict):
        return layout_from_quantization_config(config, str(Path(model_dir) / "config.json"))
    return Fp8Layout()


class Fp8WeightMap:
    """WeightMap's interface (resolve, check, load, load_from_disk, prepare) over a model served as FP8."""

    def __init__(self, weights: WeightMap, layout: Fp8Layout):
        self.weights, self.layout = weights, layout
        self.resolve, self.check, self.load = weights.resolve, weights.check, weights.load

    def hf_names(self) -> list[str]:
        """Every HF name of the served model (fused experts listed per expert)."""
        names = []
        for name, tensor in self.weights.params.items():
            fused = _FUSED.match(name)
            if fused is None:
                names.append(name)
                continue
            projs = ("gate_proj", "up_proj") if fused["kind"] == "gate_up_proj" else ("down_proj",)
            names += [f"{fused['prefix']}.{j}.{p}.weight" for j in range(tensor.shape[0]) for p in projs]
        return names

    def quantize_served(self) -> int:
        """Round every FP8-held weight to its 128x128 blocks in place; returns how many."""
        count = 0
        with torch.no_grad():
            for name in self.hf_names():
                if self.layout.holds_fp8(name):
                    view = self.resolve(name)
                    q, scale = quantize_block_fp8(view, self.layout.block)
                    view.copy_(dequantize_block_fp8(q, scale, view.dtype, self.layout.block))
                    count += 1
        return count

    def prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """One update call's tensors -> (HF name, tensor in the model's dtype); ValueError naming the
        first tensor an FP8 engine would not take (module docstring)."""
        by_name = dict(tensors)
        out = []
        for name, tensor in tensors:
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if not self.layout.holds_fp8(weight):
                    raise ValueError(f"weight {name!r}: this engine holds {weight!r} unquantized, it has no "
                                     "block scale")
                if weight not in by_name:
                    raise ValueError(f"weight {name!r} arrived without {weight!r} in the same call; send the "
                                     "FP8 weight and its scale together")
                continue
            if not self.layout.holds_fp8(name):
                if tensor.dtype == WIRE_DTYPE:
                    raise ValueError(f"weight {name!r} arrived as {WIRE_DTYPE} but this engine holds it "
                                     "unquantized; send it in the model's dtype")
                out.append((name, tensor))
                continue
            out.append((name, self._dequantized(name, tensor, by_name.get(scale_name(name)))))
        return out

    def _dequantized(self, name: str, q: torch.Tensor, scale) -> torch.Tensor:
        if q.dtype != WIRE_DTYPE:
            raise ValueError(f"weight {name!r} is held in FP8 by this engine (--quantization fp8) but arrived as "
                             f"{q.dtype}; send {WIRE_DTYPE} 128x128 blocks with {scale_name(name)!r} (SGLang "
                             f"would copy {q.dtype} values into its float8 parameter unscaled and keep the old "
                             "scale: wrong weights, no error)")
        if scale is None:
            raise ValueError(f"weight {name!r} arrived without {scale_name(name)!r} in the same call; an FP8 "
                             "weight needs its block scales")
        if scale.dtype != SCALE_DTYPE:
            raise ValueError(f"weight {scale_name(name)!r}: dtype {scale.dtype}, SGLang's weight_scale_inv is "
                             f"{SCALE_DTYPE}")
        target = self.resolve(name)
        if tuple(q.shape) != tuple(target.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(q.shape)} != model shape {tuple(target.shape)}")
        try:
            return dequantize_block_fp8(q, scale, target.dtype, self.layout.block)
        except ValueError as err:
            raise ValueError(f"weight {scale_name(name)!r}: {err}") from None

    def load_from_disk(self, model_path: str | Path) -> int:
        """Every tensor of the safetensors files under `model_path`, FP8 pairs dequantized; the count of
        model weights written."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_path}")
        tensors = [item for file in files for item in load_file(str(file)).items()]
        staged = self.prepare(tensors)
        for name, tensor in staged:   # all checks before any write
            self.check(name, tensor.dtype, list(tensor.shape))
        for name, tensor in staged:
            self.load(name, tensor)
        return len(staged)
