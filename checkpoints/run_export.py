"""A run checkpoint as an HF model directory: where its parts are, and the directory an export writes.

`sao export CHECKPOINT OUT` (sao_megatron/cli/export.py) builds the model from the run's resolved
recipe on one process, loads the checkpoint's weights into it (Megatron's dist_checkpointing reshards
whatever layout the run used) and streams `RLModel.export_hf()` into `write_hf_export`. This module is
the part without a model: `find_run_checkpoint` turns any of the paths a user has at hand into the
checkpoint directory, its run directory and resolved recipe, and `write_hf_export` writes safetensors,
config.json, tokenizer and generation_config.json so transformers and SGLang load the result.

A run directory looks like (sao_megatron/trainer/entry.py, checkpoints/run_state.py)::

    runs/NAME/resolved_recipe.toml
    runs/NAME/checkpoints/latest            a file naming the newest step directory
    runs/NAME/checkpoints/step_00000040/    manifest.json, policy/ (distributed) or policy.rank*.pt, ...
    runs/NAME/hf/step_40/                   HF exports (checkpoint.hf_every, or `sao eval` of a run checkpoint)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from .hf_io import INDEX, SINGLE, save_hf_checkpoint
from .manifest import CheckpointCorruptError, read_manifest
from .run_state import LATEST, PREFIX, RunCheckpointer

RECIPE = "resolved_recipe.toml"
MARKER = "sao_export.json"      # what an export directory was made from; written last, so its presence means whole
ROLES = ("policy", "critic")


class NotARunCheckpoint(ValueError):
    """The path is not a run checkpoint (it may be an HF directory)."""


@dataclass(frozen=True)
class RunCheckpoint:
    step_dir: Path       # runs/NAME/checkpoints/step_N
    run_dir: Path        # runs/NAME
    step: int
    components: tuple    # names saved (policy, critic, driver, ...)
    distributed: tuple   # components saved as Megatron distributed checkpoints
    world_size: int

    @property
    def recipe_path(self) -> Path:
        return self.run_dir / RECIPE

    def has(self, role: str) -> bool:
        return role in self.components

    def source(self, role: str = "policy") -> dict:
        """What an export of `role` from this checkpoint records in its marker."""
        return {"checkpoint": str(self.step_dir), "step": self.step, "role": role}

    def hf_dir(self, role: str = "policy") -> Path:
        """Where exports of this checkpoint go by default: runs/NAME/hf/step_N (critic: step_N_critic)."""
        return self.run_dir / "hf" / (f"step_{self.step}" + ("" if role == "policy" else f"_{role}"))


def find_run_checkpoint(path: str | os.PathLike, verify: bool = True) -> RunCheckpoint:
    """A run checkpoint from `path`: a step_N directory, the `latest` pointer, the checkpoints/ folder or
    the run directory (both: the newest checkpoint). Raises NotARunCheckpoint naming what is missing, and
    (verify) ValueError naming a file whose size or checksum is not the manifest's."""
    path = Path(path)
    if path.is_file() and path.name == LATEST:
        path = path.parent / path.read_text().strip()
    elif (path / "checkpoints").is_dir() and not (path / "manifest.json").exists():
        path = path / "checkpoints"
    if path.is_dir() and not (path / "manifest.json").exists():
        path = RunCheckpointer(path, rank=0, world_size=1).latest() or path   # the `latest` pointer, else the newest
    if not (path / "manifest.json").is_file():
        raise NotARunCheckpoint(f"{path} is not a run checkpoint (no manifest.json; a run writes them under "
                                "runs/NAME/checkpoints/step_N)")
    try:   # every file's size and checksum, as a resume checks them, before any model is built
        checker = RunCheckpointer(path.parent, rank=0, world_size=1, barrier=lambda: None)
        top = checker.verify_whole(path) if verify else read_manifest(path / "manifest.json", "")
    except CheckpointCorruptError as err:
        raise ValueError(f"{err}; fix: export another checkpoint (an earlier step_N)") from None
    run_dir = path.resolve().parent.parent
    if not (run_dir / RECIPE).is_file():
        raise NotARunCheckpoint(f"{run_dir / RECIPE} not found: the checkpoint {path} must sit in its run directory "
                                "(runs/NAME/checkpoints/step_N) beside the recipe the run resolved")
    step = int(top.get("step", path.name.removeprefix(PREFIX) or 0))
    return RunCheckpoint(step_dir=path.resolve(), run_dir=run_dir, step=step, components=tuple(top["components"]),
                         distributed=tuple(top.get("distributed", [])), world_size=int(top["world_size"]))


def is_hf_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())


def export_is_current(out: Path, source: dict) -> bool:
    """`out` holds a whole export of `source` (the marker is written last)."""
    marker = Path(out) / MARKER
    return marker.is_file() and json.loads(marker.read_text()) == source


def write_hf_export(out: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]], aux_from: str | os.PathLike,
                    source: dict, config_update: dict | None = None, max_shard_mb: float = 4096) -> Path:
    """Write an HF model directory: safetensors shards from `tensors`, config.json / tokenizer /
    generation_config.json from `aux_from` (the model the run started from), `config_update` merged
    into config.json, then the marker naming `source`. Old weights in `out` are removed first."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)   # until the new weights are whole, nothing may call them done
    for old in list(out.glob("*.safetensors")) + [out / INDEX]:
        old.unlink(missing_ok=True)
    save_hf_checkpoint(out, tensors, aux_from=aux_from, max_shard_mb=max_shard_mb)
    config = json.loads((out / "config.json").read_text())
    if config_update:
        config.update(config_update)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not (out / "generation_config.json").is_file():
        (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
    (out / MARKER).write_text(json.dumps(source, indent=1))
    return out


def generation_config(config: dict) -> dict:
    """The generation_config.json transformers' save_pretrained would write: the special token ids."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {**{k: config[k] for k in keys if config.get(k) is not None}, "transformers_version": "5"}


__all__ = ["RunCheckpoint", "NotARunCheckpoint", "find_run_checkpoint", "is_hf_dir", "export_is_current",
           "write_hf_export", "generation_config", "ROLES", "MARKER"]
