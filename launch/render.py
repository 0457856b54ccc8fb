"""Render the sbatch script of a recipe: one allocation split by role, nothing tunable in bash.

Layout of the allocation (`scontrol show hostnames` order): the first ``launch.rollout_nodes`` nodes
run the engines (launch/engines.py places them), the rest run the trainer ranks under srun with the
rank bootstrap (launch/bootstrap.py). With ``rollout_nodes = 0`` the engines are colocated: `sao
train` starts them itself next to the trainer, as on a laptop.

Every hyper-parameter lives in the resolved recipe the script passes to `sao train`; the script holds
only placement (hosts, ports), environment (NCCL, wandb, launch.env) and the preemption protocol:
slurm sends SIGUSR1 ``launch.signal_seconds`` before the time limit (``--signal=B:USR1@S``), the
script forwards it to the trainer step (the trainer checkpoints at its next safe point and exits),
then requeues the job, which resumes from that checkpoint (checkpoint.resume = auto).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from checkpoints.arch import load_recipe
from sao_megatron.core.binding import INTERFACE_VAR
from sao_megatron.core.config import ConfigError

from .engines import (API_KEY_VAR, engine_command, engine_heads, engine_slots, fp8_gpu_guard_lines, shell_join,
                      write_options_lines)

DEFAULT_TRAIN_COMMAND = "{python} -m sao_megatron.cli.main train {recipe} {overrides}"
ENGINE_START_TIMEOUT_S = {True: 3600, False: 600}  # GPU engines load hundreds of GB; CPU ones a tiny model
GPU_ENV = {  # defaults under the recipe's launch.env
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",          # Megatron's TP/SP communication overlap needs it
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",      # a failed collective raises instead of hanging
    "NCCL_DEBUG": "WARN",
}


@dataclass(frozen=True)
class JobLayout:
    nodes: int
    rollout_nodes: int
    trainer_nodes: int
    gpus_per_node: int
    tasks_per_node: int  # trainer ranks per trainer node
    world: int

    @property
    def colocated(self) -> bool:
        return self.rollout_nodes == 0


@dataclass(frozen=True)
class JobPaths:
    workdir: Path    # where the job runs (relative recipe paths resolve from here)
    run_dir: Path
    recipe: Path     # the resolved recipe the trainer reads
    script: Path


def load_launch_recipe(path, nodes: int = 0, overrides: list[str] = ()):
    """Load for launching: --nodes wins over launch.nodes, and on GPUs parallel.world_size follows the
    trainer nodes (trainer_nodes · gpus_per_node) so the recipe and the allocation cannot disagree."""
    pre = [f"launch.nodes={nodes}"] if nodes else []
    recipe = load_recipe(path, pre + list(overrides), check_files=False)
    gpus = recipe.launch.gpus_per_node
    if gpus:
        trainer_nodes = recipe.launch.trainer_nodes or recipe.launch.nodes - recipe.launch.rollout_nodes
        world = trainer_nodes * gpus
        if recipe.parallel.resolved_world_size() != world:
            recipe = load_recipe(path, pre + list(overrides) + [f"parallel.world_size={world}"], check_files=False)
    return recipe


def job_layout(recipe) -> JobLayout:
    """Nodes per role and trainer ranks per node, checked against the recipe's world size."""
    launch = recipe.launch
    trainer_nodes = launch.trainer_nodes or launch.nodes - launch.rollout_nodes
    if trainer_nodes < 1 or trainer_nodes + launch.rollout_nodes != launch.nodes:
        raise ConfigError("launch.trainer_nodes", f"{trainer_nodes} trainer + {launch.rollout_nodes} rollout nodes "
                          f"!= launch.nodes {launch.nodes}", "set trainer_nodes = 0 (the rest) or make the sum match")
    world = recipe.parallel.resolved_world_size()
    if world % trainer_nodes:
        raise ConfigError("parallel.world_size", f"{world} ranks do not spread evenly over {trainer_nodes} trainer nodes",
                          "use a world size that is a multiple of the trainer nodes")
    per_node = world // trainer_nodes
    if launch.gpus_per_node and per_node != launch.gpus_per_node:
        raise ConfigError("parallel.world_size", f"{per_node} ranks per node but launch.gpus_per_node = "
                          f"{launch.gpus_per_node}", "one trainer rank per GPU: world_size = trainer_nodes x gpus_per_node")
    return JobLayout(launch.nodes, launch.rollout_nodes, trainer_nodes, launch.gpus_per_node, per_node, world)


def render_script(recipe, paths: JobPaths, train_command: str = DEFAULT_TRAIN_COMMAND) -> str:
    """The whole sbatch script, as text."""
    job = job_layout(recipe)
    sections = [_header(recipe, job, paths), _environment(recipe, job, paths), _node_split(job),
                _addresses(recipe, job), _preemption(recipe), _engines(recipe, job, paths),
                _trainer(recipe, job, paths, train_command), _finish(recipe)]
    return "\n".join(line for section in sections for line in section) + "\n"


def _header(recipe, job: JobLayout, paths: JobPaths) -> list[str]:
    launch = recipe.launch
    lines = ["#!/bin/bash",
             f"# Rendered by `sao launch` from {recipe.source or 'a recipe'}. Edit the recipe, not this file:",
             f"# every hyper-parameter is in {paths.recipe}.",
             f"#SBATCH --job-name={recipe.run.name}",
             f"#SBATCH --nodes={job.nodes}",
             f"#SBATCH --ntasks-per-node={job.tasks_per_node}",
             f"#SBATCH --time={launch.time_limit}",
             f"#SBATCH --chdir={paths.workdir}",
             f"#SBATCH --output={paths.run_dir}/logs/slurm-%j.out",
             "#SBATCH --open-mode=append"]
    if job.gpus_per_node:
        lines += [f"#SBATCH --gpus-per-node={job.gpus_per_node}", "#SBATCH --exclusive"]
    if launch.partition:
        lines.append(f"#SBATCH --partition={launch.partition}")
    if launch.account:
        lines.append(f"#SBATCH --account={launch.account}")
    if launch.requeue:
        lines += ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{launch.signal_seconds}"]
    else:
        lines.append("#SBATCH --no-requeue")
    return lines + ["set -euo pipefail", ""]


def _environment(recipe, job: JobLayout, paths: JobPaths) -> list[str]:
    env = {"PYTHONUNBUFFERED": "1", "SAO_RUN_DIR": str(paths.run_dir)}
    if job.gpus_per_node:
        env.update(GPU_ENV)
    env.update(_wandb_env(recipe, paths))
    env.update({str(k): str(v) for k, v in recipe.launch.env.items()})
    if env.get(INTERFACE_VAR):   # the engines' weight-update groups too, not only the trainer ranks
        env.setdefault("GLOO_SOCKET_IFNAME", env[INTERFACE_VAR])
        env.setdefault("NCCL_SOCKET_IFNAME", env[INTERFACE_VAR])
    lines = ["# --- environment (launch.env in the recipe overrides the defaults)"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
    lines += [_wandb_mode_line(recipe),
              f'export WANDB_RUN_ID="{recipe.run.name}-${{SLURM_JOB_ID}}"  # same run across requeues',
              f'export {API_KEY_VAR}="${{{API_KEY_VAR}:-$(od -An -N16 -tx1 /dev/urandom | tr -d \' \\n\')}}"',
              f"mkdir -p {shlex.quote(str(paths.run_dir / 'logs'))}", ""]
    return lines


def _wandb_env(recipe, paths: JobPaths) -> dict:
    return {"WANDB_PROJECT": recipe.logging.wandb_project, "WANDB_DIR": str(paths.run_dir),
            "WANDB_RESUME": "allow", "WANDB_RUN_GROUP": recipe.run.name}


def _wandb_mode_line(recipe) -> str:
    mode = recipe.logging.wandb_mode if recipe.logging.wandb else "disabled"
    if mode == "auto":  # online only where a key is present, as on a laptop
        return 'export WANDB_MODE="${WANDB_MODE:-$([ -n "${WANDB_API_KEY:-}" ] && echo online || echo offline)}"'
    return f"export WANDB_MODE={mode}"


def _node_split(job: JobLayout) -> list[str]:
    return ["# --- nodes: the first launch.rollout_nodes run engines, the rest train",
            'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            f'if [ "${{#NODES[@]}}" -ne {job.nodes} ]; then',
            f'  echo "sao launch: expected {job.nodes} nodes, slurm gave ${{#NODES[@]}}" >&2; exit 1',
            "fi",
            f'ROLLOUT_NODES=("${{NODES[@]:0:{job.rollout_nodes}}}")',
            f'TRAINER_NODES=("${{NODES[@]:{job.rollout_nodes}}}")',
            'TRAINER_HOSTS="$(IFS=,; echo "${TRAINER_NODES[*]}")"',
            'echo "sao launch: job $SLURM_JOB_ID trainer nodes ${TRAINER_NODES[*]} rollout nodes ${ROLLOUT_NODES[*]:-(colocated)}"',
            ""]


def _addresses(recipe, job: JobLayout) -> list[str]:
    """One srun step asks every node for its address on the configured interface (SAO_INTERFACE in
    launch.env, else the address its name resolves to): the trainer's store and the engines listen
    there and nowhere else, and everyone reaches them there."""
    python = shlex.quote(recipe.launch.python)
    return ["# --- addresses: each node's address on the configured interface (launch/bootstrap.py --bind-address)",
            f"ADDRESSES=\"$({_srun_prefix(recipe, job)} --nodes={job.nodes} --ntasks={job.nodes} --ntasks-per-node=1 "
            f"{python} -m launch.bootstrap --bind-address)\"",
            "declare -A ADDR_OF",
            'while read -r node addr; do ADDR_OF[$node]="$addr"; done <<< "$ADDRESSES"',
            'for node in "${NODES[@]}"; do',
            '  [ -n "${ADDR_OF[$node]:-}" ] || { echo "sao launch: node $node reported no address" >&2; exit 1; }',
            "done",
            'export MASTER_ADDR="${ADDR_OF[${TRAINER_NODES[0]}]}"',
            "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
            'echo "sao launch: addresses $(for n in "${NODES[@]}"; do printf \'%s=%s \' "$n" "${ADDR_OF[$n]}"; done)"',
            ""]


def _preemption(recipe) -> list[str]:
    requeue = "true" if recipe.launch.requeue else "false"
    return ["# --- preemption: SIGUSR1 -> trainer checkpoints and exits -> requeue (resume = auto)",
            "PREEMPTED=0; TRAIN_PID=; ENGINE_PIDS=()",
            "on_usr1() {",
            '  echo "sao launch: SIGUSR1 (time limit or preemption): asking the trainer to checkpoint" >&2',
            '  PREEMPTED=1; [ -n "$TRAIN_PID" ] && kill -USR1 "$TRAIN_PID" 2>/dev/null || true',
            "}",
            "trap on_usr1 USR1",
            "stop_engines() {",
            '  for pid in "${ENGINE_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done',
            "}",
            "trap stop_engines EXIT",
            f"REQUEUE={requeue}", ""]


def _srun_prefix(recipe, job: JobLayout) -> str:
    parts = ["srun", "--kill-on-bad-exit=1"]
    if job.gpus_per_node:
        parts.append(f"--gpus-per-node={job.gpus_per_node}")
    if recipe.launch.container:
        parts += [f"--container-image={shlex.quote(recipe.launch.container)}",
                  '--container-mounts="$SAO_RUN_DIR:$SAO_RUN_DIR"', '--container-workdir="$PWD"']
    return " ".join(parts)


def _engines(recipe, job: JobLayout, paths: JobPaths) -> list[str]:
    if job.colocated:
        return ["# --- engines: colocated; `sao train` starts them next to the trainer", ""]
    slots = engine_slots(recipe)
    heads = " ".join(str(next(s.head_node for s in slots if s.node == n)) for n in range(job.rollout_nodes))
    logs = shlex.quote(str(paths.run_dir / "logs"))
    scripts = shlex.quote(str(paths.run_dir / "launch"))
    python = shlex.quote(recipe.launch.python)
    lines = ["# --- engines on the rollout nodes: one srun step per node runs launch/rollout_node_<i>.sh",
             f"HEAD_OF_NODE=({heads})  # rollout node index of each node's engine head (multi-node engines)",
             f"for i in $(seq 0 {job.rollout_nodes - 1}); do",
             f'  {_srun_prefix(recipe, job)} --nodes=1 --ntasks=1 --nodelist="${{ROLLOUT_NODES[$i]}}" \\',
             f'    --output={logs}/engines_node"$i"-%j.log \\',
             f'    bash {scripts}/rollout_node_"$i".sh "${{ADDR_OF[${{ROLLOUT_NODES[${{HEAD_OF_NODE[$i]}}]}}]}}" '
             '"${ADDR_OF[${ROLLOUT_NODES[$i]}]}" &',
             '  ENGINE_PIDS+=("$!")',
             "done",
             "ENGINE_URLS=()"]
    for slot in engine_heads(slots):
        lines.append(f'ENGINE_URLS+=("http://${{ADDR_OF[${{ROLLOUT_NODES[{slot.head_node}]}}]}}:{slot.port}")')
    timeout = ENGINE_START_TIMEOUT_S[bool(job.gpus_per_node)]
    lines += [f'{python} -m launch.engines wait --timeout {timeout} --watch-pids "${{ENGINE_PIDS[*]}}" '
              '"${ENGINE_URLS[@]}"',
              'ENGINE_URLS_TOML="[$(printf \'"%s",\' "${ENGINE_URLS[@]}" | sed \'s/,$//\')]"', ""]
    return lines


def rollout_node_script(recipe, node: int) -> str:
    """The script one rollout node runs: its engines side by side; any engine exiting ends the step."""
    slots = [s for s in engine_slots(recipe) if s.node == node]
    lines = ["#!/bin/bash", f"# Engines of rollout node {node}, rendered by `sao launch`. $1 = head address of a "
             "multi-node engine, $2 = this node's address (the engines listen there alone).",
             "set -uo pipefail", 'HEAD_HOST="${1:-$(hostname)}"', 'ENGINE_HOST="${2:-127.0.0.1}"']
    if recipe.rollout.engine != "reference":   # `sao serve` reads $SAO_API_KEY itself
        lines += write_options_lines(recipe.launch.python)
    if recipe.rollout.engine == "sglang" and recipe.rollout.engine_fp8:   # rollout.engine_gpu may not be stated
        lines += fp8_gpu_guard_lines(recipe.launch.python)
    lines += [f"{shell_join(engine_command(recipe, slot))} &" for slot in slots]
    lines += ["wait -n; rc=$?",
              'echo "rollout node: an engine exited with code $rc; stopping the others" >&2',
              'kill $(jobs -p) 2>/dev/null; exit $(( rc == 0 ? 1 : rc ))']
    return "\n".join(lines) + "\n"


def train_argv(recipe, job: JobLayout, paths: JobPaths, template: str) -> str:
    """The trainer command with {python}, {recipe} and {overrides} filled (overrides: engine URLs)."""
    overrides = "" if job.colocated else '"rollout.engine_urls=$ENGINE_URLS_TOML"'   # the key: $SAO_API_KEY
    return template.format(python=shlex.quote(recipe.launch.python), recipe=shlex.quote(str(paths.recipe)),
                           overrides=overrides).strip()


def _trainer(recipe, job: JobLayout, paths: JobPaths, template: str) -> list[str]:
    python = shlex.quote(recipe.launch.python)
    return ["# --- trainer: one rank per GPU (per task on CPU); the bootstrap maps SLURM_* to torch's env",
            # --ntasks too: srun reads the allocation's SLURM_NTASKS (every node's tasks) as its own -n
            f'{_srun_prefix(recipe, job)} --nodes={job.trainer_nodes} --ntasks={job.world} '
            f'--ntasks-per-node={job.tasks_per_node} --nodelist="$TRAINER_HOSTS" \\',
            f"  {python} -m launch.bootstrap -- {train_argv(recipe, job, paths, template)} &",
            'TRAIN_PID=$!', ""]


def _finish(recipe) -> list[str]:
    # `wait` returns early when the USR1 trap runs: keep waiting while the step is alive.
    return ["set +e",
            'while :; do wait "$TRAIN_PID"; RC=$?; kill -0 "$TRAIN_PID" 2>/dev/null || break; done',
            'if [ "$PREEMPTED" = 1 ] && [ "$REQUEUE" = true ]; then',
            '  echo "sao launch: trainer stopped after the signal (code $RC); requeueing job $SLURM_JOB_ID" >&2',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "  exit 0",
            "fi",
            'echo "sao launch: trainer finished with code $RC"',
            'exit "$RC"']


def write_job(recipe, workdir: Path, train_command: str = DEFAULT_TRAIN_COMMAND) -> JobPaths:
    """Write the resolved recipe, the rollout-node scripts and the sbatch script into the run dir."""
    run_dir = (workdir / recipe.run_dir).resolve()
    paths = JobPaths(workdir.resolve(), run_dir, run_dir / "resolved_recipe.toml", run_dir / "launch" / "job.sbatch")
    script = render_script(recipe, paths, train_command)  # render first: a bad layout writes nothing
    (run_dir / "launch").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    recipe.dump(run_dir)  # writes paths.recipe (resolved_recipe.toml)
    for node in range(recipe.launch.rollout_nodes):
        (run_dir / "launch" / f"rollout_node_{node}.sh").write_text(rollout_node_script(recipe, node))
    paths.script.write_text(script)
    paths.script.chmod(0o755)
    return paths
