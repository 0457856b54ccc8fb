"""Issue 15.5, network exposure: the trainer's TCPStores and process groups listen on the configured
address, never on every interface (torch's own TCPStore listens on ``*``), and the address rules of
sao_megatron/core/binding.py. The cross-host version (ss inside three namespaces) is tests/multinode."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from sao_megatron.core.binding import bind_address, bound_store, interface_address
from sao_megatron.core.ports import free_port

WILDCARDS = ("0.0.0.0", "::", "::ffff:0.0.0.0")


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def test_torchs_own_store_listens_everywhere_ours_on_one_address():
    import datetime

    import torch.distributed as dist

    theirs = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))
    assert any(ip in WILDCARDS for ip, port in _listening(os.getpid()) if port == theirs.port)  # why this exists
    port = free_port()
    ours = bound_store("127.0.0.1", port, 1, True, 10)
    ours.set("k", "v")
    assert ours.get("k") == b"v"
    assert {ip for ip, p in _listening(os.getpid()) if p == port} == {"127.0.0.1"}
    client = bound_store("127.0.0.1", port, 1, False, 10)
    assert client.get("k") == b"v"


def test_a_store_on_an_address_that_is_not_ours_is_a_one_line_error():
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.77:\d+ .*is 192\.0\.2\.77 an address of this host"):
        bound_store("192.0.2.77", free_port(), 1, True, 5)


PROCESS_GROUP = """
import json, os, psutil, torch
from parallel.distributed import init_distributed
init_distributed("gloo", timeout_s=60)
torch.distributed.all_reduce(torch.ones(1))
conns = psutil.Process().net_connections("tcp")
print(json.dumps(sorted({c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN})))
torch.distributed.destroy_process_group()
"""


def test_the_trainers_default_group_listens_on_master_addr_alone(tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run([sys.executable, "-c", PROCESS_GROUP], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    addresses = json.loads(proc.stdout.strip().splitlines()[-1])
    assert addresses and not set(addresses) & set(WILDCARDS), addresses


def test_the_weight_sync_senders_store_listens_on_its_master_address_alone():
    from rollout.weights.buckets import create_sender_group

    port = free_port()
    errors = []
    sender = threading.Thread(target=lambda: _catch(errors, create_sender_group, "127.0.0.1", port, 2, "g", "gloo", 8))
    sender.start()
    deadline = time.monotonic() + 60
    while not any(p == port for _, p in _listening(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.05)
    listening = {ip for ip, p in _listening(os.getpid()) if p == port}
    sender.join(timeout=60)
    assert listening == {"127.0.0.1"}
    assert errors   # no engine joined: the rendezvous timed out instead of waiting forever


def _catch(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        errors.append(err)


def test_bind_address_rules():
    assert bind_address({"SAO_BIND_ADDR": "10.1.2.3", "SAO_INTERFACE": "lo"}) == "10.1.2.3"
    assert bind_address({"SAO_INTERFACE": "lo"}) == "127.0.0.1" == interface_address("lo")
    assert bind_address({"SLURMD_NODENAME": "localhost"}) == "127.0.0.1"
    assert bind_address({"SLURMD_NODENAME": "no-such-host.invalid"}) == "127.0.0.1"
    with pytest.raises(ValueError, match="SAO_INTERFACE=nosuch0: no such interface"):
        bind_address({"SAO_INTERFACE": "nosuch0"})


def test_bootstrap_bind_address_and_a_bad_interface_in_one_line():
    cmd = [sys.executable, "-m", "launch.bootstrap", "--bind-address"]
    good = subprocess.run(cmd, env=dict(os.environ, SLURMD_NODENAME="n7", SAO_INTERFACE="lo"),
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and good.stdout.split() == ["n7", "127.0.0.1"]
    bad = subprocess.run(cmd, env=dict(os.environ, SAO_INTERFACE="nosuch0"), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "SAO_INTERFACE=nosuch0" in bad.stderr


def test_the_bootstrap_exports_the_interface_gloo_binds(monkeypatch):
    from launch.bootstrap import export_binding

    env = export_binding({"SAO_INTERFACE": "lo"})
    assert env["SAO_BIND_ADDR"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo" == env["NCCL_SOCKET_IFNAME"]
    mine = export_binding({"SAO_BIND_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9"})
    assert mine["GLOO_SOCKET_IFNAME"] == "eth9" and mine["NCCL_SOCKET_IFNAME"] == "lo"   # the user's choice stays
