"""Run one benchmark and write OUT_DIR/NAME.json with what it measured, on what machine, by which command.

Each bench/NAME.py exposes ``run(quick: bool, ...) -> dict``; optional keyword arguments (out_dir,
full, tasks, jobs) are passed only to benchmarks whose run() takes them. `out_dir` must be absolute: the
training benchmarks start `sao train` subprocesses that receive paths under it.
"""
from __future__ import annotations

import importlib
import inspect
import json
import platform
import time
from pathlib import Path
from typing import Optional


def machine() -> dict:
    """What the numbers were measured on: CPUs, memory, accelerator and the library versions."""
    import os
    from importlib import metadata

    import torch

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "memory_gib": round(memory / 2**30, 1) if memory else None, "accelerator": accelerator,
            "torch": torch.__version__, "megatron_core": version("megatron-core")}


def commit() -> Optional[str]:
    """The checkout's commit, '+dirty' when tracked files differ from it (None outside a git checkout)."""
    import subprocess

    from bench import REPO

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return (head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def run_one(name: str, quick: bool, out_dir: Path, full: bool = False, tasks: Optional[list[str]] = None,
            jobs: int = 1, arms: Optional[list[str]] = None, resume: bool = False) -> dict:
    """Run bench/NAME.py and write OUT_DIR/NAME.json; returns the result dict."""
    module = importlib.import_module(f"bench.{name.replace('-', '_')}")
    started = time.perf_counter()
    kwargs = {"quick": quick}
    params = inspect.signature(module.run).parameters
    if "out_dir" in params:
        kwargs["out_dir"] = out_dir  # benchmarks that draw a PNG put it beside the JSON
    if full and "full" in params:
        kwargs["full"] = True
    if tasks and "tasks" in params:
        kwargs["tasks"] = tasks
    if "jobs" in params:
        kwargs["jobs"] = jobs
    if arms and "arms" in params:
        kwargs["arms"] = arms
    if resume and "resume" in params:
        kwargs["resume"] = True
    result = module.run(**kwargs)
    result.setdefault("bench", name)
    result["quick"] = quick
    result["full"] = full and "full" in params
    result["machine"] = machine()
    result["commit"] = commit()
    result["wall_s"] = time.perf_counter() - started
    result["command"] = (f"sao bench {name}" + (" --quick" if quick else "") + (" --full" if result["full"] else "")
                         + (f" --tasks {','.join(tasks)}" if tasks and "tasks" in params else "")
                         + (f" --arms {','.join(arms)}" if arms and "arms" in params else "")
                       + (f" --jobs {jobs}" if jobs > 1 and "jobs" in params else "")
                       + (" --resume" if resume and "resume" in params else ""))
    if "jobs" in params:
        result["jobs"] = jobs
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=float))
    return result
