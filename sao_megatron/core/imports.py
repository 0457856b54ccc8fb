"""Recipe fields that name code ('pkg.mod:fn'): one resolver, one-line errors naming the field."""
from __future__ import annotations

import importlib
from typing import Any


def resolve_import_path(path: str, field: str, want_callable: bool = False) -> Any:
    """'pkg.mod:name' (or 'pkg.mod.name') -> the object; ValueError naming `field` and the fix."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{field}: {path!r} is not an import path; fix: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{field}: cannot import {module_name!r} ({err}); fix: check the path and PYTHONPATH") from err
    found = getattr(module, attr, None)
    if want_callable and not callable(found):
        raise ValueError(f"{field}: {module_name} has no callable {attr!r}; fix: check the function name")
    if found is None:
        raise ValueError(f"{field}: module {module_name!r} has no {attr!r}; fix: check the name after ':'")
    return found
