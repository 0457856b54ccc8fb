"""The pinned SGLang wheel's sources, read as text/AST (SGLang is never imported), and the facts the
behaviour contract and the reference-server tests both read from them.

The wheel is cached under build/sglang_wheel/ (`pip download sglang==0.5.23 --no-deps`, ~39 MB); if
it is absent and the registry cannot be reached, `load_sources` FAILS the test: the contract is not
optional.
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
CACHE = Path(__file__).resolve().parents[2] / "build" / "sglang_wheel"
HTTP = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"


@functools.lru_cache(maxsize=1)
def load_sources() -> dict[str, str]:
    """{path inside the wheel: source text} for every sglang/srt/*.py file."""
    wheels = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps", "-d", str(CACHE)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"package registry unreachable: `{' '.join(cmd)}` took over 600 s")
        wheels = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if done.returncode or not wheels:
            pytest.fail(f"package registry unreachable or sglang=={SGLANG_VERSION} missing: "
                        f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()[-800:]}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        return {name: wheel.read(name).decode() for name in wheel.namelist()
                if name.startswith("sglang/srt/") and name.endswith(".py")}


def source(path: str) -> str:
    """One file's text; `path` is relative to sglang/srt/ or the full wheel path."""
    sources = load_sources()
    full = path if path.startswith("sglang/") else f"sglang/srt/{path}"
    assert full in sources, f"SGLang {SGLANG_VERSION} has no {full}"
    return sources[full]


def function(path: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The (async) function `qualname` ("Class.method" or "func") defined in `path`."""
    node: ast.AST = ast.parse(source(path))
    for part in qualname.split("."):
        found = [n for n in ast.iter_child_nodes(node)
                 if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part]
        assert found, f"SGLang {path} has no {qualname} (missing {part!r})"
        node = found[0]
    return node


def strings_in(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def class_defaults(path: str, cls: str) -> dict[str, object]:
    """Annotated fields of `cls` -> default (literal) value, or ... when the field has none."""
    tree = ast.parse(source(path))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    assert node is not None, f"SGLang {path} has no class {cls}"
    out: dict[str, object] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out[stmt.target.id] = ast.literal_eval(stmt.value) if stmt.value is not None else ...
    return out


def model_info_keys() -> set[str]:
    """The keys /model_info always returns: the dict literal `result` in http_server.model_info."""
    fn = function(HTTP, "model_info")
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict) and \
                any(isinstance(t, ast.Name) and t.id == "result" for t in stmt.targets):
            return {k.value for k in stmt.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("http_server.model_info no longer builds a literal `result` dict")


def refusal_message(path: str, qualname: str) -> str:
    """The message of the first `if ...: return X(success=False, message=...)` in a method."""
    fn = function(path, qualname)
    for stmt in fn.body:
        if isinstance(stmt, ast.If) and isinstance(stmt.body[0], ast.Return):
            call = stmt.body[0].value
            kwargs = {k.arg: k.value for k in getattr(call, "keywords", [])}
            if isinstance(kwargs.get("success"), ast.Constant) and kwargs["success"].value is False:
                return ast.literal_eval(kwargs["message"])
    raise AssertionError(f"{qualname} has no early `return ...(success=False, message=...)`")
