"""Cross-rank error agreement: one rank's failure outside a collective stops every rank at the same
point, with the state consistent, so all of them save the last completed step together.

The ranks issue the same collectives in the same order. A step alternates local segments (code with
no collective: packing the batch, advantages, rank 0's evaluation and logging) and collective regions
(model calls, the weight sync, a save). The loop runs each local segment under `Trainer.agreed`, which
ends it at an agreement point: one all-reduce (MAX) of a flag per rank plus the preemption flag over the
default group (gloo on CPU, NCCL on GPUs, on the device `comm_device` names). A rank that fails in the
segment skips the rest of it and still reaches the point, so every rank learns there, before any enters
the next collective, which rank failed; the first failing rank then broadcasts its one line. Agreement
points sit only where the state is consistent (before the step's first model update, or after the
step), so every rank saves the last completed step and raises `RankFailed` (agreed).

What cannot be agreed: a failure inside a collective region (a model call, including its optimizer
step, the weight sync, a save, the batch broadcast) on some ranks only. The others are then inside, or
about to enter, a collective the failing rank will not join, and whether any is pending is not
knowable; an all-reduce there would pair with a different collective. The failing rank raises
`RankFailed` (not agreed) at once, joins no further collective and exits; the others' pending collective
fails when its process is gone, or at the process-group timeout (parallel.distributed.DEFAULT_TIMEOUT_S).
No final checkpoint is written then: an optimizer step is applied by each rank to its own parameters
or shard with no commit across ranks, so after a failure inside one the ranks may disagree.
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Optional


class RankFailed(RuntimeError):
    """A rank failed. `agreed`: every rank learned it at an agreement point (all raise this, after
    saving); otherwise only the failing rank raises it, inside a collective region (no save)."""

    def __init__(self, ranks: list[int], line: str, agreed: bool):
        super().__init__(line)
        self.ranks, self.line, self.agreed = ranks, line, agreed
        self.outcome = ""   # what happened to the checkpoints, set by the loop

    def __str__(self) -> str:
        others = f" (rank(s) {self.ranks[1:]} failed too)" if len(self.ranks) > 1 else ""
        return f"{self.line}{others}{'; ' + self.outcome if self.outcome else ''}"


class ErrorAgreement:
    """This rank's side of the agreement; `trace_dir` receives each failure's traceback."""

    def __init__(self, rank: int, world_size: int, trace_dir: Optional[Path] = None):
        self.rank, self.world_size, self.trace_dir = rank, world_size, trace_dir

    def describe(self, err: BaseException, where: str) -> str:
        """One line naming this rank, what it was doing and the error; the traceback goes to a file."""
        text = " ".join(f"{type(err).__name__}: {err}".split())
        line = f"rank {self.rank} failed {where}: {text}"
        if self.trace_dir is not None:
            path = self.trace_dir / f"error.rank{self.rank:05d}.txt"
            try:
                path.write_text("".join(traceback.format_exception(type(err), err, err.__traceback__)))
                line += f" (traceback: {path})"
            except OSError:
                pass
        return line

    def agree(self, where: str, error: Optional[BaseException], preempted: bool) -> bool:
        """Every rank calls this at the same point. Returns whether any rank got a preemption signal;
        raises RankFailed on every rank when any failed (one rank alone: its own error, unchanged)."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return preempted
        import torch
        import torch.distributed as dist

        from parallel.distributed import comm_device

        flags = torch.zeros(self.world_size + 1, dtype=torch.int32, device=comm_device())
        flags[self.rank] = int(error is not None)
        flags[-1] = int(preempted)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.tolist()
        failed = [r for r in range(self.world_size) if flags[r]]
        if not failed:
            return bool(flags[-1])
        line = self.describe(error, where) if error is not None else None   # every failing rank keeps its traceback
        box = [line if self.rank == failed[0] else None]
        dist.broadcast_object_list(box, src=failed[0])
        raise RankFailed(failed, box[0], agreed=True) from error

    def alone(self, err: BaseException, where: str) -> RankFailed:
        """A failure inside a collective region: this rank's line, for it alone (no collective)."""
        return RankFailed([self.rank], self.describe(err, where), agreed=False)
