"""Issue 15.1: each escape from the old in-process sandbox, tried again with its guard switched off.

Every case first replaces the audit hook's code with a no-op (what any model-written code can do: the
hook is a plain function of ``__main__``), so what holds is the OS isolation (bwrap) alone. Then the
code reward's sentinel: exiting early, killing the runner or faking the marker scores 0.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import threading

import pytest

import rollout.rewards.sandbox_bwrap as sandbox_bwrap
from rollout.rewards.code import CodeReward, code_reward
from rollout.rewards.sandbox import SandboxLimits, SandboxUnavailable, run_python
from sao_megatron.core.records import Sample

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap); CI has it")

# Generous wall limits (loaded CI machines); the CPU limits are what must fire first.
LIMITS = SandboxLimits(wall_time_s=120, cpu_time_s=2, memory_mb=512, file_size_mb=1, max_processes=16)
DISABLE_GUARD = ("import sys\n"
                 "sys.modules['__main__'].hook.__code__ = (lambda event, args: None).__code__\n"
                 "import os; os.listdir('/')   # the guard would refuse this: it is off\n")


def run(code: str, limits: SandboxLimits = LIMITS):
    return asyncio.run(run_python(DISABLE_GUARD + code, limits))


def report(attempt: str) -> str:
    """Code that runs `attempt` and prints OK:<value> or DENIED:<exception>."""
    return (f"try:\n    value = {attempt}\n    print('OK:', value)\n"
            "except Exception as exc:\n    print('DENIED:', type(exc).__name__, exc)\n")


def alive_with_comm(name: str) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/comm") as fh:
                    if fh.read().strip() == name:
                        pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_guard_really_is_off_in_these_cases():
    r = run("import subprocess; print('ran', subprocess.run(['/usr/bin/true']).returncode)")
    assert r.ok and r.stdout == "ran 0\n", r.stderr


def test_etc_passwd_is_not_there():
    r = run(report("open('/etc/passwd').read()"))
    assert r.ok and r.stdout.startswith("DENIED: FileNotFoundError") and "root:" not in r.stdout


def test_trainer_environment_does_not_leak_through_proc():
    secret = "sao-secret-" + secrets.token_hex(8)
    os.environ["SAO_TEST_TRAINER_SECRET"] = secret
    try:
        code = (f"import glob\nseen = []\nfor path in glob.glob('/proc/*/environ') + ['/proc/{os.getpid()}/environ']:\n"
                "    try:\n        seen.append(open(path, 'rb').read().decode(errors='replace'))\n"
                "    except OSError as exc:\n        seen.append(type(exc).__name__)\n"
                "print(repr(seen), dict(os.environ))\nprint(len(glob.glob('/proc/[0-9]*')))\n")
        r = run(code)
    finally:
        del os.environ["SAO_TEST_TRAINER_SECRET"]
    assert r.ok, r.stderr
    assert secret not in r.stdout and "SAO_TEST_TRAINER_SECRET" not in r.stdout
    assert int(r.stdout.split()[-1]) <= 3      # its own pid namespace: bwrap's init, the program (and glob)


@pytest.mark.parametrize("target", ["{tmp}/escape.txt", "/usr/escape.txt", "{venv}/escape.txt", "/escape.txt"])
def test_writes_outside_its_dir_do_not_reach_the_host(tmp_path, target):
    path = target.format(tmp=tmp_path, venv=os.path.realpath(os.sys.prefix))
    r = run(report(f"open({path!r}, 'w').write('x')"))
    assert r.ok, r.stderr
    assert not os.path.exists(path)
    if not path.startswith("/tmp/"):   # the sandbox's own /tmp is a private tmpfs: writing there is fine
        assert r.stdout.startswith("DENIED:"), r.stdout


def test_subprocess_runs_unprivileged_and_sees_only_the_sandbox():
    code = ("import subprocess\nout = subprocess.run(['/bin/sh', '-c', 'id -u; ls /; cat /etc/shadow'],"
            " capture_output=True, text=True)\nprint(out.stdout, out.stderr)\n")
    r = run(code)
    assert r.ok, r.stderr
    uid = int(r.stdout.split()[0])
    assert uid != 0 or os.geteuid() != 0
    assert "etc" not in r.stdout.split() and "No such file" in r.stdout


def test_fork_bomb_is_bounded_by_the_process_limit_and_leaves_nothing():
    name = "sao" + secrets.token_hex(6)
    code = (f"import time\nopen('/proc/self/comm', 'w').write({name!r})\nn = 0\n"
            "try:\n    while True:\n        if os.fork() == 0:\n            time.sleep(600)\n            os._exit(0)\n"
            "        n += 1\nexcept OSError as exc:\n    print('forks', n, type(exc).__name__)\n")
    r = run(code)
    assert r.ok, r.stderr
    forks, n, err = r.stdout.split()
    assert int(n) < LIMITS.max_processes and err == "BlockingIOError"
    assert alive_with_comm(name) == []


def test_a_real_fork_bomb_ends_and_leaves_nothing():
    name = "sao" + secrets.token_hex(6)
    limits = SandboxLimits(wall_time_s=15, cpu_time_s=1, max_processes=16)
    code = (f"open('/proc/self/comm', 'w').write({name!r})\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    r = run(code, limits)
    assert r.limit in ("wall_time", "cpu_time")
    assert alive_with_comm(name) == []


def _host_ipv4_addresses() -> list[str]:
    """127.0.0.1 and this machine's other IPv4 addresses (from `hostname -I` where it exists)."""
    import subprocess

    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    return ["127.0.0.1"] + [a for a in out if a.count(".") == 3]


def test_network_connect_to_a_host_listener_fails():
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    server.settimeout(3)
    port = server.getsockname()[1]
    connected = []

    def accept():
        try:
            connected.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    addresses = _host_ipv4_addresses()
    code = "".join(report(f"__import__('socket').create_connection(({a!r}, {port}), timeout=5)") for a in addresses)
    r = run(code)
    t.join()
    server.close()
    assert r.ok and r.stdout.count("DENIED:") == len(addresses) and not connected, r.stdout + r.stderr
    assert r.network_isolated


def test_cpu_spin_is_killed_by_the_cpu_limit_before_the_wall_limit():
    r = run("while True:\n    pass\n")
    assert r.limit == "cpu_time" and r.returncode in (-signal.SIGXCPU, -signal.SIGKILL)


@pytest.mark.parametrize("parent_waits", [False, True])
def test_a_setsid_child_does_not_outlive_the_call(parent_waits):
    name = "sao" + secrets.token_hex(6)
    code = (f"import time\nif os.fork() == 0:\n    os.setsid()\n    open('/proc/self/comm', 'w').write({name!r})\n"
            "    time.sleep(600)\n    os._exit(0)\n"
            f"time.sleep(1)\nprint('parent leaves', flush=True)\n{'time.sleep(600)' if parent_waits else ''}\n")
    limits = SandboxLimits(wall_time_s=8 if parent_waits else 120, cpu_time_s=2)
    r = run(code, limits)
    assert r.stdout == "parent leaves\n"
    assert r.limit == ("wall_time" if parent_waits else None)
    assert alive_with_comm(name) == []


def test_a_huge_file_write_stops_at_the_file_size_limit():
    r = run("with open('big', 'wb') as fh:\n    for _ in range(64):\n        fh.write(b'0' * 2**20)\n")
    assert r.limit == "file_size"


def test_a_memory_bomb_stops_at_the_address_space_limit():
    r = run("chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 2**20))\n")
    assert r.limit == "memory"


def _score(program: str, tests: str = "assert add(2, 3) == 5\n") -> dict:
    sample = Sample(uid="p0", prompt_index=0, prompt_ids=[1], response_text=f"```python\n{program}```", label=tests)
    return asyncio.run(code_reward(sample, LIMITS))


ADD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"


@pytest.mark.parametrize("trick", [
    "import sys\nsys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "print('SAO-TESTS-RAN-TO-THE-END:' + '0' * 32)\nimport os\nos._exit(0)\n",
    "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n",
    "import sys\nsys.excepthook = lambda *a: None\n",
    "x = '''\n",
])
def test_tricks_around_wrong_code_score_zero(trick):
    out = _score(WRONG + trick)
    assert out["reward"] == 0.0, out


def test_a_correct_solution_still_scores_one_and_a_wrong_one_zero():
    assert _score(ADD)["reward"] == 1.0
    out = _score(ADD + "print('x' * 200000)\n")     # long output: the sentinel is read from the tail
    assert out["reward"] == 1.0
    wrong = _score(WRONG)
    assert wrong["reward"] == 0.0 and "AssertionError" in wrong["error"]
    exited = _score(WRONG + "import sys\nsys.exit(0)\n")
    assert exited["error"] == "the tests did not run to the end"


def test_the_sentinel_file_is_gone_before_the_program_runs():
    probe = "import os\nassert not os.path.exists('.sao_sentinel'), os.listdir('.')\n"
    assert _score(ADD + probe)["reward"] == 1.0


def test_without_bwrap_untrusted_code_is_refused_naming_the_recipe_field(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(sandbox_bwrap.shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    sandbox_bwrap.bwrap_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable) as err:
            asyncio.run(run_python("print(1)", LIMITS))
        assert 'rollout.sandbox = "unsafe-no-isolation"' in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
            CodeReward.from_config(type("Cfg", (), {"sandbox": "bwrap"})())
        unsafe = CodeReward.from_config(type("Cfg", (), {"sandbox": "unsafe-no-isolation"})())
        r = asyncio.run(run_python("print(1)", unsafe.limits))
        assert r.ok and r.stdout == "1\n" and r.isolation == "unsafe-no-isolation"
    finally:
        sandbox_bwrap.bwrap_problem.cache_clear()


def test_the_recipe_field_reaches_the_reward_and_an_exit_scores_zero_through_apply_reward():
    from rollout.rewards import apply_reward, resolve_reward_fn
    from sao_megatron.core.config.schema import RolloutConfig

    fn = resolve_reward_fn(RolloutConfig(reward_fn="rollout.rewards.code:code_reward"))
    assert isinstance(fn, CodeReward) and fn.limits.isolation == "bwrap"
    unsafe = resolve_reward_fn(RolloutConfig(reward_fn="rollout.rewards.code:code_reward",
                                             sandbox="unsafe-no-isolation"))
    assert unsafe.limits.isolation == "unsafe-no-isolation"
    sample = Sample(uid="p0", prompt_index=0, prompt_ids=[1], label="assert add(2, 3) == 5",
                    response_text=f"```python\n{WRONG}import os\nos._exit(0)\n```")
    assert asyncio.run(apply_reward(fn, sample, timeout_s=120)) and sample.reward == 0.0
