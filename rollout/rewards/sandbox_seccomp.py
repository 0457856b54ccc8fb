"""The seccomp filter every bubblewrap sandbox run gets: a deny list of kernel attack surface.

bwrap isolates with namespaces, but the kernel behind them is the host's: without a filter the
sandboxed program could create nested user namespaces (as root we run bwrap without a user
namespace, so none of bwrap's own `--disable-userns` applies), ptrace, mount, or reach bpf, keyctl,
perf_event_open, userfaultfd and io_uring, the usual ways into kernel exploits. The filter answers
those calls with EPERM (clone3 with ENOSYS, see below) and allows everything else, so the
interpreter, threads, subprocesses and pip behave as before.

It is built with libseccomp through ctypes (no Python binding, no new dependency), exported as the
compiled BPF program bwrap's `--seccomp FD` takes, and applied by bwrap to the sandboxed command
only, right before its exec. libseccomp's program first checks the architecture: a syscall made
through another ABI (i386 `int 0x80` or x32 on x86_64) kills the calling thread, so the deny list
cannot be sidestepped by syscall number. Where libseccomp is missing, the machine is neither x86_64
nor aarch64, or bwrap cannot load the program (sandbox_bwrap's probe calls `disable`), the reason is
logged once and the sandbox runs with bwrap's isolation alone (`SandboxResult.seccomp` is False).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import platform
from typing import Optional

log = logging.getLogger(__name__)

ARCHES = ("x86_64", "aarch64")           # where clone's flags are its first argument, as the rule assumes
LIBRARIES = ("libseccomp.so.2", "libseccomp.so")
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7                   # (arg & datum_a) == datum_b

# Denied outright with EPERM. Names absent on the native architecture (iopl on aarch64) are skipped.
DENIED = (
    "unshare", "setns",                                             # new or foreign namespaces
    "mount", "umount2", "pivot_root", "chroot", "mount_setattr",   # the filesystem view
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",   # the new mount API
    "ptrace", "process_vm_readv", "process_vm_writev",             # other processes' memory
    "bpf", "perf_event_open", "userfaultfd",                        # common exploit primitives
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",                             # the kernel keyring
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "syslog",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init",
    "iopl", "ioperm",
)
# clone() with any of these flags would make a namespace: denied with EPERM, plain clone allowed.
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
# clone3 passes its flags in a struct a filter cannot read: ENOSYS makes glibc fall back to clone()
# (what container runtimes do), where the flags are checked above.
ENOSYS_DENIED = ("clone3",)
# personality(): setting an execution-domain bit that weakens the address space (no ASLR, executable
# reads, a mappable page zero) is refused. libseccomp allows one comparison per argument and rule, so
# the query personality(0xffffffff), which has every bit set, is refused too; personality(0) works.
PERSONALITY_DENIED_BITS = {"ADDR_NO_RANDOMIZE": 0x0040000, "READ_IMPLIES_EXEC": 0x0400000,
                           "MMAP_PAGE_ZERO": 0x0100000}


def scmp_act_errno(code: int) -> int:
    """SCMP_ACT_ERRNO(code): the syscall returns -1 with errno `code`."""
    return 0x00050000 | (code & 0x0000FFFF)


class ArgCmp(ctypes.Structure):
    """struct scmp_arg_cmp { unsigned int arg; enum scmp_compare op; scmp_datum_t datum_a, datum_b; }"""
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _load_library() -> ctypes.CDLL:
    """libseccomp with the signatures of seccomp.h (scmp_filter_ctx is a void *). The rules go through
    seccomp_rule_add_array, not the variadic seccomp_rule_add: ctypes cannot pass structs through
    varargs portably (aarch64 passes them differently)."""
    errors = []
    for name in LIBRARIES:
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            break
        except OSError as exc:
            errors.append(str(exc))
    else:
        raise OSError(f"libseccomp not found ({'; '.join(errors)}); install libseccomp2")
    lib.seccomp_init.argtypes, lib.seccomp_init.restype = [ctypes.c_uint32], ctypes.c_void_p
    lib.seccomp_release.argtypes, lib.seccomp_release.restype = [ctypes.c_void_p], None
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes, lib.seccomp_export_bpf.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    return lib


def _add(lib: ctypes.CDLL, ctx: int, action: int, name: str, *cmps: ArgCmp) -> bool:
    """Add one rule; False when `name` is not a syscall of the native architecture."""
    number = lib.seccomp_syscall_resolve_name(name.encode())
    if number < 0:
        return False
    array = (ArgCmp * len(cmps))(*cmps) if cmps else None
    rc = lib.seccomp_rule_add_array(ctx, action, number, len(cmps), array)
    if rc < 0:
        raise OSError(-rc, f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")
    return True


def _add_rules(lib: ctypes.CDLL, ctx: int) -> None:
    """The deny list (names the native architecture lacks are skipped)."""
    eperm, enosys = scmp_act_errno(errno.EPERM), scmp_act_errno(errno.ENOSYS)
    for name in DENIED:
        _add(lib, ctx, eperm, name)
    for name in ENOSYS_DENIED:
        _add(lib, ctx, enosys, name)
    for flag in CLONE_NAMESPACE_FLAGS.values():
        _add(lib, ctx, eperm, "clone", ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
    for bit in PERSONALITY_DENIED_BITS.values():
        _add(lib, ctx, eperm, "personality", ArgCmp(0, SCMP_CMP_MASKED_EQ, bit, bit))


def _export(lib: ctypes.CDLL, ctx: int) -> bytes:
    fd = os.memfd_create("sao-seccomp-export")
    try:
        rc = lib.seccomp_export_bpf(ctx, fd)
        if rc < 0:
            raise OSError(-rc, f"seccomp_export_bpf failed: {os.strerror(-rc)}")
        os.lseek(fd, 0, os.SEEK_SET)
        return b"".join(iter(lambda: os.read(fd, 65536), b""))
    finally:
        os.close(fd)


def build() -> bytes:
    """The compiled BPF program (raises OSError when libseccomp is missing or refuses a rule)."""
    if platform.machine() not in ARCHES:
        raise OSError(f"the sandbox's seccomp filter supports {', '.join(ARCHES)}, not {platform.machine()}")
    lib = _load_library()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        _add_rules(lib, ctx)
        program = _export(lib, ctx)
    finally:
        lib.seccomp_release(ctx)
    if not program or len(program) % 8:
        raise OSError(f"seccomp_export_bpf wrote {len(program)} bytes, not a BPF program")
    return program


# Why bwrap could not load a program that libseccomp built (set by sandbox_bwrap's probe), else None.
DISABLED: Optional[str] = None


def _warn(problem: str) -> None:
    log.warning("sandbox: no seccomp filter (%s); bwrap's namespaces and rlimits still isolate", problem)


@functools.lru_cache(maxsize=1)
def compiled() -> tuple[Optional[bytes], Optional[str]]:
    """(program, None), or (None, why the sandbox runs without a filter here): built once per process,
    the reason logged once."""
    if DISABLED:
        return None, DISABLED
    try:
        return build(), None
    except OSError as exc:
        _warn(str(exc))
        return None, str(exc)


def disable(problem: str) -> None:
    """No filter from now on in this process (bwrap's probe found it cannot load one here)."""
    global DISABLED
    DISABLED = problem
    compiled.cache_clear()
    _warn(problem)


def program_fd() -> Optional[int]:
    """A fresh fd holding the program at offset 0, for bwrap's `--seccomp FD` (bwrap reads it to the
    end, so each run needs its own); None where there is no filter. The caller closes it."""
    program, _ = compiled()
    if program is None or DISABLED:
        return None
    fd = os.memfd_create("sao-seccomp")
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
