"""Checkpoint manifests: sha256 and size of every file, verified before anything is loaded."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated or altered. The message names the file and the fallback."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def describe_files(directory: Path, names: list[str]) -> dict:
    return {n: {"bytes": (directory / n).stat().st_size, "sha256": sha256_file(directory / n)} for n in names}


def write_json_durably(path: Path, data: dict) -> None:
    """Write, flush and fsync, then rename into place (readers never see a half-written file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: Path, fallback: str) -> dict:
    if not path.is_file():
        raise CheckpointCorruptError(f"{path} is missing (incomplete checkpoint){fallback}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(f"{path} is not valid JSON ({err}){fallback}") from err
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{path} is not a manifest (a JSON object){fallback}")
    return data


def check_sizes(directory: Path, files: dict, fallback: str) -> None:
    """Every listed file is there with its manifest size (a stat each: cheap enough for every rank to
    check all of them; the checksums are split across ranks)."""
    for name, info in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointCorruptError(f"checkpoint file {path} is missing{fallback}")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointCorruptError(f"checkpoint file {path} is truncated or padded: {path.stat().st_size} "
                                         f"bytes, manifest says {info['bytes']}{fallback}")


def verify_files(directory: Path, files: dict, fallback: str) -> None:
    """Raise CheckpointCorruptError naming the first missing, truncated or altered file."""
    for name, info in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointCorruptError(f"checkpoint file {path} is missing{fallback}")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointCorruptError(f"checkpoint file {path} is truncated or padded: {size} bytes, manifest says "
                                         f"{info['bytes']}{fallback}")
        if sha256_file(path) != info["sha256"]:
            raise CheckpointCorruptError(f"checkpoint file {path} is corrupted (sha256 differs from the manifest)"
                                         f"{fallback}")
