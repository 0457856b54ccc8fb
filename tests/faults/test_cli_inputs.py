"""Bad command-line inputs of `sao convert` and `sao launch` (issue 15.4): exit 2 with one line naming
the input and the fix, and nothing written. convert refuses zero/negative sizes and a config.json that
contradicts its weights (which used to convert into shards no model could load); launch refuses values
that would inject lines into the sbatch script, a negative signal time and a malformed time limit, and
runs the recipe's machine checks that hold on the submit host before writing (launch/validate.py): names
always, imports unless --no-check, paths also unless --dry-run; plan runs only the name checks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sao_megatron.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_moe_cpu.toml"


def _one_line_error(capsys, *needles: str) -> str:
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ------------------------------------------------------------------------------------------ sao convert

@pytest.mark.parametrize("flags, named", [
    (["--tp", "0"], "--tp 0"), (["--tp", "-2"], "--tp -2"), (["--ep", "0"], "--ep 0"), (["--pp", "0"], "--pp 0"),
    (["--vpp", "-1"], "--vpp -1"), (["--etp", "-1"], "--etp -1"), (["--padded-vocab", "-128"], "--padded-vocab"),
    (["--tp", "3"], "parallel.tp"),   # does not divide the 4 heads: the layout check names it
])
def test_convert_refuses_bad_sizes_and_writes_nothing(tiny_model_dir, tmp_path, capsys, flags, named):
    out = tmp_path / "out"
    assert main(["convert", "hf-to-mcore", str(tiny_model_dir), str(out), *flags]) == 2
    _one_line_error(capsys, named, "fix")
    assert not out.exists()


@pytest.mark.parametrize("size", ["0", "-5", "inf", "nan"])
def test_convert_back_refuses_a_bad_shard_size(tmp_path, capsys, size):
    assert main(["convert", "mcore-to-hf", str(tmp_path / "in"), str(tmp_path / "out"), "--max-shard-mb", size]) == 2
    _one_line_error(capsys, "--max-shard-mb", "fix")
    assert not (tmp_path / "out").exists()


# (config.json change, tensor named, config key named)
CONTRADICTIONS = [
    ({"hidden_size": 96}, "model.embed_tokens.weight", "hidden_size"),
    ({"vocab_size": 999}, "model.embed_tokens.weight", "vocab_size"),
    ({"num_attention_heads": 8}, "q_proj.weight", "num_attention_heads"),
    ({"num_key_value_heads": 4}, "k_proj.weight", "num_key_value_heads"),
    ({"head_dim": 8}, "q_proj.weight", "head_dim"),
    ({"moe_intermediate_size": 48}, "mlp.experts.0.gate_proj.weight", "moe_intermediate_size"),
    ({"num_hidden_layers": 6}, "model.layers.4.", "config.json"),   # weights lack the extra layers
    ({"num_local_experts": 16}, "mlp.gate.weight", "num_experts"),
]


@pytest.mark.parametrize("change, tensor, key", CONTRADICTIONS, ids=[next(iter(c[0])) for c in CONTRADICTIONS])
def test_convert_refuses_a_config_that_contradicts_the_weights(tiny_model_dir, tmp_path, capsys, change, tensor, key):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    if "moe_intermediate_size" in change:
        assert cfg["moe_intermediate_size"] != change["moe_intermediate_size"]
    cfg.update(change)
    (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert main(["convert", "hf-to-mcore", str(model), str(out)]) == 2
    _one_line_error(capsys, tensor, key, "fix")
    assert not out.exists()


def test_fewer_layers_in_config_than_in_the_weights_is_refused_before_writing(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (model / "config.json").write_text(json.dumps(cfg))
    assert main(["convert", "hf-to-mcore", str(model), str(tmp_path / "out")]) == 2
    _one_line_error(capsys, "no Megatron mapping", "model.layers.2.")
    assert not (tmp_path / "out").exists()


def test_a_consistent_checkpoint_still_converts(tiny_model_dir, tmp_path, capsys):
    assert main(["convert", "hf-to-mcore", str(tiny_model_dir), str(tmp_path / "out"), "--tp", "2"]) == 0
    assert (tmp_path / "out" / "sao_mcore.json").is_file()


# ------------------------------------------------------------------------------------------- sao launch

def _launch(tmp_path: Path, monkeypatch, *argv: str) -> int:
    monkeypatch.chdir(tmp_path)
    return main(["launch", str(TINY), *argv])


LAUNCH_BAD = [
    (['launch.partition="gpu\\n#SBATCH --uid=0"'], "launch.partition"),
    (['launch.partition="gpu;reboot"'], "launch.partition"),
    (['launch.partition="gpu --uid=0"'], "launch.partition"),
    (['launch.account="$(id)"'], "launch.account"),
    (['launch.account="acct`id`"'], "launch.account"),
    (['run.name="job\\nrm -rf /"'], "run.name"),
    (['run.name="a b"'], "run.name"),
    (["launch.signal_seconds=-30"], "launch.signal_seconds"),
    (["launch.signal_seconds=99999"], "launch.signal_seconds"),
    (['launch.time_limit="4 hours"'], "launch.time_limit"),
    (['launch.time_limit="04:00:00\\n#SBATCH --x"'], "launch.time_limit"),
    (['launch.time_limit="00:75:00"'], "launch.time_limit"),
    (['launch.time_limit="0"'], "launch.time_limit"),
    (['launch.time_limit="00:01:00"'], "launch.signal_seconds"),          # the signal would come before the start
    (['launch.env={"BAD KEY"="1"}'], "launch.env"),
    (['launch.env={"X;id"="1"}'], "launch.env"),
    (['launch.env={X="a\\nb"}'], "launch.env.X"),
    (['launch.container="image; id"'], "launch.container"),
    (['launch.python="python; id"'], "launch.python"),
    (["--nodes", "-1"], "--nodes"),
    (["--wait-timeout", "0"], "--wait-timeout"),
    (["--wait-timeout", "nan"], "--wait-timeout"),
    (["--train-command", "python -m x {recipe}\nrm -rf /"], "--train-command"),
    (["--train-command", "python {nope}"], "--train-command"),
]


@pytest.mark.parametrize("argv, named", LAUNCH_BAD, ids=[" ".join(a) for a, _ in LAUNCH_BAD])
@pytest.mark.parametrize("mode", ["--dry-run", "write"])
def test_launch_refuses_injection_and_bad_values_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, named, mode):
    extra = ["--dry-run"] if mode == "--dry-run" else []
    assert _launch(tmp_path, monkeypatch, *argv, *extra) == 2
    _one_line_error(capsys, named, "fix")
    assert list(tmp_path.iterdir()) == []


def test_launch_refuses_a_working_directory_that_would_break_the_script(tmp_path, monkeypatch, capsys):
    odd = tmp_path / "a b"
    odd.mkdir()
    assert _launch(odd, monkeypatch, "--dry-run") == 2
    _one_line_error(capsys, "working directory", "fix")
    assert list(odd.iterdir()) == []


def test_accepted_values_render_one_line_each(tmp_path, monkeypatch, capsys):
    argv = ['launch.partition="gpu,debug"', 'launch.account="proj-1"', 'launch.time_limit="1-12:30:00"',
            "launch.signal_seconds=300", 'launch.env={NCCL_DEBUG="INFO"}', "--dry-run"]
    assert _launch(tmp_path, monkeypatch, *argv) == 0
    script = capsys.readouterr().out
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --partition=gpu,debug" in directives and "#SBATCH --account=proj-1" in directives
    assert "#SBATCH --time=1-12:30:00" in directives and "#SBATCH --signal=B:USR1@300" in directives
    assert len(directives) == len(set(d.split("=")[0] for d in directives))   # no option twice, none injected


# ------------------------------------------------------------------ submit-time recipe checks (launch, plan)

def _written(tmp_path: Path) -> list[Path]:
    return sorted(p for p in tmp_path.rglob("*") if p.is_file())


@pytest.mark.parametrize("mode", ["--dry-run", "write"])
def test_launch_refuses_an_unimportable_reward_fn_before_writing(tmp_path, monkeypatch, capsys, mode):
    extra = ["--dry-run"] if mode == "--dry-run" else []
    assert _launch(tmp_path, monkeypatch, "rollout.reward_fn='no_such_module.rewards:score'", *extra) == 2
    _one_line_error(capsys, "sao launch: recipe error: rollout.reward_fn: cannot import 'no_such_module.rewards'",
                    "fix:", "--no-check")
    assert _written(tmp_path) == []


# (override, field) refused at submit; the names ones even under --no-check
NAMES_BAD = [("rollout.task='no_such_task'", "rollout.task"),
             ("eval.datasets=['task:no_such_task']", "eval.datasets"),
             ("eval.datasets=['nosuchscheme:tasks.jsonl']", "eval.datasets")]


@pytest.mark.parametrize("override, field", NAMES_BAD, ids=[o for o, _ in NAMES_BAD])
@pytest.mark.parametrize("flags", [["--dry-run"], [], ["--no-check"]], ids=["dry-run", "write", "no-check"])
def test_launch_refuses_unknown_names_in_every_mode(tmp_path, monkeypatch, capsys, override, field, flags):
    assert _launch(tmp_path, monkeypatch, override, *flags) == 2
    err = _one_line_error(capsys, f"recipe error: {field}:", "fix:")
    assert "--no-check" not in err   # a name the code does not know is wrong on every host
    assert _written(tmp_path) == []


PATHS_BAD = [("checkpoint.resume='/nonexistent/ckpt/step_00000010'", "checkpoint.resume"),
             ("rollout.dataset='/nonexistent/train.jsonl'", "rollout.dataset"),
             ("eval.datasets=['/nonexistent/eval.jsonl']", "eval.datasets")]


@pytest.mark.parametrize("override, field", PATHS_BAD, ids=[f for _, f in PATHS_BAD])
def test_launch_checks_paths_when_writing_the_job_and_no_check_skips_them(tmp_path, monkeypatch, capsys, override,
                                                                          field):
    assert _launch(tmp_path, monkeypatch, override) == 2
    _one_line_error(capsys, f"recipe error: {field}: /nonexistent/", "does not exist", "--no-check")
    assert _written(tmp_path) == []
    # --dry-run previews anywhere (a cluster recipe on a laptop): its paths are not looked at
    assert _launch(tmp_path, monkeypatch, override, "--dry-run") == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash")
    # --no-check: paths that exist only on the compute nodes; the job is written, `sao train` checks them there
    assert _launch(tmp_path, monkeypatch, override, "--no-check") == 0
    assert (tmp_path / "runs" / "tiny-sao" / "launch" / "job.sbatch").is_file()


def test_launch_no_check_writes_a_job_whose_reward_fn_only_the_job_can_import(tmp_path, monkeypatch, capsys):
    assert _launch(tmp_path, monkeypatch, "rollout.reward_fn='in_container_only.rewards:score'", "--no-check") == 0
    resolved = (tmp_path / "runs" / "tiny-sao" / "resolved_recipe.toml").read_text()
    assert "in_container_only.rewards:score" in resolved


def test_launch_checks_the_model_against_the_layout_at_submit(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """model.path's config.json is read at submit: tp=8 cannot split the tiny model's 4 heads. The error is
    the layout's, with no --no-check hint (that config.json is wrong wherever it is read)."""
    assert _launch(tmp_path, monkeypatch, f"model.path='{tiny_model_dir}'", "parallel.tp=8") == 2
    err = _one_line_error(capsys, "parallel.tp", "4 attention heads", "fix:")
    assert "--no-check" not in err
    assert _written(tmp_path) == []


def test_launch_of_a_good_recipe_still_writes(tmp_path, monkeypatch, capsys, tiny_model_dir):
    assert _launch(tmp_path, monkeypatch, f"model.path='{tiny_model_dir}'", "rollout.reward_fn='json:loads'",
                   "eval.datasets=['task:countdown']") == 0
    assert (tmp_path / "runs" / "tiny-sao" / "launch" / "job.sbatch").is_file()


def _plan(tiny_model_dir, *overrides: str) -> int:
    return main(["plan", str(TINY), "--gpus", "1", f"model.path='{tiny_model_dir}'", *overrides])


@pytest.mark.parametrize("override, field", NAMES_BAD, ids=[o for o, _ in NAMES_BAD])
def test_plan_refuses_unknown_names(tiny_model_dir, capsys, override, field):
    assert _plan(tiny_model_dir, override) == 2
    _one_line_error(capsys, f"sao plan: recipe error: {field}:", "fix:")


@pytest.mark.parametrize("override", ["rollout.reward_fn='in_container_only.rewards:score'",
                                      "rollout.dataset='/cluster/only/train.jsonl'",
                                      "checkpoint.resume='/cluster/only/step_00000010'"])
def test_plan_leaves_imports_and_paths_to_the_cluster(tiny_model_dir, capsys, override):
    """A plan is made away from the cluster too: a module or file only the cluster has is no plan error."""
    assert _plan(tiny_model_dir, override) in (0, 1)
    captured = capsys.readouterr()
    assert "verdict:" in captured.out and "recipe error" not in captured.err
