"""`sao train --help-recipe`: every recipe field with its type, default, accepted values and doc.

Generated from the typed sections in schema.py (the dataclass fields, their ``doc`` and ``bounds``
metadata), so the help cannot drift from what the recipe loader accepts. Standard library only.
"""
from __future__ import annotations

import dataclasses
import json
import textwrap
import typing

from .bounds import parse_bounds  # noqa: F401  (re-exported: the help's reader of bounds)
from .presets import PRESETS
from .schema import SECTIONS


def type_name(hint) -> str:
    """int, float, str, bool, list, table; a Literal as its choices; Optional[X] as 'X or unset'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return f"{type_name(inner[0])} or unset" if len(inner) == 1 else " | ".join(type_name(a) for a in inner)
    return {dict: "table"}.get(hint, getattr(hint, "__name__", str(hint)))


def toml_value(value) -> str:
    """A default as it is written in a recipe (None: the field is left out)."""
    if value is None:
        return "unset"
    return json.dumps(value)


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def preset_fields(section: str) -> list[str]:
    """Keys of `section` that some algorithm.name preset fills when the recipe leaves them out."""
    prefix = section + "."
    return sorted({dotted[len(prefix):] for preset in PRESETS.values() for dotted in preset if dotted.startswith(prefix)})


def section_help(section: str, cls, width: int = 100) -> str:
    hints = typing.get_type_hints(cls)
    lines = [f"[{section}]"]
    for f in dataclasses.fields(cls):
        head = f"  {f.name}: {type_name(hints[f.name])} = {toml_value(field_default(f))}"
        if f.metadata.get("bounds"):
            head += f"  (range {f.metadata['bounds']})"
        lines.append(head)
        lines += textwrap.wrap(f.metadata.get("doc", ""), width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    filled = preset_fields(section)
    if filled:
        lines += textwrap.wrap(f"Filled by the algorithm.name preset when the recipe leaves them out "
                               f"(docs/algorithms.md): {', '.join(filled)}.", width,
                               initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def recipe_help(width: int = 100) -> str:
    """The whole help text: one block per section, in recipe order."""
    intro = ("Recipe fields: write them in a TOML recipe under [section], or override on the command line as "
             "section.key=value. Each line: name: type = default (range of accepted values); then what it does. "
             "Cross-field checks (parallel layout, algorithm vs critic) run on the whole recipe. A recipe may "
             "start with base = \"other.toml\" (relative to it): that recipe's values, with this one's merged over "
             "them table by table (recipe_base.py).")
    parts = ["\n".join(textwrap.wrap(intro, width))]
    parts += [section_help(name, cls, width) for name, cls in SECTIONS.items()]
    return "\n\n".join(parts) + "\n"
