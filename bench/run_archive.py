"""Finished training runs of the designs that outlast one machine, kept in the repository.

`sao bench algorithms --full` is about 160 training runs: some 10 h on 2 CPU cores, where a session's
machine gives 3 and a new session may get a fresh machine (an out dir outside the checkout is then
gone, as /work/evidence was on 2026-12-06). So each run of a full design is also written here, one
small file a run, and committed; `--resume` reads it back on any later machine.

An entry, ARCHIVE/<bench>/<run name>.json.gz, holds
  name, epoch, resolved (the run's resolved recipe, every value), start_sha256 (the weights it started
  from), rows (its metrics.jsonl, floats to 6 significant digits: the report prints 3), wall_s, done
  (sao train's closing line), commit (of the checkout that archived it) and date.

An entry is read back only when
  - its epoch is EPOCH (bumped when a change to the trainer voids the runs before it, as 17344e2,
    GSPO's mini-batches, did: the entries stay in git history, the design reruns them);
  - the recipe the run would get now resolves to the entry's values, every key but the two that
    name this machine's paths (PATH_KEYS);
  - the weights it would start from have the entry's sha256. The SFT start is bit-reproducible on
    this kind of machine (seeded, one OpenMP thread: two 400-step scratch:4 starts made on
    2026-12-06 have one digest), so a new machine's start matches and its runs are read back.
The start itself is archived too (ARCHIVE/<bench>/starts/<name>, 2 MB): a machine whose floating point
differs from this one would make another start, so restore_start puts the archived one in place first.
A damaged entry (not gzip, not JSON, fields missing) is named in one line and treated as missing:
the run is run again and its entry written anew.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Optional

from bench import REPO

ARCHIVE = REPO / "results" / "archive"
EPOCH = 1
PATH_KEYS = ("run.output_dir", "model.path")   # machine-specific; the start is compared by its weights
DIGITS = 6


WALL_FILE = "bench_wall_s.json"   # a finished run's wall seconds, written by bench/training_runs.py


def is_finished(log: Path, run_dir: Path) -> bool:
    """A run whose log ends with `sao train`'s closing "done:" line and whose metrics and recipe exist."""
    if not (log.is_file() and (run_dir / "metrics.jsonl").is_file() and (run_dir / "resolved_recipe.toml").is_file()):
        return False
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return bool(lines) and lines[-1].startswith("done: ")


def wall_of(run_dir: Path) -> float:
    """A finished run's wall seconds; NaN when the invocation that ran it did not record them."""
    wall_file = Path(run_dir) / WALL_FILE
    return json.loads(wall_file.read_text())["wall_s"] if wall_file.is_file() else float("nan")


def entry_path(archive: Path, name: str) -> Path:
    return Path(archive) / f"{name}.json.gz"


def weights_sha256(model_dir: Path) -> str:
    """sha256 over a model directory's weight files (*.safetensors, in name order) and its config.json."""
    model_dir = Path(model_dir).resolve()
    files = sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())
    return _digest(str(model_dir), stamp)


@lru_cache(maxsize=16)
def _digest(model_dir: str, stamp: tuple) -> str:
    h = hashlib.sha256()
    for name, _, _ in stamp:
        h.update(name.encode())
        with open(Path(model_dir) / name, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def record(archive: Path, name: str, run_dir: Path, log: Path, wall_s: float, commit: Optional[str] = None) -> Path:
    """Write run `name`'s entry from its finished run directory and log (atomically: a kill mid-write
    leaves the old entry or none, never half a file)."""
    import tomllib

    resolved = tomllib.loads((Path(run_dir) / "resolved_recipe.toml").read_text())
    rows = [_rounded(json.loads(line)) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    done = [line for line in Path(log).read_text(errors="replace").splitlines() if line.strip()][-1]
    entry = {"name": name, "epoch": EPOCH, "resolved": resolved,
             "start_sha256": weights_sha256(Path(resolved["model"]["path"])), "rows": rows,
             "wall_s": wall_s, "done": done, "commit": commit if commit is not None else _commit(),
             "date": time.strftime("%Y-%m-%d")}
    target = entry_path(archive, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(gzip.compress(json.dumps(entry, separators=(",", ":")).encode(), 9, mtime=0))
    partial.replace(target)
    return target


def lookup(archive: Path, name: str, recipe: Path, settings: list[str]) -> Optional[tuple[list[dict], float]]:
    """(rows with step > 0, wall seconds) of run `name` when its entry matches the run that `recipe` with
    `settings` (every override the run gets) would be; None otherwise."""
    entry = read_entry(entry_path(archive, name))
    if entry is None or entry.get("epoch") != EPOCH:
        return None
    wanted = resolve(recipe, settings)
    if _without_paths(entry["resolved"]) != _without_paths(wanted):
        return None
    start = _dotted(wanted, "model.path")
    if not Path(start).is_dir() or weights_sha256(Path(start)) != entry["start_sha256"]:
        return None
    return [r for r in entry["rows"] if r.get("step", 0) > 0], float(entry["wall_s"])


def read_entry(path: Path) -> Optional[dict]:
    """An entry, or None when there is none; a damaged one is named on stderr and counts as none."""
    if not path.is_file():
        return None
    try:
        entry = json.loads(gzip.decompress(path.read_bytes()))
        if not all(key in entry for key in ("epoch", "resolved", "start_sha256", "rows", "wall_s")):
            raise ValueError("fields missing")
        return entry
    except (OSError, EOFError, ValueError) as err:
        print(f"run archive: {path} is damaged ({type(err).__name__}: {err}); the run is run again and its "
              f"entry rewritten", file=sys.stderr)
        return None


def resolve(recipe: Path, settings: list[str]) -> dict:
    """The resolved recipe a run of `recipe` with `settings` writes, as its resolved_recipe.toml reads back."""
    import tomllib

    import tomli_w

    from checkpoints.arch import load_recipe

    return tomllib.loads(tomli_w.dumps(load_recipe(recipe, settings, check_files=False).resolved()))


def import_finished(out_root: Path, archive: Path) -> list[str]:
    """Archive every run an out dir holds finished (its log closing with "done:") and the archive lacks at
    this epoch; the names written. For runs a bench started before it archived (or with an archive elsewhere)."""
    written = []
    for log in sorted(Path(out_root).glob("*.log")):
        run_dir = log.parent / log.name[:-len(".log")]
        held = read_entry(entry_path(archive, run_dir.name))
        if not is_finished(log, run_dir) or (held is not None and held["epoch"] == EPOCH):
            continue
        record(archive, run_dir.name, run_dir, log, wall_of(run_dir))
        written.append(run_dir.name)
    return written


def restore_start(archive: Path, name: str, out_dir: Path) -> None:
    """Before a design makes its SFT start OUT_DIR/NAME/model: put the archived one there when the out dir
    has none, so a machine whose floating point differs still starts from the weights the archived runs
    did (bench/sft_start.py then reuses it by its marker)."""
    kept, model = Path(archive) / "starts" / name, Path(out_dir).resolve() / name / "model"
    if (kept / "sao_sft.json").is_file() and not (model / "sao_sft.json").is_file():
        import shutil

        shutil.copytree(kept, model, dirs_exist_ok=True)


def keep_start(archive: Path, model: Path, name: str) -> None:
    """After the start is made: archive it unless the archive holds one of the same SFT steps. One of the
    same steps with other weights stays (the archived runs started from it), and the out dir's is named."""
    import shutil

    kept = Path(archive) / "starts" / name
    if (kept / "sao_sft.json").is_file() and _sft_steps(kept) == _sft_steps(model):
        if weights_sha256(kept) != weights_sha256(model):
            print(f"run archive: the start {model} differs from the archived {kept}: runs from the archive are "
                  f"not read back with it; remove {model.parent} to start from the archived one", file=sys.stderr)
        return
    if kept.exists():
        shutil.rmtree(kept)
    shutil.copytree(model, kept)


def _sft_steps(model: Path):
    return json.loads((Path(model) / "sao_sft.json").read_text()).get("sft", {}).get("steps")


def _without_paths(resolved: dict) -> dict:
    out = json.loads(json.dumps(resolved))
    for key in PATH_KEYS:
        section, _, field = key.partition(".")
        out.get(section, {}).pop(field, None)
    return out


def _dotted(resolved: dict, key: str):
    section, _, field = key.partition(".")
    return resolved[section][field]


def _rounded(row: dict) -> dict:
    return {k: (float(f"{v:.{DIGITS}g}") if isinstance(v, float) else v) for k, v in row.items()}


def _commit() -> Optional[str]:
    from bench.runner import commit

    return commit()


def main(argv: list[str]) -> int:
    """python -m bench.run_archive OUT_ROOT ARCHIVE: archive the finished runs of OUT_ROOT."""
    if len(argv) != 2:
        print("usage: python -m bench.run_archive OUT_ROOT ARCHIVE (e.g. OUT/runs_algorithms "
              "results/archive/algorithms)", file=sys.stderr)
        return 2
    names = import_finished(Path(argv[0]), Path(argv[1]))
    print(f"archived {len(names)} finished run(s) of {argv[0]} into {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
