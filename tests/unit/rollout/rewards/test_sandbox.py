"""The code sandbox blocks network and file escapes and enforces its limits; the code reward uses it."""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading

import pytest

from rollout.rewards.code import code_reward, extract_program
from rollout.rewards.sandbox import SandboxLimits, run_python
from sao_megatron.core.records import Sample

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap); CI has it")
FAST = SandboxLimits(wall_time_s=20, cpu_time_s=2, memory_mb=512, file_size_mb=1)


def run(code, limits=FAST):
    return asyncio.run(run_python(code, limits))


def test_runs_plain_code_with_stdlib_and_scratch_files():
    r = run("import json, collections\nopen('a.txt','w').write('hi')\nprint(json.dumps(open('a.txt').read()))")
    assert r.ok and r.stdout == '"hi"\n'


@pytest.mark.parametrize("code,needle", [
    ("open('/etc/hostname').read()", "reading /etc/hostname is outside the scratch dir"),
    ("open('../escape.txt', 'w').write('x')", "writing ../escape.txt is outside the scratch dir"),
    ("import os; os.remove('/tmp/nonexistent-sao')", "os.remove on /tmp/nonexistent-sao"),
    ("import os; os.symlink('/etc', 'e')", "os.symlink on /etc"),
    ("import os; os.system('true')", "os.system is not allowed"),
    ("import subprocess; subprocess.run(['true'])", "subprocess.Popen is not allowed"),
    ("import ctypes", "is not allowed"),
    ("import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit is not allowed"),
])
def test_file_process_and_ctypes_escapes_are_blocked(code, needle):
    r = run(code)
    assert r.returncode == 1 and needle in r.stderr


def test_reading_a_neighbouring_temp_file_is_blocked(tmp_path):
    target = tmp_path / "secret.txt"
    target.write_text("secret")
    r = run(f"print(open({str(target)!r}).read())")
    assert r.returncode == 1 and "secret" not in r.stdout and "outside the scratch dir" in r.stderr


def test_network_is_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    connected = []

    def accept():
        try:
            connected.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    r = run(f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))")
    t.join()
    server.close()
    assert r.returncode == 1 and "network access" in r.stderr and not connected
    assert r.network_isolated


def test_limits_cpu_memory_file_size_wall_time():
    assert run("while True: pass").limit == "cpu_time"
    assert run("x = bytearray(2 * 1024**3)").limit == "memory"
    assert run("open('big', 'wb').write(b'0' * (4 * 1024**2))").limit == "file_size"
    r = run("import time; time.sleep(60)", SandboxLimits(wall_time_s=2))
    assert r.limit == "wall_time" and r.returncode == -9


def test_cpu_limit_must_be_below_the_wall_limit():
    assert SandboxLimits(wall_time_s=5).cpu_time_s == 4 and SandboxLimits(wall_time_s=1.5).cpu_time_s == 1
    with pytest.raises(ValueError, match="cpu_time_s=1 is not below wall_time_s=0.5"):
        SandboxLimits(wall_time_s=0.5)
    with pytest.raises(ValueError, match="cpu_time_s=10 is not below wall_time_s=10"):
        SandboxLimits(wall_time_s=10, cpu_time_s=10)
    with pytest.raises(ValueError, match="rollout.sandbox"):
        SandboxLimits(isolation="none")


def test_output_is_truncated():
    r = run("print('x' * 100000)", SandboxLimits(max_output_bytes=100))
    assert r.stdout == "x" * 100


def test_scratch_dir_is_removed():
    r = run("import os; print(os.getcwd())")
    assert r.ok and not os.path.exists(r.stdout.strip())


def test_code_reward_runs_program_and_tests():
    def sample(text):
        return Sample(uid="p0", prompt_index=0, prompt_ids=[1], response_text=text,
                      label="assert add(2, 3) == 5")
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert extract_program(good) == "def add(a, b):\n    return a + b\n"
    assert asyncio.run(code_reward(sample(good)))["reward"] == 1.0
    out = asyncio.run(code_reward(sample("```python\ndef add(a, b):\n    return a - b\n```")))
    assert out["reward"] == 0.0 and "AssertionError" in out["error"]


def test_an_interpreter_installed_under_tmp_still_runs_in_the_sandbox(tmp_path):
    """The sandbox mounts a private /tmp; a venv in a checkout under /tmp (as CI's fresh clone can be)
    must stay visible inside it (its binds come after the tmpfs)."""
    import subprocess
    import sys
    from pathlib import Path

    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    repo = Path(__file__).resolve().parents[4]
    probe = ("import asyncio, sys; sys.path.insert(0, %r)\n"
             "from rollout.rewards.sandbox import SandboxLimits, run_python\n"
             "r = asyncio.run(run_python('import sys; print(sys.executable)', SandboxLimits()))\n"
             "print(r.returncode, r.stdout.strip(), r.stderr.strip()[-200:])\n") % str(repo)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[:2] == ["0", str(venv / "bin" / "python")], (out.stdout, out.stderr[-500:])


def test_a_run_that_cannot_start_leaks_no_file_descriptor(monkeypatch):
    async def fail(*args, **kwargs):
        raise OSError("spawn failed")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fail)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(OSError, match="spawn failed"):
            run("print(1)")
    assert len(os.listdir("/proc/self/fd")) == before
