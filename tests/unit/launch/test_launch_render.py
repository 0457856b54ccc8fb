"""`sao launch`: the rendered sbatch script, engine placement, and the script's bash run against fake
srun/scontrol (node split, trainer step, SIGUSR1 -> checkpoint signal -> requeue)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch.engines import engine_slots
from launch.render import JobPaths, job_layout, load_launch_recipe, render_script, rollout_node_script, write_job
from sao_megatron.core.config import ConfigError, load_recipe

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"

CPU_RECIPE = """
[run]
name = "cpu-launch"
[model]
path = "models/tiny"
init_preset = "tiny"
[rollout]
engine = "reference"
[launch]
nodes = 1
gpus_per_node = 0
time_limit = "00:10:00"
signal_seconds = 30
"""


@pytest.fixture
def cpu_recipe(tmp_path) -> Path:
    path = tmp_path / "cpu.toml"
    path.write_text(CPU_RECIPE)
    return path


def _paths(tmp_path: Path) -> JobPaths:
    run = tmp_path / "runs" / "r"
    return JobPaths(tmp_path, run, run / "resolved_recipe.toml", run / "launch" / "job.sbatch")


def test_750b_script_splits_40_nodes_and_keeps_hyperparameters_out_of_bash(tmp_path):
    recipe = load_launch_recipe(RECIPES / "glm5_750b_a40b.toml")
    script = render_script(recipe, _paths(tmp_path))
    for line in ("#SBATCH --nodes=40", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@900", "#SBATCH --time=48:00:00", 'ROLLOUT_NODES=("${NODES[@]:0:8}")',
                 "--nodes=32 --ntasks=256 --ntasks-per-node=8", "export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert line in script
    assert "SGLANG_NSA_FORCE_MLA" not in script and "INDEXER_ROPE_NEOX_STYLE" not in script   # not SGLang 0.5.23's
    assert 'ENGINE_URLS+=("http://${ADDR_OF[${ROLLOUT_NODES[0]}]}:30000")' in script and script.count("ENGINE_URLS+=") == 1
    for hyper in ("lr", "1e-06", "eps_", "batch_size", "micro_batch", "16384", "tp-size"):
        assert hyper not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_750b_engine_spans_8_nodes_with_sglang_multinode_flags():
    recipe = load_launch_recipe(RECIPES / "glm5_750b_a40b.toml")
    node3 = rollout_node_script(recipe, 3)
    assert "--tp-size 64 --ep-size 64" in node3 and "--attn-dp-size 64" in node3 and "--quantization fp8" in node3
    assert "--nnodes 8 --node-rank 3" in node3 and '--dist-init-addr "$HEAD_HOST:29600"' in node3
    assert "--enable-return-routed-experts" in node3 and '--config "$SAO_ENGINE_OPTIONS"' in node3
    assert "--enable-return-indexer-topk" in node3   # GLM-5's DSA indexer, replayed by the trainer
    assert "--api-key" not in node3   # the key is read from a 0600 file written from the environment
    assert 'os.environ["SAO_API_KEY"]' in node3 and 'SAO_ENGINE_OPTIONS="$(mktemp --suffix=.yaml)"' in node3
    subprocess.run(["bash", "-n"], input=node3, text=True, check=True)


def test_qwen_node_runs_two_4_gpu_engines_side_by_side():
    recipe = load_launch_recipe(RECIPES / "qwen3_30b_a3b.toml")
    slots = engine_slots(recipe)
    assert [(s.engine, s.node, s.base_gpu, s.port) for s in slots] == [(0, 0, 0, 30000), (1, 0, 4, 30001)]
    assert recipe.parallel.world_size == 8 and job_layout(recipe).tasks_per_node == 8


def test_glm45_engine_of_32_gpus_spans_its_4_rollout_nodes():
    recipe = load_launch_recipe(RECIPES / "glm45_355b_a32b.toml")
    slots = engine_slots(recipe)
    assert [(s.engine, s.node_rank, s.nnodes, s.head_node) for s in slots] == [(0, r, 4, 0) for r in range(4)]


def test_nodes_flag_resizes_the_trainer_world():
    # 8 rollout + 16 trainer nodes; EP32 because the recipe's EP64 does not divide the 32 ranks of a stage
    recipe = load_launch_recipe(RECIPES / "glm5_750b_a40b.toml", overrides=["parallel.ep=32"], nodes=24)
    assert recipe.parallel.world_size == 128 and recipe.parallel.tp * recipe.parallel.pp * recipe.parallel.cp == 32


def test_too_few_nodes_is_a_recipe_error():
    with pytest.raises(ConfigError, match="launch.rollout_nodes"):
        load_launch_recipe(RECIPES / "glm5_750b_a40b.toml", nodes=8)


def test_engine_tp_that_does_not_tile_a_node_names_the_field():
    recipe = load_launch_recipe(RECIPES / "qwen3_30b_a3b.toml", overrides=["rollout.engine_tp=3", "rollout.engine_ep=1"])
    with pytest.raises(ConfigError, match="rollout.engine_tp"):
        engine_slots(recipe)


def test_cpu_recipe_is_colocated_without_gpu_requests(cpu_recipe, tmp_path):
    recipe = load_launch_recipe(cpu_recipe, overrides=["launch.requeue=false"])
    script = render_script(recipe, _paths(tmp_path))
    assert "--gpus-per-node" not in script and "--exclusive" not in script
    assert "#SBATCH --no-requeue" in script and "--signal" not in script
    assert "launch.engines wait" not in script  # colocated: sao train starts its reference server
    assert f"train {tmp_path}/runs/r/resolved_recipe.toml &" in script


def test_cpu_rollout_node_runs_the_reference_server(cpu_recipe):
    recipe = load_launch_recipe(cpu_recipe, nodes=2, overrides=["launch.rollout_nodes=1"])
    node0 = rollout_node_script(recipe, 0)
    assert 'sao_megatron.cli.main serve --model models/tiny --host "$ENGINE_HOST" --port 30000' in node0
    assert 'ENGINE_HOST="${2:-127.0.0.1}"' in node0 and "0.0.0.0" not in node0
    assert "--tp 1 &" in node0
    assert "--api-key" not in node0 and "SAO_API_KEY" not in node0   # `sao serve` reads $SAO_API_KEY itself
    wide = load_launch_recipe(cpu_recipe, nodes=2, overrides=["launch.rollout_nodes=1", "rollout.engine_tp=2"])
    # the server joins the weight-update group as as many ranks as the trainer counts for it
    assert "--tp 2 &" in rollout_node_script(wide, 0)


def test_wandb_and_env_settings(cpu_recipe, tmp_path):
    recipe = load_launch_recipe(cpu_recipe, overrides=["logging.wandb=false", "launch.env={NCCL_DEBUG='INFO', X='a b'}"])
    script = render_script(recipe, _paths(tmp_path))
    assert "export WANDB_MODE=disabled" in script and "export X='a b'" in script
    assert "export NCCL_DEBUG=INFO" in script and 'WANDB_RUN_ID="cpu-launch-${SLURM_JOB_ID}"' in script


def test_write_job_dumps_a_resolved_recipe_that_loads_back(cpu_recipe, tmp_path):
    recipe = load_launch_recipe(cpu_recipe, overrides=["algorithm.lr=3e-6"])
    paths = write_job(recipe, tmp_path)
    again = load_recipe(paths.recipe, check_files=False)
    assert again.to_dict() == recipe.to_dict() and again.algorithm.lr == 3e-6
    assert os.access(paths.script, os.X_OK)


def test_cli_takes_options_after_overrides_and_dry_run_writes_nothing(cpu_recipe, tmp_path, monkeypatch, capsys):
    from sao_megatron.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["launch", str(cpu_recipe), "run.name=x", "--dry-run", "launch.time_limit='00:05:00'"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --job-name=x" in out and "#SBATCH --time=00:05:00" in out
    assert not (tmp_path / "runs").exists()
    assert main(["launch", str(cpu_recipe), "parallel.tp=0"]) == 2


def test_sao_launch_console_script_entry(cpu_recipe, tmp_path, monkeypatch, capsys):
    from launch.cli import main as sao_launch

    monkeypatch.chdir(tmp_path)
    assert sao_launch([str(cpu_recipe), "--nodes", "1"]) == 0
    assert (tmp_path / "runs" / "cpu-launch" / "launch" / "job.sbatch").is_file()
    assert "submit with: sbatch" in capsys.readouterr().out
    assert sao_launch([str(cpu_recipe), "launch.nodes=0"]) == 2


# ------------------------------------------------------------------ the script's bash, with fake slurm

FAKE_SRUN = """#!/bin/bash
case "$*" in *--bind-address*)   # the addresses step: each node answers "NAME ADDRESS"
  echo "address step $*" >> "$FAKE_LOG"; i=0; for n in $FAKE_NODES; do i=$((i + 1)); echo "$n 10.9.0.$i"; done; exit 0;;
esac
echo "srun $*" >> "$FAKE_LOG"
SLEEP=
trap 'echo "step got USR1" >> "$FAKE_LOG"; [ -n "$SLEEP" ] && kill "$SLEEP"; exit 0' USR1
if [ -n "${FAKE_SRUN_SLEEP:-}" ]; then sleep 60 & SLEEP=$!; wait "$SLEEP"; fi
exit "${FAKE_SRUN_RC:-0}"
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $FAKE_NODES; exit 0; fi
echo "scontrol $*" >> "$FAKE_LOG"
"""


def _fake_slurm(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "fake.log"),
                FAKE_NODES="n1", SLURM_JOB_ID="42", SLURM_JOB_NODELIST="n1")


def test_script_runs_the_trainer_step_and_returns_its_code(cpu_recipe, tmp_path):
    paths = write_job(load_launch_recipe(cpu_recipe), tmp_path)
    env = dict(_fake_slurm(tmp_path), FAKE_SRUN_RC="3")
    proc = subprocess.run(["bash", str(paths.script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    log = (tmp_path / "fake.log").read_text()
    assert "--nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=n1" in log and "-m launch.bootstrap -- python" in log
    assert "address step" in log and "addresses n1=10.9.0.1" in proc.stdout   # MASTER_ADDR came from it
    assert "scontrol requeue" not in log


def test_usr1_is_forwarded_to_the_trainer_then_the_job_requeues(cpu_recipe, tmp_path):
    paths = write_job(load_launch_recipe(cpu_recipe), tmp_path)
    env = dict(_fake_slurm(tmp_path), FAKE_SRUN_SLEEP="1")
    proc = subprocess.Popen(["bash", str(paths.script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "fake.log"
    for _ in range(600):  # until the trainer step has started (fake srun logged itself)
        if log.exists() and "srun" in log.read_text():
            break
        time.sleep(0.1)
    time.sleep(0.5)  # let fake srun install its trap
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    text = log.read_text()
    assert "step got USR1" in text and "scontrol requeue 42" in text
    assert "asking the trainer to checkpoint" in err


def test_every_server_address_comes_from_the_nodes_bind_address_step(cpu_recipe, tmp_path):
    """Issue 15.5: one srun step asks each node for its address on the configured interface; the
    trainer's store (MASTER_ADDR), the engine URLs and the engines' --host all use it, never 0.0.0.0."""
    recipe = load_launch_recipe(cpu_recipe, nodes=3, overrides=["launch.rollout_nodes=1", "parallel.world_size=2"])
    script = render_script(recipe, _paths(tmp_path))
    assert "--nodes=3 --ntasks=3 --ntasks-per-node=1" in script and "-m launch.bootstrap --bind-address)" in script
    assert 'export MASTER_ADDR="${ADDR_OF[${TRAINER_NODES[0]}]}"' in script
    assert 'ENGINE_URLS+=("http://${ADDR_OF[${ROLLOUT_NODES[0]}]}:30000")' in script
    assert '"${ADDR_OF[${ROLLOUT_NODES[$i]}]}" &' in script   # the node's own address: its engines' --host
    assert "0.0.0.0" not in script and "api_key" not in script


def test_a_configured_interface_reaches_gloo_and_nccl_of_every_step(cpu_recipe, tmp_path):
    recipe = load_launch_recipe(cpu_recipe, overrides=["launch.env={SAO_INTERFACE='ib0', NCCL_SOCKET_IFNAME='ib1'}"])
    script = render_script(recipe, _paths(tmp_path))
    assert "export SAO_INTERFACE=ib0" in script and "export GLOO_SOCKET_IFNAME=ib0" in script
    assert "export NCCL_SOCKET_IFNAME=ib1" in script   # a value the recipe gives wins
    assert "SOCKET_IFNAME" not in render_script(load_launch_recipe(cpu_recipe), _paths(tmp_path))
