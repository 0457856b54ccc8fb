"""Recipes: loading, overrides, presets, and one-line errors for malformed recipes (exit 2, nothing started)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sao_megatron.cli.main import main
from sao_megatron.core.config import ConfigError, load_recipe, parse_override

REPO = Path(__file__).resolve().parents[3]


def _recipe(tmp_path: Path, body: str, model_dir: Path | None = None) -> Path:
    model = model_dir or tmp_path / "model"
    if model_dir is None:
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(
            '{"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, '
            '"num_hidden_layers": 4, "max_position_embeddings": 1024}')
    head = f'[run]\nname = "t"\noutput_dir = "{tmp_path / "runs"}"\n[model]\npath = "{model}"\n'
    body = textwrap.dedent(body)
    if body.startswith("[model]\n"):  # extra model keys join the [model] table above
        head, body = head + body[len("[model]\n"):], ""
    path = tmp_path / "recipe.toml"
    path.write_text(head + body)
    return path


def test_defaults_are_sao(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, ""))
    assert (recipe.algorithm.loss, recipe.algorithm.advantage) == ("dis", "gae")
    assert (recipe.algorithm.eps_low, recipe.algorithm.eps_high) == (0.3, 5.0)
    assert recipe.rollout.mode == "single" and recipe.critic.enabled and recipe.critic.updates_per_step == 2


def test_preset_fills_only_unset_fields(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, "[algorithm]\nname='grpo'\neps_high=0.28\n[rollout]\nn_samples_per_prompt=4\n"))
    assert recipe.algorithm.eps_low == 0.2 and recipe.algorithm.eps_high == 0.28
    assert recipe.rollout.mode == "group" and not recipe.critic.enabled


def test_overrides_are_typed_and_win(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, "[algorithm]\nlr=1e-5\n"),
                         ["algorithm.lr=3e-6", "--rollout.batch_size=8", "run.name=other", "eval.datasets=['task:copy']"])
    assert recipe.algorithm.lr == 3e-6 and recipe.rollout.batch_size == 8
    assert recipe.run.name == "other" and recipe.eval.datasets == ["task:copy"]
    assert parse_override("rollout.task=countdown") == ("rollout.task", "countdown")


def test_resolved_recipe_round_trips(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, "[algorithm]\nname='gspo'\n[rollout]\nn_samples_per_prompt=4\n"))
    written = recipe.dump(tmp_path / "run")
    again = load_recipe(written)
    assert again.to_dict() == recipe.to_dict()


def test_config_package_imports_without_torch():
    code = "import sys, sao_megatron.core.config, sao_megatron.cli.main; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


BAD_RECIPES = [
    ("unknown key", "[algorithm]\nlrr = 1e-6\n", "algorithm.lrr", "did you mean 'lr'"),
    ("unknown section", "[algorithms]\nlr = 1e-6\n", "algorithms", "did you mean 'algorithm'"),
    ("wrong type", "[rollout]\nbatch_size = 'big'\n", "rollout.batch_size", "expected an integer"),
    ("bool for int", "[parallel]\ntp = true\n", "parallel.tp", "expected an integer"),
    ("bad literal", "[rollout]\nmode = 'multi'\n", "rollout.mode", "use one of"),
    ("greedy", "[rollout]\ntemperature = 0.0\n", "rollout.temperature", "greedy"),
    ("top_p range", "[rollout]\ntop_p = 1.5\n", "rollout.top_p", "not in (0, 1]"),
    ("negative lr", "[algorithm]\nlr = -1e-6\n", "algorithm.lr", "<= 0"),
    ("eps_high unset", "[algorithm]\nloss = 'ppo'\neps_high = 0.2\n", None, None),  # valid: both set via preset
    ("world size", "[parallel]\ntp = 2\npp = 2\nworld_size = 6\n", "parallel.world_size", "not divisible"),
    ("dp mismatch", "[parallel]\ntp = 2\ndp = 3\nworld_size = 4\n", "parallel.dp", "!= world_size"),
    ("ep too big", "[parallel]\nep = 4\nworld_size = 2\n", "parallel.ep", "does not divide"),
    ("tp vs heads", "[parallel]\ntp = 8\n", "parallel.tp", "attention heads"),
    ("ep vs experts", "[parallel]\nep = 3\nworld_size = 3\n", "parallel.ep", "experts"),
    ("pp vs layers", "[parallel]\npp = 3\n", "parallel.pp", "layers"),
    ("group of one", "[algorithm]\nname = 'grpo'\n", "rollout.n_samples_per_prompt", "groups of >= 2"),
    ("gae without critic", "[critic]\nenabled = false\n", "critic.enabled", "value model"),
    ("unknown algorithm", "[algorithm]\nname = 'ppo2'\n", "algorithm.name", "unknown algorithm"),
    ("batch vs group", "[algorithm]\nname='grpo'\n[rollout]\nn_samples_per_prompt=3\nbatch_size=16\n",
     "rollout.batch_size", "multiple"),
    ("vpp without pp", "[parallel]\nvpp = 2\n", "parallel.vpp", "pp > 1"),
    ("fp8 local", "[model]\nfp8 = 'delayed'\ntransformer_impl = 'local'\n", "model.fp8", "Transformer Engine"),
    ("missing dataset", "[rollout]\ndataset = '/no/such.jsonl'\n", "rollout.dataset", "does not exist"),
    ("nan", "[algorithm]\nlr = nan\n", "algorithm.lr", "not finite"),
    ("zero bucket", "[weight_sync]\nbucket_mb = 0.0\n", "weight_sync.bucket_mb", "<= 0"),
    ("keep none", "[checkpoint]\nkeep_last = 0\n", "checkpoint.keep_last", "keep at least 1"),
    ("removed key", "[rollout]\nupdate_mode = 'abort'\n", "rollout.update_mode", "set weight_sync.pause_mode"),
    ("mini-batches vs dp", "[algorithm]\nmini_batches = 4\n[rollout]\nbatch_size = 8\n[parallel]\nworld_size = 4\n",
     "algorithm.mini_batches", "use at most 2 mini-batches"),
]


@pytest.mark.parametrize("label,body,field,words", [b for b in BAD_RECIPES if b[2]], ids=[b[0] for b in BAD_RECIPES if b[2]])
def test_bad_recipe_names_field_and_fix(tmp_path, label, body, field, words):
    with pytest.raises(ConfigError) as info:
        load_recipe(_recipe(tmp_path, body))
    message = str(info.value)
    assert info.value.field == field
    assert words in message and "fix:" in message and "\n" not in message


def test_explicit_eps_high_without_low_is_an_error(tmp_path):
    # A custom loss outside any preset: eps_low never silently becomes eps_high.
    from sao_megatron.core.config import build_recipe

    recipe = build_recipe({"model": {"path": "x"}, "algorithm": {"loss": "ppo", "advantage": "gae", "eps_low": 0.2}})
    with pytest.raises(ConfigError, match="algorithm.eps_high: is unset"):
        recipe.check(check_files=False)


def test_missing_model_dir(tmp_path):
    with pytest.raises(ConfigError, match="model.path: .* has no config.json; fix: run `sao init-model"):
        load_recipe(_recipe(tmp_path, "", model_dir=tmp_path / "nowhere"))


def test_unwritable_run_dir(tmp_path):
    if os.geteuid() == 0:
        # root can write anywhere; a regular file in the path is unwritable for everyone.
        blocker = tmp_path / "file"
        blocker.write_text("x")
        body = ""
        path = _recipe(tmp_path, body)
        with pytest.raises(ConfigError, match="run.output_dir"):
            load_recipe(path, [f"run.output_dir='{blocker}/runs'"])
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="run.output_dir"):
            load_recipe(_recipe(tmp_path, ""), [f"run.output_dir='{locked}/runs'"])


def test_invalid_toml(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("[run\nname=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(path)


def test_cli_exit_code_2_one_line_and_nothing_started(tmp_path, capsys):
    path = _recipe(tmp_path, "[rollout]\ntemperature = -1.0\n")
    code = main(["train", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "rollout.temperature" in err
    assert not (tmp_path / "runs").exists()


def test_cli_subprocess_bad_override(tmp_path):
    path = _recipe(tmp_path, "")
    proc = subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", "train", str(path), "parallel.tp=x"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "parallel.tp" in proc.stderr


def test_help_lists_every_subcommand():
    proc = subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    for name in ["train", "serve", "launch", "convert", "plan", "doctor", "bench", "eval", "init-model"]:
        assert name in proc.stdout


def test_overrides_may_follow_options():
    from sao_megatron.cli.main import parse

    args = parse(["eval", "r.toml", "--checkpoint", "ckpt", "eval.k=16", "--rollout.temperature=0.5"])
    assert args.checkpoint == "ckpt" and args.overrides == ["eval.k=16", "--rollout.temperature=0.5"]
    args = parse(["train", "r.toml", "run.seed=3", "--debug", "rollout-only", "run.num_steps=3"])
    assert args.debug == "rollout-only" and args.overrides == ["run.seed=3", "run.num_steps=3"]
    with pytest.raises(SystemExit):
        parse(["train", "r.toml", "--bogus"])
