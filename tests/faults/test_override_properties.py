"""Property pass over recipe overrides (issue 26.7): whatever `section.key=value` a user types, the recipe
loader answers with the recipe or a ConfigError (the CLI's one line, exit 2), never another exception (a
traceback). Keys are the schema's own (so values reach every field's coercion and range check) plus
unknown ones; values are TOML-ish text: numbers at and past every edge, strings with quotes, newlines,
NUL bytes and non-ASCII, arrays, tables. The path-valued fields also go through the file checks
(check_files=True), from a temporary working directory, since those touch the filesystem."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sao_megatron.core.config import ConfigError, load_recipe
from sao_megatron.core.config.schema import SECTIONS

KEYS = sorted(f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls))
PATH_KEYS = ["model.path", "rollout.dataset", "sft.dataset", "checkpoint.resume", "run.output_dir",
             "algorithm.ref_model_path", "run.debug_dir"]
BASE = ["model.path='unused'"]

NUMBERS = st.one_of(st.integers(min_value=-2 ** 80, max_value=2 ** 80).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr),
                    st.sampled_from(["0", "-0", "1e308", "1e-320", "inf", "-inf", "nan", "2**64", "0x10", "1_000"]))
TEXT = st.text(alphabet=st.characters(codec="utf-8", categories=["L", "N", "P", "S", "Zs", "Cc"]), max_size=24)
STRINGS = st.one_of(TEXT, TEXT.map(repr), TEXT.map(lambda t: f'"{t}"'), TEXT.map(lambda t: f"'''{t}'''"))
VALUES = st.one_of(NUMBERS, STRINGS, st.sampled_from(["true", "false", "[]", "{}", "[1, 'a']", "{a = 1}", "",
                                                      "1\n[run]\nname='x'", "'a'\nb = 2", "\x00", "[[1]]"]),
                   st.lists(NUMBERS, max_size=3).map(lambda xs: f"[{', '.join(xs)}]"))
KEY = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k.upper()),
                st.sampled_from(["run", "run.", ".x", "a.b.c", "run.name.x", "nosuch.key", "", "run .name",
                                 "--run.name"]))


def _load(overrides: list[str], check_files: bool = False):
    try:
        return load_recipe(None, BASE + overrides, check_files=check_files)
    except ConfigError as err:
        assert "\n" not in str(err).split("; fix:")[0] or "\n" in "".join(overrides), str(err)
        return None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(KEY, VALUES), min_size=1, max_size=3))
@example([("run.num_steps", "3\n[run]\nname='x'")])
@example([("rollout.top_k", str(2 ** 64))])
def test_random_overrides_are_a_recipe_or_a_config_error(pairs):
    _load([f"{key}={value}" for key, value in pairs])


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(PATH_KEYS), value=st.one_of(STRINGS, st.sampled_from(
    ["'a\\u0000b'", "'/'", "'/proc/self/mem'", "'/dev/null'", "'.'", "'..'", "'~'", "'" + "x" * 5000 + "'"])))
def test_random_paths_through_the_file_checks_are_a_recipe_or_a_config_error(tmp_path, monkeypatch, key, value):
    monkeypatch.chdir(tmp_path)
    _load([f"{key}={value}"], check_files=True)


@pytest.mark.parametrize("override", ["rollout.dataset='a\\u0000b'", "model.path='a\\u0000b'",
                                      "checkpoint.resume='a\\u0000b'", "run.output_dir='a\\u0000b'"])
def test_a_nul_byte_in_a_path_is_a_config_error(tmp_path, monkeypatch, override):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError):
        load_recipe(None, [override], check_files=True)
