"""Recipes that build on each other (`base = "other.toml"`), wandb's entity/group/tags/notes, and the
TensorBoard sink: merged values, one-line errors at recipe check, what reaches wandb.init, the scalars
in the event files."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from sao_megatron.core.config import ConfigError, load_recipe


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, '
                                       '"num_hidden_layers": 4, "max_position_embeddings": 1024}')
    return model


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _head(tmp_path: Path) -> str:
    return f'[run]\nname = "t"\noutput_dir = "{tmp_path / "runs"}"\n[model]\npath = "{_model(tmp_path)}"\n'


def test_base_chain_deep_merges_and_the_child_wins(tmp_path):
    _write(tmp_path / "shared" / "grand.toml", _head(tmp_path) + "[algorithm]\nlr = 1e-5\nweight_decay = 0.1\n"
           "[eval]\ndatasets = ['task:arithmetic', 'task:copy']\nk = 2\n")
    _write(tmp_path / "shared" / "parent.toml", 'base = "grand.toml"\n[algorithm]\nlr = 2e-5\n[eval]\nk = 3\n')
    child = _write(tmp_path / "exp" / "child.toml", 'base = "../shared/parent.toml"\n[algorithm]\nadam_beta1 = 0.8\n'
                   "[eval]\ndatasets = ['task:arithmetic']\n")
    recipe = load_recipe(child)
    assert recipe.algorithm.lr == 2e-5                   # parent over grandparent
    assert recipe.algorithm.weight_decay == 0.1          # from the grandparent, two files up
    assert recipe.algorithm.adam_beta1 == 0.8            # the child's own key, beside the inherited ones
    assert recipe.eval.k == 3 and recipe.eval.datasets == ["task:arithmetic"]   # a list is replaced, not merged
    assert "base" not in recipe.to_dict()


def test_base_overrides_still_win(tmp_path):
    _write(tmp_path / "parent.toml", _head(tmp_path) + "[algorithm]\nlr = 1e-5\n")
    child = _write(tmp_path / "child.toml", 'base = "parent.toml"\n')
    assert load_recipe(child, ["algorithm.lr=3e-5"]).algorithm.lr == 3e-5


def test_base_cycle_is_one_line_naming_the_files(tmp_path):
    a = _write(tmp_path / "a.toml", 'base = "b.toml"\n')
    _write(tmp_path / "b.toml", 'base = "a.toml"\n')
    with pytest.raises(ConfigError) as err:
        load_recipe(a)
    text = str(err.value)
    assert err.value.field == "base" and "\n" not in text
    assert text.count("a.toml") == 2 and "b.toml" in text and "cycle" in text


@pytest.mark.parametrize("value, words", [('"missing.toml"', "does not exist"), ("3", "expected a recipe path"),
                                          ('""', "expected a recipe path")])
def test_bad_base_names_the_field(tmp_path, value, words):
    child = _write(tmp_path / "child.toml", f"base = {value}\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(child)
    assert err.value.field.startswith("base") and words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("body, field", [
    ("wandb_tags = ['" + "x" * 65 + "']", "logging.wandb_tags"),
    ("wandb_tags = ['']", "logging.wandb_tags"),
    ("wandb_tags = [3]", "logging.wandb_tags"),
    ("wandb_tags = 'one'", "logging.wandb_tags"),
    ("wandb_entity = 'my team/x'", "logging.wandb_entity"),
    ("wandb_group = 'a:b'", "logging.wandb_group"),
    ("wandb_notes = 3", "logging.wandb_notes"),
    ("tensorboard = 'yes'", "logging.tensorboard"),
])
def test_bad_logging_fields_fail_at_recipe_check(tmp_path, body, field):
    path = _write(tmp_path / "r.toml", _head(tmp_path) + f"[logging]\n{body}\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert err.value.field == field and "\n" not in str(err.value)


def test_tensorboard_without_the_package_fails_at_recipe_check(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    path = _write(tmp_path / "r.toml", _head(tmp_path) + "[logging]\ntensorboard = true\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert err.value.field == "logging.tensorboard" and "pip install tensorboard" in str(err.value)


def test_wandb_fields_reach_wandb_init(tmp_path, monkeypatch):
    from sao_megatron.metrics import build_metric_sink

    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        return types.SimpleNamespace(id="r1", log=lambda *a, **k: None, finish=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    path = _write(tmp_path / "r.toml", _head(tmp_path) + "[logging]\nwandb_entity = 'lab'\nwandb_group = 'sweep-1'\n"
                  "wandb_tags = ['sao', 'qwen3']\nwandb_notes = 'first try'\nconsole = false\n")
    recipe = load_recipe(path)
    build_metric_sink(recipe.logging, "t", tmp_path / "run", 1, {}).close()
    assert (seen["entity"], seen["group"], seen["tags"], seen["notes"]) == ("lab", "sweep-1", ["sao", "qwen3"], "first try")
    seen.clear()
    plain = load_recipe(_write(tmp_path / "p.toml", _head(tmp_path) + "[logging]\nconsole = false\n"))
    build_metric_sink(plain.logging, "t", tmp_path / "run2", 1, {}).close()
    assert (seen["entity"], seen["group"], seen["tags"], seen["notes"]) == (None, None, None, None)


def test_tensorboard_sink_writes_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sao_megatron.metrics import build_metric_sink

    path = _write(tmp_path / "r.toml", _head(tmp_path) + "[logging]\nwandb = false\nconsole = false\ntensorboard = true\n")
    recipe = load_recipe(path)
    sink = build_metric_sink(recipe.logging, "t", recipe.run_dir, 2, {})
    sink.log({"train/lr": 1e-6, "rollout/raw_reward": 0.25, "note": "text is skipped"}, 1)
    sink.log({"train/lr": 2e-6, "rollout/raw_reward": 0.5}, 2)
    sink.close()
    assert (recipe.run_dir / "metrics.jsonl").is_file()
    events = EventAccumulator(str(recipe.run_dir / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["rollout/raw_reward", "train/lr"]
    assert [(e.step, e.value) for e in events.Scalars("rollout/raw_reward")] == [(1, 0.25), (2, 0.5)]


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    """A resumed run logs steps 2-3 again: TensorBoard shows the resumed values, not both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sao_megatron.metrics.tensorboard import TensorBoardSink

    first = TensorBoardSink(tmp_path / "tb")
    for step in (1, 2, 3):
        first.log({"train/lr": float(step)}, step)
    first.close()
    resumed = TensorBoardSink(tmp_path / "tb")
    for step in (2, 3):
        resumed.log({"train/lr": 10.0 * step}, step)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/lr")] == [(1, 1.0), (2, 20.0), (3, 30.0)]
