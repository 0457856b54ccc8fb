"""Recipe files on disk: TOML reading and `base = "other.toml"` inheritance.

A recipe may start with ``base = "other.toml"`` (a path relative to the recipe that names it). The base
is read first (its own base before it, and so on), then the child is merged over it: tables merge key by
key, recursively; any other value (number, string, list) of the child replaces the base's. A chain that
comes back to a file already in it is refused with one line naming the files in order.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from .errors import ConfigError

BASE_KEY = "base"


def read_recipe_file(path: Path) -> dict:
    """The recipe at `path` with its base chain merged in (the `base` key itself removed)."""
    return _read_chain(Path(path), [])


def _read_chain(path: Path, chain: list[Path]) -> dict:
    here = path.resolve()
    if here in chain:
        names = " -> ".join(str(p) for p in chain + [here])
        raise ConfigError(BASE_KEY, f"recipes inherit in a cycle: {names}", "remove the base key that closes the cycle")
    raw = read_toml(path, chain[-1] if chain else None)
    if BASE_KEY not in raw:
        return raw
    base = raw.pop(BASE_KEY)
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{BASE_KEY} (in {path})", f"expected a recipe path string, got {type(base).__name__} "
                          f"{base!r}", 'write base = "other.toml" (relative to this recipe) at the top of the file')
    parent = _read_chain(path.parent / base, chain + [here])
    return deep_merge(parent, raw)


def read_toml(path: Path, child: Path | None = None) -> dict:
    """One TOML file as a dict; a missing, non-UTF-8 or malformed file is a one-line ConfigError."""
    field = "recipe" if child is None else f"{BASE_KEY} (in {child})"
    if not path.is_file():
        fix = "pass the path of a .toml recipe" if child is None else "give a path relative to the recipe naming it"
        raise ConfigError(field, f"{path} does not exist", fix)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(field, f"{path} is not UTF-8 text (byte {err.start}: {err.reason})",
                          "save the recipe as UTF-8 TOML") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(field, f"{path} is not valid TOML ({err})", "fix the TOML syntax") from None


def deep_merge(base: dict, child: dict) -> dict:
    """A new dict: `base` with `child` over it; tables merge recursively, everything else the child's."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
