"""Path-valued recipe fields hold paths the OS can take, checked before any of them reaches a stat.

A NUL byte (TOML allows "\\u0000") makes `os.stat` raise ValueError, and a component longer than the
filesystem's name limit, or a path past PATH_MAX, raises OSError(ENAMETOOLONG): both used to escape the
recipe check as tracebacks (found by tests/faults/test_override_properties.py). Linux limits
(<linux/limits.h>): NAME_MAX 255 bytes per component, PATH_MAX 4096 bytes with its NUL.
"""
from __future__ import annotations

import os

from .errors import ConfigError

NAME_MAX = 255
PATH_MAX = 4095
PATH_FIELDS = ("run.output_dir", "run.debug_dir", "model.path", "rollout.engine_model_path", "rollout.dataset",
               "algorithm.ref_model_path", "weight_sync.disk_dir", "checkpoint.resume", "sft.dataset", "sft.output")


def check_path_fields(recipe) -> None:
    """Every path field (and each eval.datasets entry, after its 'scheme:'), or a ConfigError naming it."""
    for field in PATH_FIELDS:
        section, key = field.split(".")
        check_path_text(field, getattr(getattr(recipe, section), key, "") or "")
    for source in recipe.eval.datasets:
        check_path_text("eval.datasets", source.partition(":")[2] if ":" in source else source)


def check_path_text(field: str, value: str) -> None:
    if "\x00" in value:
        raise ConfigError(field, f"{value!r} holds a NUL byte, which no path can", "remove it")
    raw = os.fsencode(value)
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if len(raw) > PATH_MAX or longest > NAME_MAX:
        raise ConfigError(field, f"{value[:40]!r}... is longer than a path can be ({len(raw)} bytes; the longest "
                          f"name in it {longest} bytes, the limits {PATH_MAX} and {NAME_MAX})", "shorten it")
