"""`sao export`: a run checkpoint (Megatron distributed checkpoint of the real policy, one gloo rank) becomes
an HF directory transformers loads. After 0 steps the export is the model the run started from, tensor for
tensor, and AutoModelForCausalLM gives its logits; after a step it is the trainer's model (its export_hf
tensors) and HF's log-probabilities match the trainer's compute_logprobs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.distributed import run_distributed_test


def _recipe(model_dir: str, run_dir: Path):
    """A run's recipe, resolved and dumped into its run directory as `sao train` does."""
    from sao_megatron.core.config import load_recipe

    source = run_dir.parent / "recipe.toml"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(f'[run]\nname = "{run_dir.name}"\noutput_dir = "{run_dir.parent}"\n[model]\npath = "{model_dir}"\n'
                      '[algorithm]\nlr = 1e-2\n')
    recipe = load_recipe(source)
    recipe.dump(run_dir)
    return recipe


def _hf_every(recipe, model) -> None:
    """checkpoint.hf_every = 2: the trainer's save hook exports at step 2, not at step 3."""
    import asyncio
    import dataclasses

    from sao_megatron.trainer.checkpointing import Checkpoints

    cfg = dataclasses.replace(recipe.checkpoint, hf_every=2, save_on_signal=False)
    hook = Checkpoints(dataclasses.replace(recipe, checkpoint=cfg), rank=0, world_size=1, saves=True)
    for step in (2, 3):
        asyncio.run(hook.maybe_save(step, False, {"policy": model}))


def _run(model_dir: str, run_dir: str) -> dict:
    """Save run checkpoints at steps 0 and 1 of the tiny policy; export both through `sao export`."""
    from safetensors.torch import load_file

    from checkpoints.run_state import RunCheckpointer
    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel
    from sao_megatron.cli.main import main

    recipe = _recipe(model_dir, Path(run_dir))
    model = RLModel.build(recipe, "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    checkpoints = RunCheckpointer(Path(run_dir) / "checkpoints")
    checkpoints.save(0, {"policy": model})
    batches = lc.fixed_batches(105, num=2, seq=12)
    model.train_step(batches, lc.policy_gradient_loss)
    checkpoints.save(1, {"policy": model})
    trained = {k: v.clone() for k, v in model.export_hf()}
    _hf_every(recipe, model)
    logp = [lp for lp, _ in model.compute_logprobs(batches)]
    teardown_model_parallel()
    codes = [main(["export", f"{run_dir}/checkpoints/step_00000000", f"{run_dir}/export0"]),
             main(["export", f"{run_dir}/checkpoints/latest", f"{run_dir}/export1"])]
    return {"codes": codes, "trained": trained, "logp": logp, "tokens": [b.tokens for b in batches]}


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "runs" / "t"
    out = run_distributed_test(_run, world_size=1, timeout_s=600, args=(str(tiny_model_dir), str(run_dir)))[0]
    assert out["codes"] == [0, 0]
    return run_dir, out


def _tensors(path: Path) -> dict:
    from checkpoints.hf_io import HFCheckpoint

    return {k: v for k, v in HFCheckpoint(path).items()}


def test_export_after_zero_steps_is_the_starting_model(exported, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    run_dir, _ = exported
    original = _tensors(tiny_model_dir)
    export = _tensors(run_dir / "export0")
    assert sorted(export) == sorted(original)
    assert all(torch.equal(export[k], original[k]) for k in original)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (run_dir / "export0" / name).is_file(), name
    tokens = torch.tensor([[5, 17, 23, 42, 8, 9, 61]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(tokens).logits
        b = AutoModelForCausalLM.from_pretrained(run_dir / "export0").eval()(tokens).logits
    assert torch.equal(a, b)


def test_export_after_a_step_is_the_trainers_model(exported, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    run_dir, out = exported
    export = _tensors(run_dir / "export1")
    assert sorted(export) == sorted(out["trained"])
    assert all(torch.equal(export[k], out["trained"][k]) for k in export)
    assert not all(torch.equal(export[k], v) for k, v in _tensors(tiny_model_dir).items())   # the step moved it
    assert not (run_dir / "hf" / "step_3").exists()   # checkpoint.hf_every = 2 during the run
    during = _tensors(run_dir / "hf" / "step_2")
    assert sorted(during) == sorted(export) and all(torch.equal(during[k], export[k]) for k in export)
    marker = json.loads((run_dir / "export1" / "sao_export.json").read_text())
    assert marker["step"] == 1 and marker["role"] == "policy"
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "export1").eval()
    for tokens, trainer_logp in zip(out["tokens"], out["logp"]):
        with torch.no_grad():
            logp = torch.log_softmax(hf(tokens).logits.float(), dim=-1)
        ours = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)   # token t from position t-1
        assert torch.allclose(ours, trainer_logp[:, 1:], atol=1e-4), (ours - trainer_logp[:, 1:]).abs().max()


def test_export_refuses_what_is_not_a_run_checkpoint(tmp_path, tiny_model_dir, capsys):
    from sao_megatron.cli.main import main

    assert main(["export", str(tiny_model_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a run checkpoint" in err


def _sao_eval(run_dir: Path, checkpoint: str, out: Path) -> dict:
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "eval", str(run_dir / "resolved_recipe.toml"),
           "eval.datasets=['task:arithmetic']", "eval.k=2", "eval.max_problems=4", "rollout.max_new_tokens=4",
           "--checkpoint", checkpoint, "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_eval_scores_a_run_checkpoint_as_its_export(exported, tmp_path):
    run_dir, _ = exported
    from_checkpoint = _sao_eval(run_dir, f"{run_dir}/checkpoints/latest", tmp_path / "a.json")
    assert json.loads((run_dir / "hf" / "step_1" / "sao_export.json").read_text())["step"] == 1   # served this
    from_export = _sao_eval(run_dir, str(run_dir / "export1"), tmp_path / "b.json")
    assert from_checkpoint["eval/arithmetic/problems"] == 4
    assert from_checkpoint == from_export


def test_eval_refuses_a_checkpoint_that_is_neither(tmp_path, capsys):
    from sao_megatron.cli.main import main

    (tmp_path / "r.toml").write_text("[eval]\ndatasets = ['task:arithmetic']\n")
    assert main(["eval", str(tmp_path / "r.toml"), "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a run checkpoint" in err and "HF model directory" in err


def test_export_refuses_a_corrupted_checkpoint_naming_the_file(exported, tmp_path, capsys):
    import shutil

    from sao_megatron.cli.main import main

    run_dir, _ = exported
    copy = tmp_path / "runs" / "t"
    shutil.copytree(run_dir / "checkpoints", copy / "checkpoints")
    shutil.copy(run_dir / "resolved_recipe.toml", copy)
    shard = next(p for p in sorted((copy / "checkpoints" / "step_00000001" / "policy").rglob("*")) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["export", str(copy), str(tmp_path / "out")]) == 2   # runs/NAME: its newest checkpoint, step 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and shard.name in err and "step_N" in err
    assert not (tmp_path / "out").exists()


def test_export_of_a_critic_the_run_did_not_have_is_one_line(exported, tmp_path, capsys):
    from sao_megatron.cli.main import main

    run_dir, _ = exported
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--role", "critic"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no critic" in err and "fix:" in err


@pytest.mark.parametrize("value", ["-1", "'2'", "1.5"])
def test_bad_hf_every_fails_at_recipe_check(tmp_path, value):
    from sao_megatron.core.config import ConfigError, load_recipe

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2, '
                                                 '"num_experts": 8, "num_hidden_layers": 4}')
    path = tmp_path / "r.toml"
    path.write_text(f'[run]\noutput_dir = "{tmp_path}"\n[model]\npath = "{tmp_path / "m"}"\n'
                    f'[checkpoint]\nhf_every = {value}\n')
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert err.value.field == "checkpoint.hf_every" and "\n" not in str(err.value)


@pytest.mark.parametrize("extra, words", [(["--max-shard-mb", "0"], "--max-shard-mb"),
                                          (["--timeout-s", "-1"], "--timeout-s"), ([], "not empty")])
def test_export_arguments_are_checked_in_one_line(tmp_path, capsys, extra, words):
    from sao_megatron.cli.main import main

    out = tmp_path / "out"
    out.mkdir()
    if not extra:
        (out / "x").write_text("taken")
    assert main(["export", str(tmp_path / "runs" / "t"), str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err and "fix:" in err
