"""Start the reference server in this process: `serve(ServeOptions(...))` blocks until stopped.

Used by `sao serve` and by `python -m rollout.reference_server` (what `launch_local` spawns).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from sao_megatron.core.processes import pid_alive

log = logging.getLogger("rollout.reference_server")


@dataclass
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str = ""
    max_batch: int = 64
    max_context: int = 0             # 0 = the model's max_position_embeddings
    dtype: str = "fp32"
    device: str = "cpu"              # where the model runs: cpu, cuda or cuda:N (the GPU check kit)
    tp: int = 1                      # TP ranks that join the weight-update group (tp_ranks.py)
    weight_version: int = 0
    weight_sync_timeout_s: float = 600.0
    seed: int | None = None          # base sampling seed for requests without sampling_seed
    threads: int = 0                 # torch intra-op threads; 0 = torch's default
    port_file: str = ""              # write the bound port here once listening (for port 0)
    parent_pid: int = 0              # exit when this process is gone (no orphaned servers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; only this one is served")
    parser.add_argument("--port", type=int, default=30000, help="port (0 = pick a free one, see --port-file)")
    parser.add_argument("--api-key", default=os.environ.get("SAO_API_KEY", ""),
                        help="require 'Authorization: Bearer KEY' (default $SAO_API_KEY; empty = open)")
    parser.add_argument("--max-batch", type=int, default=64, help="requests decoded together (KV slots)")
    parser.add_argument("--max-context", type=int, default=0, help="prompt+output token limit (0 = model's)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu (default), cuda or cuda:N; on CUDA an nccl weight-update "
                             "group stays nccl")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks to present on the weight-update group, as an SGLang engine "
                             "with --tp-size N: joins as rank_offset+0..N-1 and every rank receives every "
                             "broadcast (the model itself stays whole; CPU only)")
    parser.add_argument("--weight-version", type=int, default=0, help="version of the weights loaded at start")
    parser.add_argument("--weight-sync-timeout-s", type=float, default=600.0,
                        help="timeout of weight-group formation and of each broadcast receive")
    parser.add_argument("--seed", type=int, default=None,
                        help="base seed for requests that send no sampling_seed (default: random)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process exits (0 = never)")
    parser.add_argument("--port-file", default="", help="write the bound port to this file when listening")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(model=args.model, host=args.host, port=args.port, api_key=args.api_key,
                        max_batch=args.max_batch, max_context=args.max_context, dtype=args.dtype,
                        device=args.device, tp=args.tp,
                        weight_version=args.weight_version, weight_sync_timeout_s=args.weight_sync_timeout_s,
                        seed=args.seed, threads=args.threads, port_file=args.port_file,
                        parent_pid=args.parent_pid)


def check_options(opts: ServeOptions) -> None:
    if not (Path(opts.model) / "config.json").is_file():
        raise ValueError(f"--model {opts.model}: no config.json there; point it at an HF model directory "
                         "(make one with `sao init-model`)")
    if opts.max_batch < 1:
        raise ValueError(f"--max-batch {opts.max_batch} < 1; use 1 or more")
    if not 0 <= opts.port < 65536:
        raise ValueError(f"--port {opts.port} out of range; use 0 or 1024-65535")
    _check_device(opts.device)
    if opts.tp < 1:
        raise ValueError(f"--tp {opts.tp} < 1; use 1 or more")
    if opts.tp > 1 and opts.device != "cpu":
        raise ValueError(f"--tp {opts.tp} with --device {opts.device}: the extra TP ranks receive on the CPU; "
                         "use --device cpu or --tp 1")
    from .health import generation_enabled
    from .state import health_check_timeout_s

    health_check_timeout_s(), generation_enabled()   # a bad SGLANG_* value fails here, not per probe


def _check_device(device: str) -> None:
    import torch

    try:
        where = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if where.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: the reference server runs on cpu or cuda only")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA; use --device cpu")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible; use cuda:0.."
                         f"cuda:{torch.cuda.device_count() - 1}")


def build_state(opts: ServeOptions):
    import torch

    from .model_runner import ModelRunner
    from .scheduler import Scheduler
    from .state import ServerState

    if opts.threads:
        torch.set_num_threads(opts.threads)
    runner = ModelRunner(opts.model, dtype=opts.dtype, max_batch=opts.max_batch, max_context=opts.max_context,
                         device=opts.device)
    tokenizer = _load_tokenizer(opts.model)
    eos = runner.config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    scheduler = Scheduler(runner, eos_ids, weight_version=opts.weight_version, seed=opts.seed)
    return ServerState(scheduler, tokenizer, opts.api_key, opts.weight_sync_timeout_s, tp=opts.tp)


def _load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:   # a weights-only directory still serves input_ids
        log.warning("no tokenizer in %s (%s): replies carry empty text; send input_ids", model_dir, err)
        return None


async def _serve(opts: ServeOptions) -> None:
    from aiohttp import web

    from .app import build_app

    state = build_state(opts)
    state.tp_ranks.start()            # TP rank children import torch while the server starts
    state.scheduler.start()
    runner = web.AppRunner(build_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host=opts.host, port=opts.port)
    await site.start()
    port = runner.addresses[0][1]
    if opts.port_file:
        tmp = Path(opts.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(opts.port_file)    # atomic: a reader never sees a half-written port
    log.info("sao reference server on http://%s:%d (model %s on %s, %d weight-update rank(s))", opts.host, port,
             opts.model, opts.device, opts.tp)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = asyncio.create_task(_watch(state, stop, opts.parent_pid))
    warm = asyncio.create_task(_warmup(state, stop))
    await stop.wait()
    failed = warm.done() and not warm.cancelled() and warm.result()
    state.exiting = True              # /health answers 503 from here on, as SGLang's while shutting down
    watchdog.cancel()
    warm.cancel()
    await runner.cleanup()
    state.scheduler.stop()
    state.transfer.shutdown(wait=False, cancel_futures=True)
    state.tp_ranks.stop()
    if failed:
        raise SystemExit(f"reference server: {failed}")   # exit code 1, one line


async def _warmup(state, stop: asyncio.Event) -> str:
    """Status Starting (/health 503) until one generate went through; a failed warmup stops the server."""
    from .health import warmup

    try:
        await warmup(state)
    except Exception as err:   # SGLang kills the server when its warmup fails (http_server.py:2530-2534)
        log.error("warmup failed, stopping: %s", err)
        stop.set()
        return f"warmup generate failed: {err}"
    log.info("warmup done: the server is Up")
    return ""


async def _watch(state, stop: asyncio.Event, parent_pid: int) -> None:
    """Stop when the parent process is gone; log once if the scheduler dies (it also shows in /health)."""
    reported = False
    while True:
        if parent_pid and not _alive(parent_pid):
            log.error("parent process %d exited: stopping", parent_pid)
            stop.set()
            return
        if not state.scheduler.alive and not reported:
            log.error("scheduler stopped: %s (/health answers 503)", state.scheduler.error)
            reported = True
        await asyncio.sleep(1.0)


def _alive(pid: int) -> bool:
    """The launcher `pid` still runs and is still our parent (re-parented: the launcher is gone)."""
    return os.getppid() == pid and pid_alive(pid)


def serve(opts: ServeOptions) -> None:
    check_options(opts)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(opts))
