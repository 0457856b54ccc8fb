"""`sao launch RECIPE.toml --nodes N [--submit [--wait]] [--dry-run] [--no-check] [key=value ...]` (also `sao-launch`).

Writes <run_dir>/resolved_recipe.toml, <run_dir>/launch/job.sbatch (and one script per rollout
node), then optionally submits it. --dry-run prints the script and writes nothing. Before either, the
recipe's machine checks that hold on this host run (launch/validate.py: names always, reward_fn imports
and paths unless --no-check, paths not for --dry-run).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sao_megatron.core.config import ConfigError

from .render import DEFAULT_TRAIN_COMMAND, JobPaths, load_launch_recipe, render_script, write_job
from .validate import check_on_submit_host, check_options, check_script_paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe .toml")
    # REMAINDER keeps options and overrides in any order (`R --nodes 2 a.b=1 --submit`); run() re-parses it.
    parser.add_argument("overrides", nargs=argparse.REMAINDER,
                        help="section.key=value overrides, written into the resolved recipe")
    _add_options(parser)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=0, help="nodes in the allocation (default launch.nodes)")
    parser.add_argument("--submit", action="store_true", help="submit with sbatch after writing")
    parser.add_argument("--wait", action="store_true", help="with --submit: block until the job ends, exit with its code")
    parser.add_argument("--wait-timeout", type=float, default=86400.0, help="seconds --wait waits before cancelling the job")
    parser.add_argument("--dry-run", action="store_true", help="print the script, write nothing")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the submit-host checks of imports (rollout.reward_fn) and paths (model.path, "
                             "datasets, checkpoint.resume) for a job whose files or modules exist only on the compute "
                             "nodes or in its container; `sao train` still checks them when the job starts")
    parser.add_argument("--train-command", default=DEFAULT_TRAIN_COMMAND,
                        help="command each trainer rank runs; {python}, {recipe} (resolved recipe) and {overrides} "
                             "(engine URLs) are filled in (default: %(default)s)")


def _reparse(args) -> argparse.Namespace:
    """Options that came after the recipe arrive in args.overrides: parse them in any order."""
    parser = argparse.ArgumentParser(prog="sao launch", add_help=False)
    _add_options(parser)
    parser.add_argument("overrides", nargs="*")
    later = parser.parse_intermixed_args(args.overrides)
    defaults = vars(parser.parse_args([]))
    merged = vars(args).copy()
    merged.update({k: v for k, v in vars(later).items() if v != defaults.get(k)})
    merged["overrides"] = later.overrides
    return argparse.Namespace(**merged)


def run(args) -> int:
    from .submit import submit

    args = _reparse(args)
    check_options(args)
    recipe = load_launch_recipe(args.recipe, args.nodes, args.overrides)
    workdir = Path.cwd()
    check_script_paths(workdir, (workdir / recipe.run_dir).resolve(), recipe.source)
    check_on_submit_host(recipe, files=not args.dry_run, environment=not args.no_check)
    if args.dry_run:
        run_dir = (workdir / recipe.run_dir).resolve()
        paths = JobPaths(workdir, run_dir, run_dir / "resolved_recipe.toml", run_dir / "launch" / "job.sbatch")
        sys.stdout.write(render_script(recipe, paths, args.train_command))
        return 0
    paths = write_job(recipe, workdir, args.train_command)
    print(f"wrote {paths.script}\nwrote {paths.recipe}")
    if not args.submit:
        print(f"submit with: sbatch {paths.script}")
        return 0
    try:
        job = submit(paths.script, paths.run_dir, wait=args.wait, wait_timeout_s=args.wait_timeout)
    except RuntimeError as err:
        print(f"sao launch: {err}", file=sys.stderr)
        return 1
    print(f"submitted job {job.job_id}; log {job.log}")
    if job.exit_code is not None:
        print(f"job {job.job_id} finished with code {job.exit_code}")
        return job.exit_code
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sao-launch", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as err:
        print(f"sao-launch: recipe error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
