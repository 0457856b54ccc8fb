"""A look at each dataset a recipe names, at the recipe check, so a wrong one is one line within seconds.

Without it `rollout.dataset` or an `eval.datasets` file that is a directory, empty, binary or not rows
of the prompt field failed only when the loader read it (rollout/prompts.py), after the models were
built and the engines started (24-31 s on the CPU demo) and with a traceback; an `sft.dataset` failed
with a message naming rollout.dataset. The probe reads the start of a file (PROBE_ROWS rows, a
bounded number of bytes: a dataset of gigabytes is not read whole here) and, for a directory, looks
for what the loader reads; the loader still checks every row when it runs (rollout.bad_row).
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError

PROBE_ROWS = 64              # rows of a .jsonl read at the check; one usable row passes
PROBE_BYTES = 4 << 20        # at most this much of a .jsonl is read at the check
SUFFIXES = (".jsonl", ".json", ".parquet")   # files the loader reads (rollout/prompts.py, _records)
DIRECTORY_DATA = (".jsonl", ".json", ".parquet", ".csv", ".arrow")   # what datasets.load_dataset reads in a folder


def probe_dataset(field: str, path: str, prompt_key: str = "prompt", *, label_key: str = "") -> None:
    """Refuse (ConfigError naming `field`) a dataset the loader would fail on: missing, a directory with
    no dataset in it, an unknown format, empty, not UTF-8 or not JSON rows, or rows without `prompt_key`
    (or without `label_key` when it is given)."""
    p = Path(path)
    fix = "point it at a .jsonl/.json/.parquet file of rows, or a folder holding one"
    if not p.exists():
        raise ConfigError(field, f"{path} does not exist", fix)
    if p.is_dir():
        _probe_directory(field, p, fix, prompt_key, label_key)
        return
    _probe_file(field, p, fix, prompt_key, label_key)


def _probe_file(field: str, p: Path, fix: str, prompt_key: str, label_key: str) -> None:
    path = str(p)
    if p.suffix not in SUFFIXES:
        raise ConfigError(field, f"{path} is not a dataset file (suffix {p.suffix or 'none'!r})", fix)
    if p.stat().st_size == 0:
        raise ConfigError(field, f"{path} is empty", fix)
    if p.suffix == ".parquet":
        _probe_parquet(field, p, fix)
        return
    rows = _first_rows(field, p, fix)
    keys = [prompt_key] + ([label_key] if label_key else [])
    if not any(isinstance(row, dict) and all(row.get(k) not in (None, "") for k in keys) for row in rows):
        have = sorted(rows[0]) if rows and isinstance(rows[0], dict) else type(rows[0]).__name__ if rows else "none"
        raise ConfigError(field, f"{path}: none of its first {len(rows)} rows has the field(s) {keys} "
                          f"(the first row has: {have})", "fix the rows, or name their fields in the recipe "
                          "(rollout.prompt_key/label_key, sft.prompt_key/response_key)")


def _probe_directory(field: str, p: Path, fix: str, prompt_key: str, label_key: str) -> None:
    """save_to_disk's layout passes; else the data files datasets.load_dataset would read (two levels
    deep, as a repository snapshot has them): one of the first few must hold rows (a model directory's
    config.json does not)."""
    if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
        return
    files = sorted(f for depth in ("*", "*/*") for f in p.glob(depth) if f.suffix in DIRECTORY_DATA and f.is_file())
    if any(f.suffix in (".csv", ".arrow") for f in files):
        return   # not probed here: the loader reads them
    reasons = []
    for f in files[:8]:
        try:
            _probe_file(field, f, fix, prompt_key, label_key)
            return
        except ConfigError as err:
            reasons.append(err.problem)
    found = f"; {reasons[0]}" if reasons else ""
    raise ConfigError(field, f"{p} is a directory holding no dataset (no dataset_info.json, no "
                      f"{'/'.join(DIRECTORY_DATA)} file of rows){found}", fix)


def _probe_parquet(field: str, p: Path, fix: str) -> None:
    """A parquet file starts and ends with the magic 'PAR1' (the format's spec)."""
    with p.open("rb") as f:
        head = f.read(4)
        f.seek(max(0, p.stat().st_size - 4))
        tail = f.read(4)
    if head != b"PAR1" or tail != b"PAR1":
        raise ConfigError(field, f"{p} is not a parquet file (no PAR1 magic)", fix)


def _first_rows(field: str, p: Path, fix: str) -> list:
    with p.open("rb") as f:
        raw = f.read(PROBE_BYTES if p.suffix == ".jsonl" else -1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if p.suffix != ".jsonl" or err.start < len(raw) - 4:   # not a character cut by the byte bound
            raise ConfigError(field, f"{p} is not UTF-8 text (byte {err.start}): not a dataset", fix) from None
        text = raw[:err.start].decode("utf-8")
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ConfigError(field, f"{p} is not JSON ({err})", fix) from None
        if not isinstance(data, list) or not data:
            raise ConfigError(field, f"{p} must hold a non-empty JSON list of rows", fix)
        return data[:PROBE_ROWS]
    lines = [line for line in text.splitlines() if line.strip()][:PROBE_ROWS]
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    if not rows:
        what = "holds only blank lines" if not lines else f"has no JSON row in its first {len(lines)} line(s)"
        raise ConfigError(field, f"{p} {what}", fix)
    return rows


def probe_recipe_datasets(recipe) -> None:
    """Every dataset file the recipe names: rollout.dataset, sft.dataset (when SFT runs) and the plain-path
    entries of eval.datasets ('task:' and agentic 'SCHEME:FILE' sources are checked in installed.py)."""
    rollout = recipe.rollout
    if rollout.dataset:
        probe_dataset("rollout.dataset", rollout.dataset, getattr(rollout, "prompt_key", "prompt"))
    sft = recipe.sft
    if sft.steps > 0 and sft.dataset:
        probe_dataset("sft.dataset", sft.dataset, getattr(sft, "prompt_key", "prompt"),
                      label_key=getattr(sft, "response_key", "response"))
    for source in recipe.eval.datasets:
        if ":" not in source and Path(source).exists():
            probe_dataset("eval.datasets", source)
