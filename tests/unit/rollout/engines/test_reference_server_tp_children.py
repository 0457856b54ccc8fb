"""`sao serve --tp N` plays TP ranks 1..N-1 with child processes: none may outlive a killed server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request

from rollout.engines.reference_server import launch_local
from sao_megatron.core.ports import free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _join_a_group_nobody_hosts(url: str) -> None:
    """The children block in the rendezvous (no sender ever listens on that port)."""
    body = json.dumps({"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                       "world_size": 4, "group_name": "never", "backend": "gloo"}).encode()
    request = urllib.request.Request(url + "/init_weights_update_group", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=120).read()
    except OSError:   # the server is killed under this call
        pass


def test_tp_rank_children_exit_when_the_server_is_killed(tiny_model_dir):
    """Killed while its TP ranks are blocked in a group rendezvous (where no pipe EOF reaches them),
    the server leaves no child behind: each child watches its parent."""
    server = launch_local(tiny_model_dir, extra_args=["--tp", "3", "--weight-sync-timeout-s", "600"], insecure=True)
    try:
        deadline = time.monotonic() + 60
        while len(ranks := [c for c in _children(server.process.pid)]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)   # the children start with the server; wait until both are listed
        assert len(ranks) >= 2, f"expected two TP-rank children of the server, found {ranks}"
        threading.Thread(target=_join_a_group_nobody_hosts, args=(server.url,), daemon=True).start()
        time.sleep(3)   # the join reaches the children, which now wait in the rendezvous
        os.kill(server.process.pid, signal.SIGKILL)   # no cleanup runs in the server
        server.process.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks), f"TP-rank children {ranks} outlived the killed server"
    finally:
        server.stop()
