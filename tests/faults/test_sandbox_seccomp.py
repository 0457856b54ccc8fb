"""Issue 15.1, "seccomp where available": the sandbox's seccomp filter (rollout/rewards/sandbox_seccomp.py).

Inside bwrap, with the audit-hook guard switched off, the calls that reach kernel attack surface fail
with EPERM (clone3 with ENOSYS), while an ordinary program (threads, fork, subprocess, numpy) runs as
before. Most of the denied calls succeed, or fail differently, without the filter (a nested user
namespace, PTRACE_TRACEME from a forked child, keyctl, io_uring), so each case can fail. Mount fails
inside bwrap anyway (no capabilities), so the program itself is also loaded into a root process on the
host, where mount, chroot and unshare work until the filter is on.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import subprocess
import sys

import pytest

import rollout.rewards.sandbox_seccomp as sandbox_seccomp
from rollout.rewards.sandbox import SandboxLimits, run_python

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap); CI has it")

LIMITS = SandboxLimits(wall_time_s=120, cpu_time_s=20, memory_mb=1024, max_processes=32)
PRELUDE = ("import sys\n"
           "sys.modules['__main__'].hook.__code__ = (lambda event, args: None).__code__\n"
           "import ctypes, errno, os\n"
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "libc.syscall.restype = ctypes.c_long\n"
           "def sc(number, *args):\n"
           "    rc = libc.syscall(number, *[ctypes.c_long(a) for a in args])\n"
           "    return 'OK' if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))\n")
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17


@pytest.fixture(scope="module")
def nr():
    """Syscall numbers of this architecture, from libseccomp's own table."""
    program, problem = sandbox_seccomp.compiled()
    if program is None and not os.environ.get("CI"):
        pytest.skip(f"no seccomp filter here: {problem}")
    lib = sandbox_seccomp._load_library()
    return lambda name: lib.seccomp_syscall_resolve_name(name.encode())


def run(code: str):
    r = asyncio.run(run_python(PRELUDE + code, LIMITS))
    assert r.ok, r.stderr
    return r


def test_the_result_says_the_filter_was_applied(nr):
    r = run("print('ran')")
    assert r.seccomp is True and r.isolation == "bwrap" and r.stdout == "ran\n"


def test_a_nested_user_namespace_is_refused_by_unshare_and_by_clone(nr):
    code = (f"print('unshare', 'OK' if libc.unshare({CLONE_NEWUSER}) == 0 else errno.errorcode[ctypes.get_errno()])\n"
            f"print('unshare-syscall', sc({nr('unshare')}, {CLONE_NEWUSER}))\n"
            f"rc = libc.syscall({nr('clone')}, ctypes.c_long({CLONE_NEWUSER | SIGCHLD}), 0, 0, 0, 0)\n"
            "if rc == 0:\n    os._exit(0)\n"
            "print('clone', 'OK' if rc > 0 and os.waitpid(rc, 0) else errno.errorcode[ctypes.get_errno()])\n"
            f"print('clone3', sc({nr('clone3')}, 0, 0))\n")
    assert run(code).stdout.split("\n")[:4] == ["unshare EPERM", "unshare-syscall EPERM", "clone EPERM",
                                                "clone3 ENOSYS"]


def test_ptrace_traceme_is_refused(nr):
    code = ("pid = os.fork()\n"
            "if pid == 0:\n    os._exit(0 if libc.ptrace(0, 0, 0, 0) == 0 else ctypes.get_errno())\n"
            "print('traceme', errno.errorcode.get(os.waitpid(pid, 0)[1] >> 8, 'OK'))\n"
            f"print('process_vm_readv', sc({nr('process_vm_readv')}, os.getppid(), 0, 0, 0, 0, 0))\n")
    assert run(code).stdout == "traceme EPERM\nprocess_vm_readv EPERM\n"


def test_mount_is_refused(nr):
    code = ("print('mount', 'OK' if libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0 "
            "else errno.errorcode[ctypes.get_errno()])\n"
            f"print('fsopen', sc({nr('fsopen')}, ctypes.addressof(ctypes.create_string_buffer(b'tmpfs')), 0))\n")
    assert run(code).stdout == "mount EPERM\nfsopen EPERM\n"


@pytest.mark.parametrize("name,args", [("keyctl", (0, -3, 0, 0, 0)), ("io_uring_setup", (4, "buf")),
                                       ("bpf", (0, 0, 0)), ("perf_event_open", (0, 0, -1, -1, 0)),
                                       ("userfaultfd", (0,)), ("setns", (-1, 0)), ("add_key", (0, 0, 0, 0, 0)),
                                       ("personality", (0x0040000,))])
def test_other_kernel_attack_surface_is_refused(nr, name, args):
    """Without the filter keyctl, add_key, io_uring_setup and personality succeed here, bpf, perf_event_open
    and setns fail with other errors; userfaultfd is refused to unprivileged users by the kernel anyway."""
    rendered = ", ".join("ctypes.addressof(ctypes.create_string_buffer(120))" if a == "buf" else str(a) for a in args)
    assert run(f"print(sc({nr(name)}, {rendered}))\n").stdout == "EPERM\n"


def test_a_normal_program_still_works(nr):
    code = ("import threading, subprocess, concurrent.futures, json\n"
            "out = []\n"
            "threads = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    os._exit(7)\n"
            "status = os.waitpid(pid, 0)[1] >> 8\n"
            "child = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True)\n"
            "with concurrent.futures.ThreadPoolExecutor(2) as pool:\n    squares = list(pool.map(abs, [-1, -2]))\n"
            "import numpy\n"
            "print(json.dumps([sorted(out), status, child.stdout.strip(), squares, int(numpy.arange(4).sum()),"
            " libc.personality(0)]))\n")
    r = run(code)
    assert r.stdout == '[[0, 1, 2, 3], 7, "42", [1, 2], 6, 0]\n' and r.seccomp


def test_without_libseccomp_the_sandbox_runs_and_says_the_filter_is_off(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_seccomp, "LIBRARIES", ("libseccomp-not-installed.so.9",))
    sandbox_seccomp.compiled.cache_clear()
    try:
        program, problem = sandbox_seccomp.compiled()
        assert program is None and "libseccomp not found" in problem and "libseccomp2" in problem
        assert "no seccomp filter" in caplog.text
        r = asyncio.run(run_python("print('still isolated')", LIMITS))
        assert r.ok and r.stdout == "still isolated\n" and r.seccomp is False and r.network_isolated
    finally:
        sandbox_seccomp.compiled.cache_clear()


HOST_CHILD = r"""
import ctypes, errno, os, sys, tempfile
libc = ctypes.CDLL(None, use_errno=True)
def err(rc):
    return "OK" if rc == 0 else errno.errorcode[ctypes.get_errno()]
assert libc.unshare(0x00020000) == 0                                # own mount namespace (CLONE_NEWNS)
assert libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0  # MS_REC | MS_PRIVATE: nothing reaches the host
target = tempfile.mkdtemp().encode()
before = err(libc.mount(b"none", target, b"tmpfs", 0, None))
libc.umount2(target, 0)
program = sys.stdin.buffer.read()
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
buf = ctypes.create_string_buffer(program, len(program))
fprog = Fprog(len(program) // 8, ctypes.addressof(buf))
assert libc.prctl(38, 1, 0, 0, 0) == 0                              # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER
print(before, err(libc.mount(b"none", target, b"tmpfs", 0, None)), err(libc.chroot(b"/")),
      err(libc.unshare(0x00020000)), err(libc.umount2(b"/proc", 2)))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the filter must stop what root could do")
def test_the_program_refuses_mount_chroot_and_unshare_even_to_root(nr):
    program, _ = sandbox_seccomp.compiled()
    proc = subprocess.run([sys.executable, "-c", HOST_CHILD], input=program, capture_output=True, timeout=120)
    if proc.returncode != 0 and b"AssertionError" in proc.stderr and b"unshare" in proc.stderr:
        pytest.skip("this machine does not let root make a mount namespace")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().split() == ["OK", "EPERM", "EPERM", "EPERM", "EPERM"]


def test_a_filter_bwrap_cannot_load_is_dropped_by_the_probe_and_the_runs_say_so(monkeypatch, caplog):
    """A kernel without seccomp filters makes bwrap fail on --seccomp: the probe then runs without it
    (logged once), rather than refusing every sandbox run."""
    import rollout.rewards.sandbox_bwrap as sandbox_bwrap

    invalid = b"\x00" * 8                  # one load instruction and no return: the kernel refuses it
    monkeypatch.setattr(sandbox_seccomp, "build", lambda: invalid)
    monkeypatch.setattr(sandbox_seccomp, "DISABLED", None)
    sandbox_seccomp.compiled.cache_clear()
    sandbox_bwrap.bwrap_problem.cache_clear()
    try:
        assert sandbox_bwrap.bwrap_problem() is None
        assert "bwrap could not load it here" in sandbox_seccomp.DISABLED and "no seccomp filter" in caplog.text
        r = asyncio.run(run_python("print('still isolated')", LIMITS))
        assert r.ok and r.stdout == "still isolated\n" and r.seccomp is False
    finally:
        sandbox_bwrap.bwrap_problem.cache_clear()
        sandbox_seccomp.compiled.cache_clear()
