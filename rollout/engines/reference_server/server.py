"""Start the reference server in this process: `serve(ServeOptions(...))` blocks until stopped.

Used by `sao serve` and by `python -m rollout.engines.reference_server` (what `launch_local` spawns).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from sao_megatron.core.processes import pid_alive

log = logging.getLogger("rollout.engines.reference_server")


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
    shard_writes: bool = False       # opt-in: each TP rank receives only its slice (shard_writes.py)
    quantization: str = ""           # "fp8": serve as SGLang serves a block-FP8 model (fp8_weights.py)
    weight_version: int = 0
    weight_sync_timeout_s: float = 600.0
    seed: int | None = None          # base sampling seed for requests without sampling_seed
    threads: int = 0                 # torch intra-op threads; 0 = torch's default
    port_file: str = ""              # write the bound port here once listening (for port 0)
    parent_pid: int = 0              # exit when this process is gone (no orphaned servers)
    insecure: bool = False           # without an api key, serve the weight and control routes anyway
    enable_return_indexer_topk: bool = False   # SGLang's flag: answer return_indexer_topk (DSA models)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; only this one is served")
    parser.add_argument("--port", type=int, default=30000, help="port (0 = pick a free one, see --port-file)")
    parser.add_argument("--api-key", default=os.environ.get("SAO_API_KEY", ""),
                        help="require 'Authorization: Bearer KEY' (default $SAO_API_KEY, the way to pass it: "
                             "a command line shows in ps); without a key the weight and control routes "
                             "answer 403 unless --insecure")
    parser.add_argument("--insecure", action="store_true",
                        help="with no api key, serve the weight and control routes to anyone who can connect")
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
    parser.add_argument("--shard-writes", action="store_true",
                        help="also accept shard writes: each TP rank joins its trainer sender's group and receives "
                             "only its own slice (NOT an SGLang route: SGLang does this only through its Mooncake "
                             "transfer engine; docs/weights.md)")
    parser.add_argument("--quantization", default="", choices=["", "fp8"],
                        help="fp8: behave as SGLang serving a block-FP8 (128x128) model: the linear weights are "
                             "served as their FP8 blocks, and updates must bring them as float8_e4m3fn with "
                             "<name>_scale_inv (a bf16 tensor for such a weight is refused naming it)")
    parser.add_argument("--weight-version", type=int, default=0, help="version of the weights loaded at start")
    parser.add_argument("--weight-sync-timeout-s", type=float, default=600.0,
                        help="timeout of weight-group formation, of each broadcast receive and of reading the "
                             "files of an /update_weights_from_disk")
    parser.add_argument("--seed", type=int, default=None,
                        help="base seed for requests that send no sampling_seed (default: random)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process exits (0 = never)")
    parser.add_argument("--port-file", default="", help="write the bound port to this file when listening")
    parser.add_argument("--enable-return-indexer-topk", action="store_true",
                        help="return each token's DSA indexer top-k (logical key positions) to requests that set "
                             "return_indexer_topk, as SGLang's flag of that name")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(model=args.model, host=args.host, port=args.port, api_key=args.api_key,
                        max_batch=args.max_batch, max_context=args.max_context, dtype=args.dtype,
                        device=args.device, tp=args.tp, shard_writes=args.shard_writes, quantization=args.quantization,
                        weight_version=args.weight_version, weight_sync_timeout_s=args.weight_sync_timeout_s,
                        seed=args.seed, threads=args.threads, port_file=args.port_file,
                        parent_pid=args.parent_pid, insecure=args.insecure,
                        enable_return_indexer_topk=args.enable_return_indexer_topk)


def check_options(opts: ServeOptions) -> None:
    if not (Path(opts.model) / "config.json").is_file():
        raise ValueError(f"--model {opts.model}: no config.json there; point it at an HF model directory "
                         "(make one with `sao init-model`)")
    if opts.max_batch < 1:
        raise ValueError(f"--max-batch {opts.max_batch} < 1; use 1 or more")
    _check_max_context(opts)
    if opts.threads < 0:
        raise ValueError(f"--threads {opts.threads} < 0; use 0 (torch's default) or more")
    if not (opts.weight_sync_timeout_s > 0 and math.isfinite(opts.weight_sync_timeout_s)):
        raise ValueError(f"--weight-sync-timeout-s {opts.weight_sync_timeout_s} must be a positive number of seconds")
    _check_address(opts.host, opts.port)
    _check_device(opts.device)
    if opts.quantization == "fp8" and opts.shard_writes:
        raise ValueError("--quantization fp8 with --shard-writes: shard writes do not slice FP8 blocks and their "
                         "scales per rank; drop one of them")
    if opts.tp < 1:
        raise ValueError(f"--tp {opts.tp} < 1; use 1 or more")
    if opts.tp > 1 and opts.device != "cpu":
        raise ValueError(f"--tp {opts.tp} with --device {opts.device}: the extra TP ranks receive on the CPU; "
                         "use --device cpu or --tp 1")
    from .health import generation_enabled
    from .state import health_check_timeout_s

    health_check_timeout_s(), generation_enabled()   # a bad SGLANG_* value fails here, not per probe


def _check_max_context(opts: ServeOptions) -> None:
    """0 (the model's) or 2..max_position_embeddings: a prompt token and one output must fit."""
    try:
        config = json.loads((Path(opts.model) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--model {opts.model}: config.json is unreadable ({err})") from None
    limit = (config.get("text_config") or config).get("max_position_embeddings")
    if opts.max_context == 0:
        return
    if opts.max_context < 2:
        raise ValueError(f"--max-context {opts.max_context}: use 0 (the model's limit) or at least 2 "
                         "(one prompt token and one output token)")
    if isinstance(limit, int) and opts.max_context > limit:
        raise ValueError(f"--max-context {opts.max_context} exceeds the model's max_position_embeddings {limit}; "
                         f"use 0 or at most {limit}")


def _check_address(host: str, port: int) -> None:
    """Fail before the model loads when the host is not an address here or the port is taken."""
    if not 0 <= port < 65536:
        raise ValueError(f"--port {port} out of range; use 0 (any free port) or 1024-65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"--host {host!r} does not resolve ({err}); use an address of this machine, "
                         "e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as aiohttp binds
        try:
            probe.bind(address)
        except OSError as err:
            raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}; pick a free --port "
                             "(0 = any) and a --host of this machine") from None


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
    scheduler = Scheduler(runner, eos_ids, weight_version=opts.weight_version, seed=opts.seed,
                          enable_return_indexer_topk=opts.enable_return_indexer_topk)
    state = ServerState(scheduler, tokenizer, opts.api_key, opts.weight_sync_timeout_s, tp=opts.tp,
                        insecure=opts.insecure)
    state.shard_writes = opts.shard_writes   # opt-in routes of shard_writes.py
    state.quantization = opts.quantization
    if opts.quantization == "fp8":
        from .fp8_weights import Fp8WeightMap, layout_for_model

        state.weights = Fp8WeightMap(state.weights, layout_for_model(
            opts.model, json.loads((Path(opts.model) / "config.json").read_text())))
        log.info("--quantization fp8: %d weights served as 128x128 FP8 blocks", state.weights.quantize_served())
    return state


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
    stop, failures = asyncio.Event(), []
    loop = asyncio.get_running_loop()
    state.scheduler.on_failure = lambda message: loop.call_soon_threadsafe(_fail, stop, failures,
                                                                           f"scheduler failed: {message}")
    state.tp_ranks.start()            # TP rank children import torch while the server starts
    state.scheduler.start()
    runner = web.AppRunner(build_app(state), access_log=None)
    await runner.setup()
    try:
        port = await _listen(runner, opts)
    except BaseException:
        await runner.cleanup()
        state.scheduler.stop()
        state.tp_ranks.stop()
        raise
    log.info("sao reference server on http://%s:%d (model %s on %s, %d weight-update rank(s))", opts.host, port,
             opts.model, opts.device, opts.tp)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = asyncio.create_task(_watch(state, stop, failures, opts.parent_pid))
    warm = asyncio.create_task(_warmup(state, stop, failures))
    await stop.wait()
    state.exiting = True              # /health answers 503 from here on, as SGLang's while shutting down
    watchdog.cancel()
    warm.cancel()
    await runner.cleanup()
    state.scheduler.stop()
    state.transfer.shutdown(wait=False, cancel_futures=True)
    state.tp_ranks.stop()
    if failures:   # supervisors see a non-zero exit, never a server whose /health is all that still answers
        raise SystemExit(f"reference server: {failures[0]}")   # exit code 1, one line


async def _listen(runner, opts: ServeOptions) -> int:
    """Bind host:port (a busy port or an unknown host is a one-line ValueError) and return the port."""
    from aiohttp import web

    site = web.TCPSite(runner, host=opts.host, port=opts.port)
    try:
        await site.start()
    except OSError as err:
        raise ValueError(f"cannot listen on {opts.host}:{opts.port}: {err.strerror or err}; "
                         "pick a free --port (0 = any) and a --host of this machine") from None
    port = runner.addresses[0][1]
    if opts.port_file:
        tmp = Path(opts.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(opts.port_file)    # atomic: a reader never sees a half-written port
    return port


def _fail(stop: asyncio.Event, failures: list[str], message: str) -> None:
    log.error("stopping: %s", message)
    failures.append(message)
    stop.set()


async def _warmup(state, stop: asyncio.Event, failures: list[str]) -> None:
    """Status Starting (/health 503) until one generate went through; a failed warmup stops the server."""
    from .health import warmup

    try:
        await warmup(state)
    except Exception as err:   # SGLang kills the server when its warmup fails (http_server.py:2530-2534)
        _fail(stop, failures, f"warmup generate failed: {err}")
        return
    log.info("warmup done: the server is Up")


async def _watch(state, stop: asyncio.Event, failures: list[str], parent_pid: int) -> None:
    """Stop when the parent process is gone, or when the scheduler thread is (a backstop to on_failure)."""
    while True:
        if parent_pid and not _alive(parent_pid):
            log.error("parent process %d exited: stopping", parent_pid)
            stop.set()
            return
        if not state.scheduler.alive:
            _fail(stop, failures, f"scheduler stopped: {state.scheduler.error or 'its thread exited'}")
            return
        await asyncio.sleep(1.0)


def _warn_without_key(opts: ServeOptions) -> None:
    if opts.api_key:
        return
    if opts.insecure:
        log.warning("no api key and --insecure: anyone who can reach %s:%d can replace the weights, pause and "
                    "flush this server; set $SAO_API_KEY instead", opts.host, opts.port)
    else:
        log.warning("no api key: the weight and control routes answer 403 (only /generate, /health*, "
                    "/model_info and /sao_server_info are served); set $SAO_API_KEY, or pass --insecure")


def _alive(pid: int) -> bool:
    """The launcher `pid` still runs and is still our parent (re-parented: the launcher is gone)."""
    return os.getppid() == pid and pid_alive(pid)


def serve(opts: ServeOptions) -> None:
    check_options(opts)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _warn_without_key(opts)
    asyncio.run(_serve(opts))
