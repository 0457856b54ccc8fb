"""Apply a model's submitted fix to an in-memory repository ({path: content}).

A submission is one of:
- nothing ("" or whitespace): the repository as the agent left it;
- a JSON object ``{path: content}``: those files written whole;
- a unified diff (``--- a/PATH`` / ``+++ b/PATH`` headers, ``@@ -l,n +l,n @@`` hunks), optionally
  inside a fenced block. Context and removed lines must match the file exactly (trailing
  whitespace aside); a hunk whose stated line number is off is placed at the nearest exact match
  after the previous hunk, as `patch` does with an offset. ``/dev/null`` creates or deletes a file.

Anything else raises `PatchError` naming the line and the problem. Paths must stay inside the
repository (relative, no ``..``).
"""
from __future__ import annotations

import json
import posixpath
import re

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
FENCE = re.compile(r"```[a-zA-Z]*\n(.*?)```", re.DOTALL)
MAX_PATH = 200


class PatchError(ValueError):
    """A submission that cannot be applied; the message says where and why."""


def safe_path(path) -> str:
    """`path` normalised, if it names a file inside the repository; else PatchError."""
    if not isinstance(path, str) or not path.strip() or "\0" in path or len(path) > MAX_PATH:
        raise PatchError(f"bad path {path!r}: use a relative path like 'pkg/module.py'")
    norm = posixpath.normpath(path.strip())
    if norm.startswith("/") or norm == "." or norm == ".." or norm.startswith("../"):
        raise PatchError(f"path {path!r} is outside the repository")
    return norm


def apply_submission(files: dict[str, str], text: str) -> dict[str, str]:
    """The repository after `text` (see the module docstring); `files` is not modified."""
    stripped = (text or "").strip()
    if not stripped:
        return dict(files)
    if stripped.startswith("{"):
        return _apply_file_map(files, stripped)
    fenced = FENCE.findall(text)
    return apply_unified_diff(files, fenced[-1] if fenced else text)


def _apply_file_map(files: dict[str, str], text: str) -> dict[str, str]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PatchError(f"submission starts with '{{' but is not a JSON object ({exc.msg})") from exc
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise PatchError("a JSON submission maps paths to file contents: {\"path\": \"content\"}")
    out = dict(files)
    out.update({safe_path(path): content for path, content in data.items()})
    return out


def apply_unified_diff(files: dict[str, str], diff: str) -> dict[str, str]:
    out = dict(files)
    lines = diff.splitlines()
    i, applied = 0, 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1                   # "diff --git", "index ..." and prose between files
            continue
        old, new = _header_path(lines[i][4:]), _header_path(lines[i + 1][4:])
        i += 2
        hunks = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"line {i}: file header for {new or old} has no @@ hunk after it")
        _apply_file(out, old, new, hunks)
        applied += 1
    if not applied:
        raise PatchError("no '--- a/PATH' + '+++ b/PATH' header found; submit a unified diff, "
                         "a JSON object {path: content}, or nothing")
    return out


def _header_path(field: str):
    name = field.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    if name.startswith(("a/", "b/")):
        name = name[2:]
    return safe_path(name)


def _parse_hunk(lines: list[str], i: int):
    """(start, old_lines, new_lines) of the hunk at line i, and the index after it."""
    match = HUNK.match(lines[i])
    if not match:
        raise PatchError(f"line {i + 1}: malformed hunk header {lines[i][:60]!r}; expected '@@ -l,n +l,n @@'")
    start, old_n = int(match[1]), int(match[2] if match[2] is not None else 1)
    new_n = int(match[4] if match[4] is not None else 1)
    header_line, i = i + 1, i + 1
    old, new = [], []
    while len(old) < old_n or len(new) < new_n:
        if i >= len(lines):
            raise PatchError(f"line {header_line}: hunk ends early "
                             f"({len(old)}/{old_n} old, {len(new)}/{new_n} new lines)")
        line = lines[i]
        tag, body = (line[:1], line[1:]) if line else (" ", "")
        if tag == "\\":          # "\ No newline at end of file": the last line has no newline
            i += 1
            continue
        if tag not in " -+":
            raise PatchError(f"line {i + 1}: hunk line starts with {tag!r}; expected ' ', '-' or '+'")
        if tag in " -":
            old.append(body)
        if tag in " +":
            new.append(body)
        i += 1
    while i < len(lines) and lines[i].startswith("\\"):
        i += 1
    return (start, old, new), i


def _apply_file(files: dict[str, str], old, new, hunks) -> None:
    if old is not None and old not in files:
        raise PatchError(f"{old}: no such file in the repository")
    if old is None and new in files:
        raise PatchError(f"{new}: created by the patch (--- /dev/null) but it already exists")
    content = files.get(old, "") if old is not None else ""
    source = content.splitlines()
    result, cursor = [], 0
    for start, old_lines, new_lines in hunks:
        at = _locate(source, old_lines, start, cursor, old or new)
        result.extend(source[cursor:at])
        result.extend(new_lines)
        cursor = at + len(old_lines)
    result.extend(source[cursor:])
    if old is not None:
        del files[old]
    if new is not None:
        files[new] = "\n".join(result) + ("\n" if result else "")


def _locate(source: list[str], old_lines: list[str], start: int, cursor: int, path: str) -> int:
    """Where the hunk's old lines sit: at the stated line if they match there, else the nearest match."""
    def matches(at: int) -> bool:
        window = source[at:at + len(old_lines)]
        return len(window) == len(old_lines) and all(a.rstrip() == b.rstrip() for a, b in zip(window, old_lines))

    stated = max(start - 1, 0) if old_lines else min(start, len(source))
    if stated >= cursor and matches(stated):
        return stated
    candidates = [at for at in range(cursor, len(source) - len(old_lines) + 1) if matches(at)]
    if not candidates:
        raise PatchError(f"{path}: hunk at line {start} does not match the file (context or removed lines differ)")
    return min(candidates, key=lambda at: abs(at - stated))
