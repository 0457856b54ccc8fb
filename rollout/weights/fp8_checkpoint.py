"""Write the block-FP8 checkpoint an FP8 SGLang engine loads (`sao convert hf-to-fp8`).

The engine of a run with rollout.engine_fp8 starts from rollout.engine_model_path, which must be a
block-FP8 checkpoint of the trainer's model (docs/weight-transports.md, "FP8 engines"). This writes one
from an HF bf16/fp32 directory with the very quantizer weight sync uses (fp8_blocks.py): each weight
SGLang holds in FP8 as float8_e4m3fn 128x128 blocks plus `<name>_scale_inv`, the rest unchanged, and
config.json with the `quantization_config` that makes SGLang's Fp8Config fp8-serialized with 128x128
blocks (layers/quantization/fp8.py:346-386), keys as DeepSeek-V3's FP8 checkpoint spells them.
"""
from __future__ import annotations

import json
from pathlib import Path

from .fp8_blocks import BLOCK, Fp8Layout, quantize_stream


def quantization_config(ignored: tuple[str, ...] = ()) -> dict:
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    if ignored:
        config["modules_to_not_convert"] = list(ignored)
    return config


def write_block_fp8_checkpoint(hf_dir: str | Path, out_dir: str | Path, ignored: tuple[str, ...] = (),
                               max_shard_mb: float = 4096) -> Path:
    """hf_dir (an unquantized HF checkpoint) -> out_dir (block-FP8, tokenizer and other files copied)."""
    from checkpoints.hf_io import HFCheckpoint, save_hf_checkpoint

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{hf_dir / 'config.json'} already has a quantization_config "
                         f"({config['quantization_config'].get('quant_method')!r}); convert an unquantized checkpoint")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty; pass a new directory")
    layout = Fp8Layout(ignored=tuple(n for i in ignored for n in (i.removeprefix("model."), f"model.{i.removeprefix('model.')}")))
    save_hf_checkpoint(out_dir, quantize_stream(HFCheckpoint(hf_dir).items(), layout), aux_from=hf_dir,
                       max_shard_mb=max_shard_mb)
    config["quantization_config"] = quantization_config(tuple(ignored))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
