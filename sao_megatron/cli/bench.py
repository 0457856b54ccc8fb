"""`sao bench NAME [--quick]`: run a benchmark from bench/, write OUT_DIR/NAME.json, print its summary,
and re-render the results report (bench/report.py) from the JSON files in the out dir.

The benchmarks are listed once, in bench/registry.py; bench/runner.py runs one. Numbers are measured
side by side in one run and reported as measured. `sao bench all` reruns every benchmark and renders
docs/results.md; `sao bench report` only re-renders. Quick (CI) runs and other out dirs render
OUT_DIR/results.md, never the repository's docs/results.md. The out dir is resolved against the
current directory once, here, so `sao bench` works from any directory.
"""
from __future__ import annotations

import sys
from pathlib import Path

from bench.registry import RUN_ORDER


def register(sub) -> None:
    parser = sub.add_parser("bench", help="Run benchmarks, write results/NAME.json and render docs/results.md")
    parser.add_argument("name", choices=list(RUN_ORDER) + ["all", "report"],
                        help="benchmark to run, all of them, or report (re-render from the JSON files only)")
    parser.add_argument("--quick", action="store_true", help="a small version for CI (well under a minute each)")
    parser.add_argument("--full", action="store_true",
                        help="the paper-scale version where a benchmark has one (hours on 2 CPU cores)")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated tasks for benchmarks that take them (algorithms: arithmetic,copy); "
                             "rows of other tasks already in NAME.json with the same sizes are kept")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arms for benchmarks that take them (stability: sao,grpo); sao must "
                             "be one of them (every comparison is against it)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="training runs at a time in the learning benchmarks (algorithms, stability, online); "
                             "their learning metrics do not depend on it, their wall times do")
    parser.add_argument("--resume", action="store_true",
                        help="learning benchmarks: read back the training runs an earlier, interrupted invocation "
                             "finished in --out-dir (with --full: or in the run archive results/archive/, on any "
                             "machine) with the same settings instead of running them again")
    parser.add_argument("--out-dir", default=None,
                        help="where NAME.json (and NAME.png) go (default ./results, or ./runs/bench-quick with "
                             "--quick, under the current directory)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from bench.report import report_path, write_report
    from bench.runner import run_one

    if args.jobs < 1:
        print(f"sao bench: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir or ("runs/bench-quick" if args.quick else "results")).resolve()
    names = {"all": list(RUN_ORDER), "report": []}.get(args.name, [args.name])
    failed = []
    for name in names:
        try:
            result = run_one(name, args.quick, out_dir, full=args.full,
                             tasks=args.tasks.split(",") if args.tasks else None, jobs=args.jobs,
                             arms=args.arms.split(",") if args.arms else None, resume=args.resume)
        except Exception as err:  # one failed benchmark must not hide the others' results
            failed.append(name)
            print(f"bench {name}: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            continue
        print(f"== {name} ==\n{result.get('summary', '')}")
    doc = write_report(out_dir, report_path(out_dir, args.quick))
    print(f"report: {doc}")
    return 1 if failed else 0
