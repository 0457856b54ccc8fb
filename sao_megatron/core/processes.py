"""Whether a process still exists, for watchdogs that stop when what they serve has gone."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while `pid` exists. A process owned by another user (PermissionError) still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
