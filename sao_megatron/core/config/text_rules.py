"""The shapes a recipe's text fields may take, checked by the sections before anything starts.

Text from a recipe ends up in paths (run.name), HTTP headers (rollout.api_key), URLs, and lines of a
rendered sbatch script (launch.partition, launch.time_limit): a '..' name writes the run into the
parent directory, a newline injects a line. Each rule raises a one-line ConfigError naming the field.
Standard library only.
"""
from __future__ import annotations

import re

from .errors import ConfigError

PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")     # starts alnum: never '.', '..', '-x'
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,+-]*$")                    # partition/account lists, no shell syntax
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
URL = re.compile(r"^https?://[A-Za-z0-9_.\-\[\]:]+(/[^\s]*)?$")
HOST = re.compile(r"^[A-Za-z0-9_.\-:\[\]]{1,253}$")
IMAGE = re.compile(r"^[A-Za-z0-9_./:@+#=-]*$")                     # registry#image:tag or a .sqsh path
COMMAND_WORD = re.compile(r"^[A-Za-z0-9_./+-]+$")
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$")            # pkg.mod:fn (or pkg.mod.fn)
WANDB_PROJECT = re.compile(r"^[^/\\#?%:\x00-\x1f]{1,128}$")
WANDB_ENTITY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
API_KEY = re.compile(r"^[\x21-\x7e]*$")   # printable, no space: it travels in an HTTP header
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def require(cond: bool, field: str, problem: str, fix: str) -> None:
    if not cond:
        raise ConfigError(field, problem, fix)


def plain_name(field: str, value: str) -> None:
    if not PLAIN_NAME.fullmatch(value):
        raise ConfigError(field, f"{value!r} is not a plain name (it becomes a directory and a job name)",
                          "use letters, digits, '.', '_' or '-', starting with a letter or digit (e.g. 'tiny-sao')")


def one_line(field: str, value: str, empty_ok: bool = True) -> None:
    """A path or free text: no newline or other control character, and not empty unless allowed."""
    if not value and not empty_ok:
        raise ConfigError(field, "is empty", f"set {field}")
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ConfigError(field, f"{value!r} holds the control character {bad!r}", "remove it (one line, no tabs)")


def matches(field: str, value: str, pattern: re.Pattern, what: str) -> None:
    if not pattern.fullmatch(value):
        raise ConfigError(field, f"{value!r} is not {what}", f"write {what}")


def import_path(field: str, value: str) -> None:
    if value and not IMPORT_PATH.fullmatch(value):
        raise ConfigError(field, f"{value!r} is not an import path", "write it as 'package.module:function'")


def slurm_seconds(field: str, value: str) -> int:
    """slurm --time in seconds: minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s (sbatch(1)); 0 is refused."""
    match = _TIME.fullmatch(value)
    if not match:
        raise ConfigError(field, f"{value!r} is not a slurm time limit",
                          "write HH:MM:SS, MM, MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. '04:00:00')")
    days, a, b, c = (int(g) if g is not None else None for g in match.groups())
    if any(x is not None and x >= 60 for x in (b, c)) or (days is not None and a >= 24):
        raise ConfigError(field, f"{value!r} has a field out of range (minutes and seconds < 60, hours < 24 "
                          "after days)", "write e.g. '04:00:00' or '1-12:00:00'")
    if days is not None:
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:
        seconds = a * 3600 + b * 60 + c
    elif b is not None:
        seconds = a * 60 + b
    else:
        seconds = a * 60
    if seconds <= 0:
        raise ConfigError(field, f"{value!r} is no time at all", "give the job a positive time limit")
    return seconds


def check_rollout_text(cfg, p: str) -> None:
    """URLs, host and key reach HTTP requests and engine command lines; the rest are paths and names."""
    for url in cfg.engine_urls:
        require(isinstance(url, str) and bool(URL.fullmatch(url)), f"{p}.engine_urls",
                f"{url!r} is not an http(s) URL", "list URLs like 'http://10.0.0.5:30000'")
    matches(f"{p}.host", cfg.host, HOST, "a host name or IP address")
    matches(f"{p}.api_key", cfg.api_key, API_KEY, "printable characters without spaces")
    import_path(f"{p}.reward_fn", cfg.reward_fn)
    for name in ("task", "dataset"):
        one_line(f"{p}.{name}", getattr(cfg, name))


def check_wandb_text(cfg, p: str) -> None:
    """wandb.init refuses these at the first step otherwise (tags: wandb_settings.py validate_tags)."""
    if cfg.wandb_entity:
        matches(f"{p}.wandb_entity", cfg.wandb_entity, WANDB_ENTITY, "a wandb entity (letters, digits, '_', '-')")
    if cfg.wandb_group:
        matches(f"{p}.wandb_group", cfg.wandb_group, WANDB_PROJECT,
                "a wandb group name (1-128 characters, none of / \\ # ? % :)")
    for tag in cfg.wandb_tags:
        require(isinstance(tag, str) and 1 <= len(tag) <= 64, f"{p}.wandb_tags", f"tag {tag!r} is not 1-64 characters "
                "of text", "write tags as strings of 1 to 64 characters")
        one_line(f"{p}.wandb_tags", tag)


def check_launch_text(cfg, p: str) -> None:
    """Every value here becomes part of a line of the sbatch script: no newline, no shell syntax."""
    for name in ("partition", "account"):
        matches(f"{p}.{name}", getattr(cfg, name), SLURM_WORD, "a slurm name (letters, digits, '_', '.', '-', ',')")
    limit = slurm_seconds(f"{p}.time_limit", cfg.time_limit)
    require(cfg.signal_seconds <= 65535, f"{p}.signal_seconds", f"{cfg.signal_seconds} is over slurm's 65535",
            "use at most 65535 seconds (e.g. 120)")
    require(not cfg.requeue or cfg.signal_seconds < limit, f"{p}.signal_seconds",
            f"{cfg.signal_seconds} s is not before the time limit {cfg.time_limit}",
            "signal well inside the time limit (e.g. 120)")
    matches(f"{p}.container", cfg.container, IMAGE, "a container image or .sqsh path")
    matches(f"{p}.python", cfg.python, COMMAND_WORD, "a python executable name or path")
    for key, value in cfg.env.items():
        matches(f"{p}.env", key, ENV_NAME, "an environment variable name")
        require(isinstance(value, (str, int, float, bool)), f"{p}.env.{key}",
                f"is a {type(value).__name__}", "write a string or a number")
        one_line(f"{p}.env.{key}", str(value))
