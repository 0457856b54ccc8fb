"""sao_megatron.core: the shared utilities each exist once and load without torch."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from sao_megatron.core.backends import resolve_backend
from sao_megatron.core.ports import free_port
from sao_megatron.core.processes import pid_alive


def test_free_port_can_be_bound_on_the_host_asked_for():
    port = free_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))      # raises if the port were taken
    assert 0 < port < 65536


def test_pid_alive_tells_a_running_process_from_a_finished_one():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert pid_alive(proc.pid)
    finally:
        proc.communicate(b"")
    assert not pid_alive(proc.pid)           # reaped: the pid no longer exists


def test_resolve_backend_on_a_machine_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert resolve_backend("auto") == "gloo"
    assert resolve_backend("gloo") == "gloo"
    with pytest.raises(RuntimeError, match="use backend gloo"):
        resolve_backend("nccl")


def test_core_and_config_import_without_torch():
    code = ("import sys; import sao_megatron.core, sao_megatron.core.ports, sao_megatron.core.imports, "
            "sao_megatron.core.processes, sao_megatron.core.backends, sao_megatron.core.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
