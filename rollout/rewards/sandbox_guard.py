"""The in-process guard: a Python audit hook installed before model-written code runs.

It is a convenience layer, not the boundary: it turns the common mistakes (opening a file outside the
working dir, starting a subprocess, importing ctypes) into a clear PermissionError, but code in the
same interpreter can switch it off (its state is module globals of ``__main__``). The boundary is the
OS isolation in sandbox_bwrap.py; without it (rollout.sandbox = "unsafe-no-isolation") this guard,
rlimits and an empty network namespace are all there is.

argv: scratch dir, script, "1" if the network is allowed, "cpu_s,as_bytes,fsize_bytes,nofile".
The rlimits are set here too so the unsafe mode has them; under bwrap prlimit set them already.
"""

GUARD = r'''
import os, resource, sys
# limits first, before any user code: cpu_s, as_bytes, fsize_bytes, nofile
CPU, AS, FSIZE, NOFILE = (int(x) for x in sys.argv[4].split(","))
resource.setrlimit(resource.RLIMIT_CPU, (CPU, CPU + 1))
resource.setrlimit(resource.RLIMIT_AS, (AS, AS))
resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))
resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
SCRATCH = os.path.realpath(sys.argv[1])
READ_ROOTS = [SCRATCH] + sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                              os.path.dirname(os.__file__))})
NETWORK = sys.argv[3] == "1"
BLOCKED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "pty.spawn", "os.kill", "os.killpg",
           "resource.setrlimit", "resource.prlimit")
PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.mkdir": (0,),
               "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (0, 1), "os.truncate": (0,),
               "os.utime": (0,), "os.chdir": (0,), "shutil.rmtree": (0,), "shutil.move": (0, 1),
               "shutil.copyfile": (1,), "os.listdir": (0,), "os.scandir": (0,)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def inside(path, roots):
    if isinstance(path, int) or path is None:
        return True
    real = os.path.realpath(os.fsdecode(path))
    return any(real == r or real.startswith(r + os.sep) for r in roots)

def hook(event, args):
    if event in BLOCKED or event.startswith("ctypes."):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event.startswith("socket.") and not NETWORK:
        raise PermissionError(f"sandbox: network access ({event}) is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if not inside(path, [SCRATCH] if writing else READ_ROOTS):
            raise PermissionError(f"sandbox: {'writing' if writing else 'reading'} {path} is outside the scratch dir")
    elif event in PATH_EVENTS:
        roots = READ_ROOTS if event in ("os.listdir", "os.scandir") else [SCRATCH]
        for i in PATH_EVENTS[event]:
            if i < len(args) and not inside(args[i], roots):
                raise PermissionError(f"sandbox: {event} on {args[i]} is outside the scratch dir")

code = open(sys.argv[2]).read()
sys.addaudithook(hook)
sys.argv = [sys.argv[2]]
exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
'''
