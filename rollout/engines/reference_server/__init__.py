"""The reference rollout server: HF transformers on CPU behind SGLang's HTTP protocol.

Start one from Python (tests, `sao train`)::

    from rollout.engines.reference_server import launch_local
    server = launch_local(model_dir, port=0, api_key="k", timeout_s=120)
    ... server.url ...        # "http://127.0.0.1:PORT"
    server.stop()

or from a shell: ``sao serve --model DIR --host 127.0.0.1 --port P --api-key K``.
Modules: server (process entry, flags), state (what handlers share), app (route table, pause,
flush, /model_info), generation (/generate), health (/health*, warmup), gate (pause flag and
model-update lock), weight_updates (sessions, groups, updates), weights_checker, protocol (JSON),
scheduler (batching), model_runner (forward + KV + routes), sampling, weights (HF names),
weight_group (broadcast receive), tp_ranks (`--tp` ranks on the update group), http_io.
docs/engines.md lists the SGLang 0.5.23 behaviours it reproduces, with their source paths.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rollout.engines.sglang_launcher import wait_healthy


@dataclass
class LocalServer:
    """A reference server running as a child process."""

    url: str
    port: int
    api_key: str
    process: subprocess.Popen
    log_path: Path

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, wait up to timeout_s, then SIGKILL."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_local(model_dir: str | Path, port: int = 0, api_key: str = "", host: str = "127.0.0.1",
                 timeout_s: float = 180.0, log_path: Optional[str | Path] = None, seed: Optional[int] = None,
                 extra_args: Optional[list[str]] = None, insecure: bool = False) -> LocalServer:
    """Spawn `python -m rollout.engines.reference_server` and return once /health answers 200.

    ``port=0`` lets the server bind a free port and report it through a port file (no race). The
    child's stdout/stderr go to ``log_path`` (default: a temp file). ``seed`` seeds requests that
    send no ``sampling_seed``; ``extra_args`` are more server flags (e.g. ``["--max-batch", "32"]``).
    The key travels in $SAO_API_KEY, never on the command line (``ps`` shows that). Without a key
    the server refuses its weight and control routes unless ``insecure=True`` (``--insecure``).
    Raises RuntimeError with the log tail if the process exits or /health is not 200 within ``timeout_s``.
    """
    workdir = Path(tempfile.mkdtemp(prefix="sao_serve_"))
    log_path = Path(log_path) if log_path else workdir / "server.log"
    port_file = workdir / "port"
    cmd = [sys.executable, "-m", "rollout.engines.reference_server", "--model", str(model_dir), "--host", host,
           "--port", str(port), "--port-file", str(port_file), "--parent-pid", str(os.getpid()),
           *(extra_args or [])]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if insecure and not api_key:
        cmd.append("--insecure")
    env = {k: v for k, v in os.environ.items() if k != "SAO_API_KEY"}   # only the key asked for here
    if api_key:
        env["SAO_API_KEY"] = api_key    # not on the command line, where `ps` would show it
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   cwd=str(Path(__file__).resolve().parents[2]))
    server = LocalServer(url="", port=0, api_key=api_key, process=process, log_path=log_path)
    try:
        server.port = _wait_for_port(server, port_file, timeout_s)
        server.url = f"http://{host}:{server.port}"
        wait_healthy(server, timeout_s, label="reference server", poll_s=0.1)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_for_port(server: LocalServer, port_file: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if server.process.poll() is not None:
            raise RuntimeError(f"reference server exited with code {server.process.returncode} before "
                               f"listening; log {server.log_path}:\n{server.log_tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"reference server did not start listening within {timeout_s:.0f}s; "
                       f"log {server.log_path}:\n{server.log_tail()}")


__all__ = ["LocalServer", "launch_local"]
