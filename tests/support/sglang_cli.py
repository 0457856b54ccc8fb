"""SGLang 0.5.23's command-line flags and their arity, read from the wheel's source (AST, never imported).

SGLang builds its parser from annotated namespace fields (arg_groups/arg_utils.py:298-430,
`add_cli_args_from_dataclass`) plus a few hand-written `parser.add_argument` calls
(server_args.py:351-437, `ServerArgs.add_cli_args`). `wheel_flags()` mirrors those rules:
- a field takes part when its `A[T, ...]` annotation carries an `Arg(...)` or a help string and not
  `Arg(no_cli=True)`; its names are `cli_name` (else `--field-name`) plus `aliases`;
- arity: a custom `action` -> 0 for argparse.BooleanOptionalAction (which also adds `--no-NAME`) or a
  store-true action, else its `action_kwargs` nargs, else 1; `Literal` -> 1; `list[...]` without a
  `type_parser` -> its nargs or "+"; `bool` -> 0 (store_true); anything else -> its nargs or 1.

Run as a script it prints the table rollout/engines/sglang_flags.json holds:
`.venv/bin/python tests/support/sglang_cli.py > rollout/engines/sglang_flags.json`.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_wheel import load_sources  # noqa: E402

SERVER_ARGS = "sglang/srt/server_args.py"
FIELDS_DIR = "sglang/srt/arg_groups/fields/"


def _input_namespaces(tree: ast.Module) -> list[str]:
    """Class names listed in server_args.py's `_INPUT_NAMESPACES = [...]` (the ServerArgs fields)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                for t in node.targets):
            return [e.id for e in node.value.elts]
    raise AssertionError("server_args.py no longer lists _INPUT_NAMESPACES")


def _kw(call: ast.Call) -> dict[str, ast.AST]:
    return {k.arg: k.value for k in call.keywords if k.arg}


def _const(node: ast.AST | None, default=None):
    return node.value if isinstance(node, ast.Constant) else default


def _type_arity(tp: ast.AST, meta: dict[str, ast.AST]) -> object:
    """Arity of a field's type (Optional unwrapped), as add_cli_args_from_dataclass derives it."""
    if isinstance(tp, ast.BinOp) and isinstance(tp.op, ast.BitOr):          # X | None
        tp = tp.left if _const(tp.right, 0) is None and isinstance(tp.right, ast.Constant) else tp.right
    if isinstance(tp, ast.Subscript) and isinstance(tp.value, ast.Name) and tp.value.id == "Optional":
        tp = tp.slice
    name = tp.value.id if isinstance(tp, ast.Subscript) and isinstance(tp.value, ast.Name) else \
        tp.id if isinstance(tp, ast.Name) else ""
    nargs = _const(meta.get("nargs"))
    if name == "Literal":
        return 1
    if name in ("list", "List") and "type_parser" not in meta:
        return nargs or "+"
    if name == "bool":
        return 0
    return nargs or 1


def _field_flags(stmt: ast.AnnAssign) -> dict[str, list]:
    """{flag: [arity, field name]} of one annotated field, or {} when it has no CLI."""
    ann = stmt.annotation
    if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id in ("A", "Annotated")):
        return {}
    parts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    meta = None
    for extra in parts[1:]:   # the first Arg(...) or help string wins (arg_utils.py:226-242)
        if isinstance(extra, ast.Call) and isinstance(extra.func, ast.Name) and extra.func.id == "Arg":
            meta = _kw(extra)
            break
        if isinstance(extra, (ast.Constant, ast.BinOp, ast.JoinedStr)):
            meta = {}
            break
    if meta is None or _const(meta.get("no_cli"), False):
        return {}
    field = stmt.target.id
    names = [_const(meta.get("cli_name")) or "--" + field.replace("_", "-")]
    names += [_const(a) for a in getattr(meta.get("aliases"), "elts", [])]
    action = meta.get("action")
    if action is not None:
        text = ast.unparse(action)
        if text == "argparse.BooleanOptionalAction":
            names += ["--no-" + n[2:] for n in names if n.startswith("--")]
            arity: object = 0
        elif "StoreTrue" in text or _const(action) == "store_true":
            arity = 0
        else:
            kwargs = meta.get("action_kwargs")
            extra = {_const(k): _const(v) for k, v in zip(kwargs.keys, kwargs.values)} if isinstance(kwargs, ast.Dict) else {}
            arity = extra.get("nargs") or 1
    else:
        arity = _type_arity(parts[0], meta)
    return {n: [arity, field] for n in names}


def _explicit_flags(tree: ast.Module) -> dict[str, list]:
    """The hand-written parser.add_argument(...) calls of ServerArgs.add_cli_args."""
    out: dict[str, list] = {}
    server_args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    add = next(n for n in server_args.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    for call in ast.walk(add):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"):
            continue
        kw = _kw(call)
        names = [_const(a) for a in call.args]
        action = kw.get("action")
        if "nargs" in kw and _const(kw["nargs"]) is not None:
            arity: object = _const(kw["nargs"])
        elif action is not None and ("StoreTrue" in ast.unparse(action) or _const(action) in ("store_true", "store_false")):
            arity = 0
        else:
            arity = 1
        dest = _const(kw.get("dest")) or names[0][2:].replace("-", "_")
        out.update({n: [arity, dest] for n in names})
    return out


def wheel_flags() -> dict[str, list]:
    """{flag: [arity (0, 1, "?", "*" or "+"), destination field]} of `python -m sglang.launch_server`."""
    sources = load_sources()
    tree = ast.parse(sources[SERVER_ARGS])
    wanted = set(_input_namespaces(tree))
    flags: dict[str, list] = {}
    for path, text in sorted(sources.items()):
        if not path.startswith(FIELDS_DIR):
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.name in wanted:
                wanted.discard(node.name)
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        flags.update(_field_flags(stmt))
    assert not wanted, f"namespace classes not found under {FIELDS_DIR}: {sorted(wanted)}"
    flags.update(_explicit_flags(tree))
    return dict(sorted(flags.items()))


if __name__ == "__main__":
    table = wheel_flags()
    print("{")
    print(",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items()))
    print("}")
