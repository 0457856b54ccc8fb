"""Run `sao train` on the tiny recipes as subprocesses and read back their metrics (for the demo,
algorithms, stability and online benchmarks). Each run is its own process: Megatron's parallel state
and the rollout server never leak from one run into the next. `run_all` runs independent runs
`jobs` at a time (their learning metrics do not depend on it; their wall times do).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from bench import REPO, run_archive

TINY = REPO / "recipes" / "tiny_moe_cpu.toml"          # RL from random init
SFT_DEMO = REPO / "recipes" / "tiny_sft_sao_cpu.toml"   # `make demo`: SFT, then SAO


def run_env() -> dict:
    """One OpenMP thread per process unless the caller chose otherwise: the trainer and its rollout
    server share the cores, and more threads slow the tiny model down (as `make demo` runs it)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run_all(specs: list[tuple[str, list[str]]], out_root: Path, jobs: int = 1, recipe: Path = TINY,
            timeout_s: float = 3600.0, failures: Optional[list] = None,
            walls: Optional[dict] = None, resume: bool = False, reused: Optional[list] = None,
            archive: Optional[Path] = None) -> dict[str, list[dict]]:
    """`train_run` for each (name, overrides), `jobs` at a time; {name: rows} in the specs' order.

    The first run goes alone: it creates the base model the others share (out_root/model). A run
    that fails is run once more from scratch (a loaded 2-core machine can starve a run's engine past
    its timeouts); one that fails twice is left out of the result and, with its error, appended to
    `failures`, so one run cannot void the others. Without `failures` a second failure raises.
    `walls` receives each kept run's wall seconds (its successful attempt, the subprocess as a whole).
    `resume`: a run an earlier invocation finished in out_root with the same settings (`finished_run`)
    is read back instead of run again, its name appended to `reused`, its wall time the one recorded
    then (NaN when that invocation did not record it). `archive` (bench/run_archive.py, the full designs):
    every finished run is also written there, and `resume` reads back a matching entry from there when
    out_root lacks the run, as on a new machine."""
    if not specs:
        return {}

    def attempt(name: str, overrides: list[str]):
        if resume and (done := read_back(name, overrides, out_root, recipe, archive)) is not None:
            if reused is not None:
                reused.append(name)
            if walls is not None:
                walls[name] = done[1]
            return done[0], []
        errors = []
        for _ in range(2):
            started = time.perf_counter()
            try:
                rows = train_run(name, overrides, out_root, timeout_s, recipe)
                wall = time.perf_counter() - started
                if (run_dir := Path(out_root).resolve() / name).is_dir():
                    (run_dir / run_archive.WALL_FILE).write_text(json.dumps({"wall_s": wall}))
                    if archive is not None:
                        run_archive.record(archive, name, run_dir, run_dir.parent / f"{name}.log", wall)
                if walls is not None:
                    walls[name] = wall
                return rows, errors
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                errors.append(_one_line(err))
        if failures is None:
            raise RuntimeError(f"training run {name} failed twice: {errors}")
        return None, errors

    done, (first, first_overrides) = {}, specs[0]
    results = {first: attempt(first, first_overrides)}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {name: pool.submit(attempt, name, overrides) for name, overrides in specs[1:]}
        results.update({name: future.result() for name, future in futures.items()})
    for name, (rows, errors) in results.items():
        if errors and failures is not None:
            failures.append({"run": name, "errors": errors, "kept": rows is not None})
        if rows is not None:
            done[name] = rows
    return done


def _settings(name: str, out_root: Path, overrides: list[str]) -> list[str]:
    """Every override a bench run gets (the run's own last: a later one of the same key wins)."""
    return [f"run.name='{name}'", f"run.output_dir='{out_root}'", "logging.wandb=false", "logging.console=false",
            "logging.plot=false", "checkpoint.interval=0", "checkpoint.resume='never'",
            f"model.path='{out_root / 'model'}'", *overrides]


def read_back(name: str, overrides: list[str], out_root: Path, recipe: Path,
              archive: Optional[Path]) -> Optional[tuple[list[dict], float]]:
    """A finished run from out_root, else from the archive (then also None when it has no match). A run
    found in out_root but not yet archived is archived on the way."""
    done = finished_run(name, overrides, out_root)
    if archive is None:
        return done
    if done is not None:
        held = run_archive.read_entry(run_archive.entry_path(archive, name))
        if held is None or held["epoch"] != run_archive.EPOCH:
            run_dir = Path(out_root).resolve() / name
            run_archive.record(archive, name, run_dir, run_dir.parent / f"{name}.log", done[1])
        return done
    return run_archive.lookup(archive, name, recipe, _settings(name, Path(out_root).resolve(), overrides))


def finished_run(name: str, overrides: list[str], out_root: Path) -> Optional[tuple[list[dict], float]]:
    """(rows, wall seconds) of run `name` when an earlier invocation finished it in `out_root` with these
    overrides: its log ends with `sao train`'s closing "done:" line and its resolved recipe holds the
    value of every override (the last one of a key wins, as on the command line). None otherwise."""
    import tomllib

    out_root = Path(out_root).resolve()
    log, run_dir = out_root / f"{name}.log", out_root / name
    if not run_archive.is_finished(log, run_dir):
        return None
    resolved = tomllib.loads((run_dir / "resolved_recipe.toml").read_text())
    wanted = {}
    for override in _settings(name, out_root, overrides):
        key, _, value = override.partition("=")
        wanted[key.strip()] = tomllib.loads(f"v = {value}")["v"]
    for key, value in wanted.items():
        node = resolved
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        if node != value:
            return None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if r.get("step", 0) > 0], run_archive.wall_of(run_dir)


def _one_line(err: BaseException) -> str:
    """The failure's first line and, when the log tail follows, its last line: the cause, e.g. a recipe error."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def train_run(name: str, overrides: list[str], out_root: Path, timeout_s: float = 3600.0,
              recipe: Path = TINY) -> list[dict]:
    """One `sao train` run; returns its metrics.jsonl rows. Raises with the log tail on failure.

    Every path the run gets is absolute and the subprocess runs inside `out_root`, so the benchmark
    works from any directory and whatever the run writes relative to its cwd stays with its outputs."""
    out_root = Path(out_root).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    log = out_root / f"{name}.log"
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "train", str(recipe), *_settings(name, out_root, overrides)]
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=out_root, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env=run_env())
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"training run {name} failed (exit {proc.returncode}); log {log}:\n{tail}")
    rows = [json.loads(line) for line in (out_root / name / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if r.get("step", 0) > 0]


def series(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def final_and_auc(rewards: list[float], tail: int = 5) -> tuple[float, float]:
    """Final reward = mean of the last `tail` steps; area under the curve = mean reward over all steps."""
    if not rewards:
        return float("nan"), float("nan")
    return statistics.fmean(rewards[-tail:]), statistics.fmean(rewards)


def plot_curves(curves: dict[str, list[list[float]]], title: str, path: Path, ylabel: str = "reward") -> None:
    """Mean curve with a +-1 std band per label, across seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, runs in curves.items():
        length = min(len(r) for r in runs) if runs else 0
        if not length:
            continue
        steps = list(range(1, length + 1))
        cols = list(zip(*[r[:length] for r in runs]))
        means = [statistics.fmean(c) for c in cols]
        stds = [statistics.stdev(c) if len(c) > 1 else 0.0 for c in cols]
        ax.plot(steps, means, label=label)
        ax.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=10)      # long titles stay inside the figure
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
