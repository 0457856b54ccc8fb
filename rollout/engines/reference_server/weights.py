"""HF on-disk weight names <-> the in-memory parameters of a transformers 5 model.

transformers 5 fuses each MoE layer's experts in memory, while checkpoints, SGLang and our weight
sync use per-expert names (the "HF names")::

    model.layers.L.mlp.experts.J.gate_proj.weight [I, H] -> experts.gate_up_proj[J, :I, :]
    model.layers.L.mlp.experts.J.up_proj.weight   [I, H] -> experts.gate_up_proj[J, I:, :]
    model.layers.L.mlp.experts.J.down_proj.weight [H, I] -> experts.down_proj[J]

Every other name is the parameter's own name. `resolve(name)` returns a view of the live parameter,
so loading is an in-place, bit-exact ``view.copy_(tensor)`` (same dtype required).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class UnknownWeightError(KeyError):
    """An HF name that the served model does not have."""


class WeightMap:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())
        self.params.update({k: v for k, v in model.named_buffers() if k not in self.params})

    def resolve(self, name: str) -> torch.Tensor:
        """The live tensor (or view into a fused tensor) for one HF name."""
        if name in self.params:
            return self.params[name].data
        match = _EXPERT.match(name)
        if match is None:
            raise UnknownWeightError(f"weight {name!r} is not a parameter of the served model")
        prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
        fused_name = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if fused_name not in self.params:
            raise UnknownWeightError(f"weight {name!r}: the model has no fused parameter {fused_name!r}")
        fused = self.params[fused_name].data
        if expert >= fused.shape[0]:
            raise UnknownWeightError(f"weight {name!r}: expert {expert} >= num_experts {fused.shape[0]}")
        if proj == "down_proj":
            return fused[expert]
        half = fused.shape[1] // 2    # gate first, then up (transformers 5 layout)
        return fused[expert, :half] if proj == "gate_proj" else fused[expert, half:]

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one HF-named tensor into the model; ValueError on a shape or dtype mismatch."""
        target = self.resolve(name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
        if target.dtype != tensor.dtype:
            raise ValueError(f"weight {name!r}: dtype {tensor.dtype} != model dtype {target.dtype}; "
                             "send weights in the dtype the server runs (see /sao_server_info dtype)")
        target.copy_(tensor)

    def prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """One update call's tensors as they are written (an FP8 server dequantizes here: fp8_weights.py)."""
        return tensors

    def check(self, name: str, dtype: torch.dtype, shape: list[int]) -> None:
        """Validate a name/dtype/shape triple before any bytes arrive."""
        target = self.resolve(name)
        if tuple(target.shape) != tuple(shape) or target.dtype != dtype:
            raise ValueError(f"weight {name!r}: announced {dtype}{list(shape)} but the model holds "
                             f"{target.dtype}{list(target.shape)}")

    def load_from_disk(self, model_path: str | Path) -> int:
        """Load every tensor of the safetensors files under `model_path`; returns the count."""
        staged = read_safetensors(model_path)
        for name, tensor in staged:
            self.check(name, tensor.dtype, list(tensor.shape))   # all checks before any write
        for name, tensor in staged:
            self.load(name, tensor)
        return len(staged)


def read_safetensors(model_path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the *.safetensors files in `model_path`, read fully into memory (nothing is
    written to a model here); ValueError naming the file for a missing directory, no files, or a file
    that is truncated, corrupt or unreadable. Files are read with Python's I/O, which lets go of the
    GIL while the kernel blocks; safetensors' own load_file opens the file holding it, so a file that
    hangs on open (a FIFO, a dead mount) would freeze every thread of the server, event loop included."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not Path(model_path).is_dir():
        raise ValueError(f"model_path {str(model_path)!r} is not a directory")
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path}")
    out = []
    for file in files:
        try:
            with open(file, "rb") as fh:
                out += load(fh.read()).items()
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise ValueError(f"{file.name}: not a readable safetensors file ({err})") from None
    return out


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (SGLang resolves dtypes with getattr(torch, name))."""
    short = name[len("torch."):] if isinstance(name, str) and name.startswith("torch.") else name
    dtype = getattr(torch, short, None) if isinstance(short, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return dtype
