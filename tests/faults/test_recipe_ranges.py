"""Every recipe field has a range, checked before anything starts: `sao train` with a value outside it
exits 2 with one line naming the field (and the fix), and creates no run directory.

The systematic half walks the schema: every int/float field documents its range in ``bounds`` and a
value just outside it is refused. The listed half covers the values that used to pass (issue 15.4) and
the text fields (names, URLs, sbatch values, import paths, task names, eval sets, resume paths)."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from sao_megatron.cli.main import main
from sao_megatron.core.config import load_recipe
from sao_megatron.core.config.bounds import parse_bounds
from sao_megatron.core.config.schema import SECTIONS

REPO = Path(__file__).resolve().parents[2]
# Numeric fields whose range is another field's value (checked on the section or the root, not in bounds).
RANGED_BY_ANOTHER_FIELD = {"eval.max_episode_tokens": "eval.max_turns", "rollout.max_episode_tokens": "rollout.max_turns"}
MODEL_CONFIG = ('{"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_hidden_layers": 4, '
                '"max_position_embeddings": 4096, "model_type": "qwen3_moe"}')


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A valid recipe (recipe.toml), its fake model directory, and an output dir that does not exist yet."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(MODEL_CONFIG)
    (tmp_path / "recipe.toml").write_text(
        f'[run]\nname = "ok"\noutput_dir = "{tmp_path / "out" / "runs"}"\n'
        f'[model]\npath = "{tmp_path / "model"}"\n[rollout]\ntask = "arithmetic"\n')
    return tmp_path


def _train(workdir: Path, *overrides: str, capsys) -> tuple[int, str]:
    before = sorted(p.name for p in workdir.iterdir())
    code = main(["train", str(workdir / "recipe.toml"), *overrides])
    err = capsys.readouterr().err
    assert sorted(p.name for p in workdir.iterdir()) == before, "something was written next to the recipe"
    assert not (workdir / "out").exists(), "a run directory was created"
    return code, err


def _assert_refused(code: int, err: str, field: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"recipe error: {field}" in err and "fix:" in err, err


def _numeric_fields():
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            if inner[0] in (int, float):
                out.append((section, f, inner[0]))
    return out


def _outside(f: dataclasses.Field, kind) -> list:
    low, low_in, high, high_in = parse_bounds(f.metadata["bounds"])
    step = 1 if kind is int else 0.5
    values = [low - step if low_in else low]
    if high != float("inf"):
        values.append(high + step if high_in else high)
    return [int(v) if kind is int else float(v) for v in values]


def test_every_numeric_field_documents_a_range():
    unranged = [f"{s}.{f.name}" for s, f, _ in _numeric_fields()
                if not f.metadata.get("bounds") and f"{s}.{f.name}" not in RANGED_BY_ANOTHER_FIELD]
    assert unranged == [], f"give these fields bounds= in schema.py: {unranged}"


def _bounded_cases():
    cases = []
    for section, f, kind in _numeric_fields():
        if f.metadata.get("bounds"):
            cases += [pytest.param(f"{section}.{f.name}", v, id=f"{section}.{f.name}={v}") for v in _outside(f, kind)]
    return cases


@pytest.mark.parametrize("field, value", _bounded_cases())
def test_a_value_just_outside_each_documented_range_is_refused(workdir, capsys, field, value):
    code, err = _train(workdir, f"{field}={value}", capsys=capsys)
    _assert_refused(code, err, field)


# (override, field the error names). Values that passed before issue 15.4, then the text fields.
BAD_VALUES = [
    ("rollout.top_k=0", "rollout.top_k"),
    ("rollout.top_k=-7", "rollout.top_k"),
    ("rollout.reward_timeout_s=0", "rollout.reward_timeout_s"),
    ("rollout.max_prompt_len=-5", "rollout.max_prompt_len"),
    ("algorithm.adam_beta1=1.5", "algorithm.adam_beta1"),
    ("algorithm.adam_beta2=1.0", "algorithm.adam_beta2"),
    ("algorithm.grad_clip=-1.0", "algorithm.grad_clip"),
    ("algorithm.weight_decay=-0.1", "algorithm.weight_decay"),
    ("algorithm.kl_coef=-0.1", "algorithm.kl_coef"),
    ("algorithm.entropy_coef=-0.01", "algorithm.entropy_coef"),
    ("critic.value_clip=-0.2", "critic.value_clip"),
    ("algorithm.lr=1e308", "algorithm.lr"),
    ("critic.lr=1e308", "critic.lr"),
    ("parallel.micro_batch_tokens=100", "parallel.micro_batch_tokens"),   # one sequence is 256 + 64
    ("model.max_seq_len=300", "model.max_seq_len"),
    ("algorithm.overlong_cache=8", "algorithm.overlong_cache"),           # longer than overlong_max = 0
    ("rollout.mem_fraction=1.0", "rollout.mem_fraction"),
    ("run.seed=-1", "run.seed"),
    ("run.name='..'", "run.name"),
    ("run.name='.'", "run.name"),
    ("run.name='a/b'", "run.name"),
    ("run.name=''", "run.name"),
    ("run.name='-rf'", "run.name"),
    ('run.name="tab\\tname"', "run.name"),
    ('run.name="trailing-newline\\n"', "run.name"),
    ('launch.partition="gpu\\n"', "launch.partition"),
    ('rollout.engine_urls=["http://h:1\\n"]', "rollout.engine_urls"),
    ('rollout.reward_fn="os:getcwd\\n"', "rollout.reward_fn"),
    ("run.output_dir=''", "run.output_dir"),
    ('run.output_dir="runs\\nx"', "run.output_dir"),
    ("rollout.task='nope'", "rollout.task"),
    ("rollout.task='chain:x'", "rollout.task"),
    ("eval.datasets=['task:nope']", "eval.datasets"),
    ("eval.datasets=['nope:file.jsonl']", "eval.datasets"),
    ("eval.datasets=['missing.jsonl']", "eval.datasets"),
    ("eval.datasets=['code_repair:missing.jsonl']", "eval.datasets"),
    ("eval.datasets=[3]", "eval.datasets"),
    ("rollout.reward_fn='no_such_module_xyz:fn'", "rollout.reward_fn"),
    ("rollout.reward_fn='os:no_such_function'", "rollout.reward_fn"),
    ("rollout.reward_fn='not a path'", "rollout.reward_fn"),
    ("algorithm.loss='no_such_module_xyz:loss'", "algorithm.loss"),
    ("rollout.engine_urls=['ftp://h:1']", "rollout.engine_urls"),
    ("rollout.engine_urls=['http://h:1 x']", "rollout.engine_urls"),
    ("rollout.host='a b'", "rollout.host"),
    ('rollout.api_key="k\\nX-Evil: 1"', "rollout.api_key"),
    ("logging.wandb_project='a/b'", "logging.wandb_project"),
    ("checkpoint.resume='/nonexistent/step_00000010'", "checkpoint.resume"),
    ("checkpoint.resume=''", "checkpoint.resume"),
    ('launch.partition="gpu\\n#SBATCH --uid=0"', "launch.partition"),
    ("launch.partition='gpu;id'", "launch.partition"),
    ("launch.account='$(id)'", "launch.account"),
    ("launch.time_limit='4h'", "launch.time_limit"),
    ("launch.time_limit='00:00:00'", "launch.time_limit"),
    ("launch.time_limit='1:2:3:4'", "launch.time_limit"),
    ("launch.signal_seconds=-1", "launch.signal_seconds"),
    ("launch.signal_seconds=20000", "launch.signal_seconds"),            # after the 4 h limit
    ("launch.container='img; id'", "launch.container"),
    ("launch.python='python; id'", "launch.python"),
    ("launch.env={'A B'='1'}", "launch.env"),
    ('launch.env={A="x\\ny"}', "launch.env.A"),
    ("launch.env={A={b=1}}", "launch.env.A"),
    ("run.debug='train-only'", "run.debug_dir"),
    ("model.init_preset='huge'", "model.init_preset"),
    ("model.shape_preset='qwen9-1t'", "model.shape_preset"),
]


@pytest.mark.parametrize("override, field", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_value_exits_2_with_one_line_and_no_run_dir(workdir, capsys, override, field):
    code, err = _train(workdir, override, capsys=capsys)
    _assert_refused(code, err, field)


def test_a_recipe_that_is_not_utf8_is_one_line(workdir, capsys):
    (workdir / "recipe.toml").write_bytes((workdir / "recipe.toml").read_bytes() + b'# caf\xe9\n')
    code, err = _train(workdir, capsys=capsys)
    _assert_refused(code, err, "recipe")
    assert "not UTF-8" in err


def test_the_valid_base_recipe_passes(workdir):
    recipe = load_recipe(workdir / "recipe.toml", ["eval.datasets=['task:copy', 'task:chain:2:1']"])
    assert recipe.run.name == "ok" and not (workdir / "out").exists()


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_recipe_satisfies_the_ranges(path):
    recipe = load_recipe(path, check_files=False)
    assert recipe.model.max_seq_len >= recipe.rollout.max_prompt_len + recipe.rollout.max_new_tokens
