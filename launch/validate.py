"""`sao launch` inputs checked before a script is rendered or a file written.

The recipe's own launch values (partition, account, time limit, signal time, env, container, python)
are checked by the recipe loader (sao_megatron/core/config/text_rules.py). What only `sao launch` sees
is checked here: its command-line options and the paths it writes into the sbatch script unquoted
(`#SBATCH --chdir=`, `--output=`, the comment naming the recipe). A newline there would add a line of
its own to the script, a space would cut a directive short; both are refused with one line.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from sao_megatron.core.config import ConfigError

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
