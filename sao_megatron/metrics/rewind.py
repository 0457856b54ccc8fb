"""A resume goes back to its checkpoint's step: the metric rows logged after it are cut, so no step repeats.

A run logs step N before (or without) saving it: a crash after step 7 of a run saving every 5 steps
resumes at 5 and logs 6 and 7 again; a resume that falls back past a bad checkpoint, or starts over
(checkpoint.resume = never), goes back further. `cut_metrics_after` keeps metrics.jsonl's rows 1..step
and drops the rest (value-pretraining rows, negative steps, too: pretraining runs again on every start).

wandb cannot take a step lower than one it has (it drops such rows with a warning), and its rewind
(`wandb.init(resume_from="<id>?_step=N")`) needs a server-side feature, so it is not used: a resume
that cuts rows logs to a new wandb run instead of the old one (`rewind_metrics`).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def cut_metrics_after(path: Path, step: int) -> int:
    """Keep the rows of `path` (metrics.jsonl) with 1 <= step <= `step`; drop the rest, and a line torn
    by a crash mid-write. Atomic (a temp file, then os.replace). Returns how many rows were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with path.open("rb") as f:
        for line in f:
            if _row_step(line) is not None and 1 <= _row_step(line) <= step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
            elif line.strip():
                dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)
    return dropped


def rewind_metrics(run_dir: Path, step: int, wandb_run_id: str) -> str:
    """Cut `<run_dir>/metrics.jsonl` back to `step` (one line when rows go); returns the wandb run id to
    resume: the old one, or '' (a new run) when rows were cut, since wandb cannot go back a step."""
    dropped = cut_metrics_after(Path(run_dir) / "metrics.jsonl", step)
    if not dropped:
        return wandb_run_id
    wandb = f"; wandb cannot go back a step: this run logs to a new wandb run (the old one: {wandb_run_id})" \
        if wandb_run_id else ""
    print(f"metrics: resuming at step {step}, cut {dropped} row(s) logged after it from metrics.jsonl{wandb}",
          file=sys.stderr)
    return ""


def _row_step(line: bytes):
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
