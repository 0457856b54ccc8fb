"""SGLangServer.stop kills the server's whole process group, even once the server process itself exited."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rollout.engines.sglang_launcher import SGLangServer

# the "server" forks a long-lived child (as SGLang forks schedulers), prints its pid, then exits
FORKER = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
          " print(p.pid, flush=True)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_kills_children_left_by_an_exited_server(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", FORKER], stdout=subprocess.PIPE, start_new_session=True)
    child = int(proc.stdout.readline())
    proc.wait(60)
    assert _alive(child)
    try:
        SGLangServer(url="http://127.0.0.1:1", process=proc, log_path=tmp_path / "log").stop()
        for _ in range(200):
            if not _alive(child):
                break
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass
