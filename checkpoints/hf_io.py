"""Read and write HF safetensors checkpoints tensor by tensor (no transformers import needed).

`HFCheckpoint(dir)` is a lazy read-only mapping hf_name -> tensor over model.safetensors or the
sharded model-0000x-of-0000y.safetensors + model.safetensors.index.json layout; each rank reads only
the tensors it needs. `save_hf_checkpoint` writes shards of at most `max_shard_mb` plus the index,
and copies config / tokenizer files from a source directory so engines can load the result.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Iterable, Iterator

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
AUX_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".py")


class HFCheckpoint(Mapping):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if (self.path / INDEX).is_file():
            self.weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(self.path / SINGLE, "pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.path}: no {SINGLE} or {INDEX}; "
                                    "fix: point at an HF safetensors model directory")
        self._open: dict[str, object] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(name)
        return self._file(self.weight_map[name]).get_tensor(name)

    def _file(self, fname: str):
        if fname not in self._open:
            from safetensors import safe_open

            self._open[fname] = safe_open(self.path / fname, "pt")
        return self._open[fname]

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)

    def __len__(self) -> int:
        return len(self.weight_map)

    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())


def save_hf_checkpoint(out_dir: str | Path, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       aux_from: str | Path | None = None, max_shard_mb: float = 4096) -> Path:
    """Write HF safetensors shards + index; returns out_dir. Tensors are streamed shard by shard."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    limit = int(max_shard_mb * 2**20)
    shards, current, size = [], {}, 0
    for name, tensor in named_tensors:
        if name in current or any(name in s for s in shards):
            raise ValueError(f"tensor {name} appears twice in the stream")
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            shards.append(_flush(out, len(shards), current, save_file))
            current, size = {}, 0
        current[name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if current or not shards:
        shards.append(_flush(out, len(shards), current, save_file))
    _write_index(out, shards)
    if aux_from is not None:
        copy_aux_files(aux_from, out)
    return out


def _flush(out: Path, i: int, tensors: dict, save_file) -> set:
    save_file(tensors, str(out / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
    return set(tensors)


def _write_index(out: Path, shards: list[set]) -> None:
    """Rename shards to HF's model-0000i-of-0000n pattern and write the index."""
    n = len(shards)
    weight_map = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / f"model-{i:05d}.safetensors").rename(out / final)
        weight_map.update({name: final for name in names})
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))


def copy_aux_files(src: str | Path, dst: str | Path) -> None:
    """Copy config, generation config and tokenizer files (not weights) from src to dst."""
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix in AUX_SUFFIXES and f.name != INDEX:
            shutil.copy2(f, Path(dst) / f.name)
