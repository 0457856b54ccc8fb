"""`sao launch` inputs checked before a script is rendered or a file written.

The recipe's own launch values (partition, account, time limit, signal time, env, container, python)
are checked by the recipe loader (sao_megatron/core/config/text_rules.py). What only `sao launch` sees
is checked here: its command-line options and the paths it writes into the sbatch script unquoted
(`#SBATCH --chdir=`, `--output=`, the comment naming the recipe). A newline there would add a line of
its own to the script, a space would cut a directive short; both are refused with one line.

The recipe's machine checks (sao_megatron/core/config/installed.py) also run here, at submit, instead
of minutes or hours later when the job's `sao train` starts. Split by what the submit host can know:
- names the code decides (rollout.task, eval 'task:NAME' and source schemes, model presets): always,
  also for `sao plan`: this checkout is the code the job runs (the script cds to it).
- imports (rollout.reward_fn, a custom algorithm.loss): every mode, unless --no-check: the job's
  environment (launch.container, launch.python) may hold a module the submit host lacks.
- paths and files (model.path's config.json against the layout and the weight-sync sender's memory,
  rollout.dataset, eval files, checkpoint.resume, run.debug_dir, a writable run.output_dir): when the
  job is written or submitted, not for --dry-run (a preview, e.g. of a cluster recipe on a laptop). The
  written job already needs storage shared with the nodes (they read the resolved recipe it writes);
  --no-check skips these for paths that exist only on compute nodes (node-local staging) or inside the
  container.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from rollout.weights.memory import check_sender_memory
from sao_megatron.core.config import ConfigError
from sao_megatron.core.config.installed import (AGENTIC_EVALS, check_importable, check_model_presets, check_task,
                                                custom_import_path)
from sao_megatron.core.imports import resolve_import_path

_SCRIPT_PATH = re.compile(r"^[^\s\x00-\x1f\x7f'\"`$\\;&|<>]*$")
TRAIN_COMMAND_FIELDS = ("python", "recipe", "overrides")


def check_options(args) -> None:
    if args.nodes < 0:
        raise ConfigError("--nodes", f"{args.nodes} is negative", "pass a node count of 1 or more (0 = launch.nodes)")
    if not (args.wait_timeout > 0 and math.isfinite(args.wait_timeout)):
        raise ConfigError("--wait-timeout", f"{args.wait_timeout} is not a positive number of seconds",
                          "pass e.g. --wait-timeout 86400")
    check_train_command(args.train_command)


def check_train_command(template: str) -> None:
    """One line, and only the placeholders render fills in ({python}, {recipe}, {overrides})."""
    if any(ord(c) < 32 or ord(c) == 127 for c in template):
        raise ConfigError("--train-command", f"{template!r} holds a control character (a newline adds a line to "
                          "the script)", "write the command on one line")
    try:
        template.format(**{name: "" for name in TRAIN_COMMAND_FIELDS})
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError("--train-command", f"{template!r} has a placeholder render cannot fill ({err!r})",
                          f"use only {', '.join('{' + n + '}' for n in TRAIN_COMMAND_FIELDS)} (double other braces)")


def check_script_paths(workdir: Path, run_dir: Path, recipe_source: str) -> None:
    """Paths that reach the sbatch script outside quotes."""
    for field, value in (("working directory", str(workdir)), ("run directory", str(run_dir)),
                         ("recipe path", recipe_source)):
        if not _SCRIPT_PATH.fullmatch(value):
            raise ConfigError(field, f"{value!r} holds whitespace, a quote or shell syntax, which would break or "
                              "add lines to the sbatch script", "use a path of plain characters (run from another "
                              "directory, or set run.output_dir)")


NO_CHECK_HINT = " (or pass --no-check if only the compute nodes or the job's container have it)"
HOST_DEPENDENT = {"rollout.reward_fn", "algorithm.loss", "model.path", "rollout.dataset", "eval.datasets",
                  "checkpoint.resume", "run.debug_dir", "run.output_dir"}   # the fields --no-check is for


def check_on_submit_host(recipe, *, files: bool, environment: bool = True) -> None:
    """The machine checks valid where `sao launch` runs (see the module docstring); one ConfigError."""
    check_names(recipe)
    if not environment:
        return
    try:
        check_imports(recipe)
        if files:
            recipe.check(check_files=True)
            check_sender_memory(recipe)   # weight_sync.max_sender_mb against model.path's config.json
    except ConfigError as err:
        if err.field not in HOST_DEPENDENT:   # e.g. the model's heads against parallel.tp: wrong anywhere
            raise
        raise ConfigError(err.field, err.problem, err.fix + NO_CHECK_HINT) from None


def check_names(recipe) -> None:
    """Names this checkout's code decides: task, eval sources' task names and schemes, model presets."""
    check_model_presets(recipe.model)
    if recipe.rollout.task and not recipe.rollout.dataset:
        check_task("rollout.task", recipe.rollout.task)
    for source in recipe.eval.datasets:
        scheme, sep, arg = source.partition(":")
        if sep and scheme == "task":
            check_task("eval.datasets", arg)
        elif sep:
            schemes = resolve_import_path(AGENTIC_EVALS, "eval.datasets")
            if scheme not in schemes:   # the scheme only: its file is a path (checked with the files)
                raise ConfigError("eval.datasets", f"unknown source scheme {scheme!r} in {source!r}",
                                  f"use one of task, {', '.join(sorted(schemes))}, or a file path without ':'")


def check_imports(recipe) -> None:
    """rollout.reward_fn and a custom algorithm.loss import here (core's check, without the paths)."""
    loss = custom_import_path(recipe.algorithm.loss)
    for field, path in (("rollout.reward_fn", recipe.rollout.reward_fn), ("algorithm.loss", loss)):
        if path:
            check_importable(field, path)
