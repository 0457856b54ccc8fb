"""`sao bench NAME [--quick]`: run a benchmark from bench/, write results/NAME.json, print its summary,
and re-render the results report (bench/report.py) from the JSON files in the out dir.

Each bench/NAME.py exposes ``run(quick: bool) -> dict``; the dict's "summary" (a string) is printed and
everything is written as JSON. Numbers are measured side by side in one run and reported as measured.
`sao bench all` reruns every benchmark and renders docs/results.md; `sao bench report` only re-renders.
Quick (CI) runs and other out dirs render OUT_DIR/results.md, never the repository's docs/results.md.
"""
from __future__ import annotations

import importlib
import inspect
import json
import platform
import sys
import time
from pathlib import Path
from typing import Optional

BENCHES = ["demo", "engine", "pipeline", "weight_sync", "parallel", "algorithms", "stability", "online"]


def register(sub) -> None:
    parser = sub.add_parser("bench", help="Run benchmarks, write results/NAME.json and render docs/results.md")
    parser.add_argument("name", choices=BENCHES + ["all", "report"],
                        help="benchmark to run, all of them, or report (re-render from the JSON files only)")
    parser.add_argument("--quick", action="store_true", help="a small version for CI (well under a minute each)")
    parser.add_argument("--full", action="store_true",
                        help="the paper-scale version where a benchmark has one (hours on 2 CPU cores)")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated tasks for benchmarks that take them (algorithms: arithmetic,copy); "
                             "rows of other tasks already in NAME.json with the same sizes are kept")
    parser.add_argument("--out-dir", default=None,
                        help="where NAME.json (and NAME.png) go (default results/, or runs/bench-quick with --quick)")
    parser.set_defaults(func=run)


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


def run_one(name: str, quick: bool, out_dir: Path, full: bool = False, tasks: Optional[list[str]] = None) -> dict:
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
    result = module.run(**kwargs)
    result.setdefault("bench", name)
    result["quick"] = quick
    result["full"] = full and "full" in params
    result["machine"] = machine()
    result["wall_s"] = time.perf_counter() - started
    result["command"] = (f"sao bench {name}" + (" --quick" if quick else "") + (" --full" if result["full"] else "")
                         + (f" --tasks {','.join(tasks)}" if tasks and "tasks" in params else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=float))
    return result


def run(args) -> int:
    from bench.report import report_path, write_report

    out_dir = Path(args.out_dir or ("runs/bench-quick" if args.quick else "results"))
    names = {"all": BENCHES, "report": []}.get(args.name, [args.name])
    failed = []
    for name in names:
        try:
            result = run_one(name, args.quick, out_dir, full=args.full,
                             tasks=args.tasks.split(",") if args.tasks else None)
        except Exception as err:  # one failed benchmark must not hide the others' results
            failed.append(name)
            print(f"bench {name}: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            continue
        print(f"== {name} ==\n{result.get('summary', '')}")
    doc = write_report(out_dir, report_path(out_dir, args.quick))
    print(f"report: {doc}")
    return 1 if failed else 0
