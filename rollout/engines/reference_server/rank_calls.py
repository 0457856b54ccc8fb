"""Calls that run on every TP rank of the reference server: the transfer thread rank 0 runs its part in,
and a command sent to the child ranks (tp_ranks.py) beside rank 0's own. Used by the weight-update routes
(weight_updates.py) and the shard-write routes (shard_writes.py)."""
from __future__ import annotations

import asyncio
import contextlib


def in_thread(state, fn):
    """Run `fn` on the server's transfer thread (collectives never block the event loop)."""
    return asyncio.get_running_loop().run_in_executor(state.transfer, fn)


def on_every_rank(state, command: str, make_args, own, undo=None):
    """Start `command` on TP ranks 1.. (children), run `own` as TP rank 0, then collect the children's
    replies: (own result, [their results]). If a child failed after `own` succeeded, `undo(own result)`."""
    state.tp_ranks.send(command, make_args)
    try:
        mine = own()
    except BaseException:
        with contextlib.suppress(RuntimeError):
            state.tp_ranks.collect()
        raise
    try:
        return mine, state.tp_ranks.collect()
    except RuntimeError:
        if undo is not None:
            undo(mine)
        raise
