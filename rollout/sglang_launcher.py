"""Start and stop real SGLang servers (`python -m sglang.launch_server`) for a recipe's engines.

`build_sglang_command` is pure (unit-tested on the flags it emits; the contract test checks each
flag against SGLang 0.5.23's server-args fields). `launch_sglang` needs CUDA and an SGLang install
(`pip install "sglang==0.5.23"`, the `gpu` extra); its start is exercised by tests/gpu.

Placement: engine ``index`` uses GPUs ``[index * gpus_per_engine, (index + 1) * gpus_per_engine)``
of its node via ``--base-gpu-id`` (gpus_per_engine = tp; dp-attention and EP live inside the TP
group in SGLang).
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sao_megatron.core.ports import free_port


@dataclass
class SGLangArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str = ""              # written to api_key_config by launch_sglang, never put on the argv
    api_key_config: str = ""       # YAML file SGLang reads with --config: the key stays out of `ps`
    tp: int = 1
    ep: int = 1
    dp_attention: int = 0          # 0 = off; else the attention data-parallel size (--attn-dp-size)
    fp8: bool = False
    mem_fraction: float = 0.7
    base_gpu_id: int = 0
    seed: Optional[int] = None
    extra: tuple[str, ...] = ()


def check_args(a: SGLangArgs) -> None:
    """ValueError naming the recipe field (rollout.*) for sizes SGLang would reject later, slowly."""
    if a.tp < 1 or a.ep < 1:
        raise ValueError(f"rollout.engine_tp={a.tp} / rollout.engine_ep={a.ep} must be >= 1")
    if a.tp % a.ep:
        raise ValueError(f"rollout.engine_ep={a.ep} must divide rollout.engine_tp={a.tp} (SGLang's EP lives "
                         "inside the TP group)")
    if a.dp_attention and a.tp % a.dp_attention:
        raise ValueError(f"rollout.engine_dp_attention={a.dp_attention} must divide rollout.engine_tp={a.tp}")
    if not 0 < a.mem_fraction < 1:
        raise ValueError(f"rollout.mem_fraction={a.mem_fraction} must be in (0, 1)")


def build_sglang_command(a: SGLangArgs, python: str = sys.executable) -> list[str]:
    """The argv of one SGLang server. The API key is NOT in it (`ps` shows every argv): SGLang reads it
    from the ``--config`` YAML file ``api_key_config`` (write_key_config makes one, mode 0600)."""
    check_args(a)
    cmd = [python, "-m", "sglang.launch_server",
           "--model-path", a.model_path, "--host", a.host, "--port", str(a.port),
           "--tp-size", str(a.tp), "--ep-size", str(a.ep),
           "--mem-fraction-static", str(a.mem_fraction),
           "--base-gpu-id", str(a.base_gpu_id),
           "--enable-return-routed-experts",   # routing replay needs every token's experts
           "--weight-version", "0"]            # our versions are ints; SGLang's default is "default"
    if a.dp_attention:
        cmd += ["--attn-dp-size", str(a.dp_attention)]
    if a.fp8:
        # model_path is then a block-FP8 checkpoint (rollout.engine_model_path, checked by
        # trainer/engines.py): its quantization_config makes Fp8Config fp8-serialized with 128x128 blocks
        # (fp8.py:346-386) and the flag must agree with it (configs/model_config.py:2108-2147 raises
        # otherwise). On a bf16 checkpoint the flag would quantize per channel at load, replacing the
        # parameters updates load into (fp8.py:1160-1176).
        cmd += ["--quantization", "fp8"]
    if a.api_key and not a.api_key_config:
        raise ValueError("an SGLang api key travels in a --config file, not the command line; "
                         "set api_key_config (write_key_config writes one)")
    if a.api_key_config:
        cmd += ["--config", a.api_key_config]   # SGLang's YAML options file (server_args.py --config)
    if a.seed is not None:
        cmd += ["--random-seed", str(a.seed)]
    return cmd + list(a.extra)


def args_from_recipe(recipe, index: int, port: int, api_key: str) -> SGLangArgs:
    r = recipe.rollout
    return SGLangArgs(model_path=r.engine_model_path or str(recipe.model.path), host=r.host, port=port, api_key=api_key,
                      tp=r.engine_tp, ep=r.engine_ep, dp_attention=r.engine_dp_attention, fp8=r.engine_fp8,
                      mem_fraction=r.mem_fraction, base_gpu_id=index * r.engine_tp,
                      seed=getattr(recipe.run, "seed", None))


def write_key_config(path: str | Path, api_key: str) -> Path:
    """The YAML options file (JSON is YAML) holding only ``api-key``, readable by this user alone."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)    # an existing file keeps its mode through O_CREAT: narrow it before writing
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({"api-key": api_key}) + "\n")
    return path


@dataclass
class SGLangServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group (SGLang forks schedulers), then SIGKILL after timeout_s.
        When the server itself has exited already (a crash the trainer restarts), its schedulers may
        still hold the GPU and the port: the group is killed anyway."""
        if self.process.poll() is not None:
            _signal_group(self.process, signal.SIGKILL)
            return
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait(timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)   # the server was started in its own session: pgid == pid
    except ProcessLookupError:
        pass


def launch_sglang(recipe, index: int, port: int, api_key: str, log_path: str | Path,
                  timeout_s: float = 1200.0) -> SGLangServer:
    """Start engine `index` of the recipe, stream its log to `log_path`, wait for /health."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("rollout.engine = 'sglang' needs SGLang on a CUDA machine: "
                           "pip install 'sglang==0.5.23' (or use rollout.engine = 'reference' on CPU)")
    args = args_from_recipe(recipe, index, port or free_port(recipe.rollout.host), api_key)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if api_key:
        args.api_key_config = str(write_key_config(log_path.with_name(log_path.stem + "_options.yaml"), api_key))
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(build_sglang_command(args), stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = SGLangServer(url=f"http://{args.host}:{args.port}", process=process, log_path=log_path)
    try:
        wait_healthy(server, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def wait_healthy(server, timeout_s: float, label: str = "SGLang", poll_s: float = 1.0) -> None:
    """Poll /health of a spawned engine (anything with .process, .url, .log_path, .log_tail()) until 200.

    RuntimeError with the log tail if the process dies or time runs out. Shared by SGLang and the
    reference server's `launch_local`.
    """
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{label} exited with code {server.process.returncode}; log {server.log_path}:\n"
                               f"{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError) as err:
            last = str(err)
        time.sleep(poll_s)
    raise RuntimeError(f"{label} at {server.url} not healthy within {timeout_s:.0f}s ({last}); "
                       f"log {server.log_path}:\n{server.log_tail()}")