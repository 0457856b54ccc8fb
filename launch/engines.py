"""Rollout engines on dedicated slurm nodes: where each engine runs, its command, and waiting for them.

Placement (one allocation split by role, rollout nodes first): an engine uses ``rollout.engine_tp``
GPUs. When that fits in a node, a node runs ``gpus_per_node // engine_tp`` engines side by side
(``--base-gpu-id`` picks their GPUs); when it does not, one engine spans ``engine_tp // gpus_per_node``
nodes (SGLang's ``--nnodes/--node-rank/--dist-init-addr``). On CPU the reference server
(`sao serve`) runs one engine per rollout node.

`python -m launch.engines wait --timeout S URL...` polls each URL's /health until all answer 200
(the sbatch script runs it before starting the trainer).
"""
from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from sao_megatron.core.config import ConfigError
from sao_megatron.core.processes import pid_alive

ENGINE_PORT = 30000      # first engine port on a rollout node
DIST_INIT_PORT = 29600   # SGLang multi-node rendezvous port (+ engine index)
API_KEY_VAR = "SAO_API_KEY"             # the key reaches engines and trainer in the environment only
OPTIONS_VAR = "SAO_ENGINE_OPTIONS"       # SGLang's --config file holding the key (rollout_node_script)
_OPTIONS_MARK = "@@SAO_ENGINE_OPTIONS@@"


@dataclass(frozen=True)
class EngineSlot:
    """One engine process on one rollout node."""

    engine: int      # engine index
    node: int        # rollout node index (0-based within the rollout nodes)
    head_node: int   # rollout node index of the engine's first node (its URL's host)
    node_rank: int   # rank of this node within a multi-node engine
    nnodes: int
    base_gpu: int
    port: int


def engine_slots(recipe) -> list[EngineSlot]:
    """Every engine process of the rollout nodes, or a ConfigError naming the field to change."""
    launch, roll = recipe.launch, recipe.rollout
    nodes, gpus, tp = launch.rollout_nodes, launch.gpus_per_node, roll.engine_tp
    if gpus == 0:  # CPU: one reference server per node
        return [EngineSlot(n, n, n, 0, 1, 0, ENGINE_PORT) for n in range(nodes)]
    if tp <= gpus:
        if gpus % tp:
            raise ConfigError("rollout.engine_tp", f"{tp} does not divide launch.gpus_per_node={gpus}",
                              "use an engine_tp that divides the GPUs of a node")
        per_node = gpus // tp
        return [EngineSlot(n * per_node + i, n, n, 0, 1, i * tp, ENGINE_PORT + i)
                for n in range(nodes) for i in range(per_node)]
    if tp % gpus or nodes % (tp // gpus):
        raise ConfigError("rollout.engine_tp", f"{tp} GPUs per engine do not tile {nodes} rollout nodes of {gpus} GPUs",
                          "make launch.rollout_nodes a multiple of engine_tp / gpus_per_node")
    span = tp // gpus
    return [EngineSlot(n // span, n, n - n % span, n % span, span, 0, ENGINE_PORT) for n in range(nodes)]


def engine_heads(slots: list[EngineSlot]) -> list[EngineSlot]:
    """The slot that serves HTTP for each engine (node rank 0)."""
    return [s for s in slots if s.node_rank == 0]


def engine_command(recipe, slot: EngineSlot, head_host: str = "$HEAD_HOST") -> list[str]:
    """argv of one engine process, without the API key (`ps` shows argv): `sao serve` reads $SAO_API_KEY,
    SGLang reads the --config file $SAO_ENGINE_OPTIONS that the node script writes from it."""
    from rollout.engines.sglang_launcher import build_sglang_command, engine_seed, reference_server_args, sglang_args

    python = recipe.launch.python
    if recipe.rollout.engine == "reference":
        model_path = recipe.rollout.engine_model_path or recipe.model.path
        return [python, "-m", "sao_megatron.cli.main", "serve", "--model", model_path, "--host", "$ENGINE_HOST",
                "--port", str(slot.port), "--seed", str(engine_seed(recipe, slot.engine)),
                *reference_server_args(recipe)]

    extra: tuple[str, ...] = ()
    if slot.nnodes > 1:
        extra = ("--nnodes", str(slot.nnodes), "--node-rank", str(slot.node_rank),
                 "--dist-init-addr", f"{head_host}:{DIST_INIT_PORT + slot.engine}")
    args = sglang_args(recipe, slot.engine, host="$ENGINE_HOST", port=slot.port, base_gpu_id=slot.base_gpu,
                       api_key_config=_OPTIONS_MARK, extra=extra)
    try:
        return build_sglang_command(args, python=python)
    except ValueError as err:
        raise ConfigError("rollout", str(err), "fix the engine sizes in [rollout]") from None


def write_options_lines(python: str) -> list[str]:
    """Shell lines writing SGLang's options file from $SAO_API_KEY (environment in, 0600 file out)."""
    import shlex

    code = f'import json, os; print(json.dumps({{"api-key": os.environ["{API_KEY_VAR}"]}}))'
    return [f'{OPTIONS_VAR}="$(mktemp --suffix=.yaml)"  # 0600; SGLang reads the key from it (--config)',
            f'trap \'rm -f "${OPTIONS_VAR}"\' EXIT',
            f'{shlex.quote(python)} -c {shlex.quote(code)} > "${OPTIONS_VAR}"']


def fp8_gpu_guard_lines(python: str) -> list[str]:
    """Shell lines stopping the node (exit 2, one line) before FP8 engines start on a GPU where SGLang re-quantises
    their scales (rollout/engines/sglang_launcher.py check_fp8_engine_gpu says why)."""
    import shlex

    code = "import sys; from rollout.engines.sglang_launcher import fp8_gpu_guard; sys.exit(fp8_gpu_guard())"
    return [f"{shlex.quote(python)} -c {shlex.quote(code)} || exit 2   # FP8 engines refuse Blackwell GPUs"]


def shell_join(argv: list[str]) -> str:
    """shlex-quote argv; the options-file mark becomes "$SAO_ENGINE_OPTIONS" and $HEAD_HOST stays a variable."""
    import shlex

    out = []
    for arg in argv:
        if arg == _OPTIONS_MARK:
            out.append(f'"${OPTIONS_VAR}"')
        elif "$HEAD_HOST" in arg or arg == "$ENGINE_HOST":   # variables of the node script
            out.append('"' + arg.replace('"', '\\"') + '"')
        else:
            out.append(shlex.quote(arg))
    return " ".join(out)


# ------------------------------------------------------------------------------------- readiness


def wait_ready(urls: list[str], timeout_s: float, poll_s: float = 2.0, watch_pids: tuple[int, ...] = ()) -> None:
    """Return when every URL's /health answers 200. RuntimeError naming the missing ones at timeout, or
    at once when a watched process (an engine's srun step) has exited."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    last: dict[str, str] = {}
    while pending:
        dead = [pid for pid in watch_pids if not pid_alive(pid)]
        if dead:
            raise RuntimeError(f"engine step(s) {dead} exited before {len(pending)} engine(s) became healthy; "
                               "see the engine logs in the run dir")
        for url in list(pending):
            try:
                with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        pending.remove(url)
                        continue
                    last[url] = f"HTTP {reply.status}"
            except (urllib.error.URLError, OSError) as err:
                last[url] = str(getattr(err, "reason", err))
        if not pending:
            return
        if time.monotonic() > deadline:
            detail = "; ".join(f"{u}: {last.get(u, 'no answer')}" for u in pending)
            raise RuntimeError(f"engines not healthy after {timeout_s:.0f}s: {detail}; see the engine logs in the run dir")
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.engines")
    sub = parser.add_subparsers(dest="cmd", required=True)
    wait = sub.add_parser("wait", help="wait until every engine's /health answers 200")
    wait.add_argument("urls", nargs="+")
    wait.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    wait.add_argument("--watch-pids", default="", help="space-separated pids (engine srun steps) that must stay alive")
    args = parser.parse_args(argv)
    try:
        wait_ready(args.urls, args.timeout, watch_pids=tuple(int(p) for p in args.watch_pids.split()))
    except RuntimeError as err:
        print(f"launch.engines: {err}", file=sys.stderr)
        return 1
    print(f"launch.engines: {len(args.urls)} engine(s) healthy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
