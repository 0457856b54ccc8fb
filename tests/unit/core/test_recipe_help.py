"""`sao train --help-recipe`: every field of every section with its type, default, range and doc,
generated from the schema; each documented range is the one the section's check() enforces."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from sao_megatron.cli.main import main
from sao_megatron.core.config import ConfigError, load_recipe
from sao_megatron.core.config.recipe_help import field_default, parse_bounds, recipe_help, toml_value
from sao_megatron.core.config.schema import SECTIONS

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe_cpu.toml"


def _blocks(text: str) -> dict[str, list[str]]:
    blocks, current = {}, None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = blocks.setdefault(line[1:-1], [])
        elif current is not None:
            current.append(line)
    return blocks


def test_every_field_of_every_section_shows_its_default_and_doc():
    blocks = _blocks(recipe_help())
    assert list(blocks) == list(SECTIONS)
    for section, cls in SECTIONS.items():
        text = "\n".join(blocks[section])
        for f in dataclasses.fields(cls):
            [line] = [li for li in blocks[section] if li.startswith(f"  {f.name}: ")]
            assert f" = {toml_value(field_default(f))}" in line, line
            first_words = " ".join(f.metadata["doc"].split()[:4])
            assert first_words in " ".join(text.split()), (section, f.name)


@pytest.mark.parametrize("section, line", [
    ("run", '  debug: "none" | "rollout-only" | "train-only" = "none"'),
    ("rollout", "  temperature: float = 1.0  (range > 0)"),
    ("rollout", "  top_p: float = 1.0  (range (0, 1])"),
    ("rollout", "  engine_urls: list = []"),
    ("algorithm", "  eps_low: float or unset = unset  (range > 0)"),
    ("algorithm", "  baseline_momentum: float = 0.9  (range [0, 1))"),
    ("parallel", "  micro_batch_tokens: int = 4096  (range >= 16)"),
    ("launch", "  env: table = {}"),
])
def test_types_defaults_and_ranges_read_as_written_in_a_recipe(section, line):
    assert line in _blocks(recipe_help())[section]


def _valid_sections():
    recipe = load_recipe(str(TINY), check_files=False)
    return {name: getattr(recipe, name) for name in SECTIONS}


def _bounded_fields():
    return [(name, f) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.metadata.get("bounds")]


@pytest.mark.parametrize("section, f", _bounded_fields(), ids=lambda x: getattr(x, "name", x))
def test_each_documented_range_is_what_check_enforces(section, f):
    base = _valid_sections()[section]
    low, low_in, high, high_in = parse_bounds(f.metadata["bounds"])
    step = 1 if isinstance(field_default(f), int) or f.type == "int" else 0.5
    default = field_default(f)
    if default is not None:
        assert (low < default or (low_in and default == low)) and (default < high or (high_in and default == high))
    outside = [low - step if low_in else low] + ([high + step if high_in else high] if high != float("inf") else [])
    for value in outside:
        with pytest.raises(ConfigError) as err:
            dataclasses.replace(base, **{f.name: value}).check(section)
        assert err.value.field == f"{section}.{f.name}", (value, err.value)
    inside = [x for x, inclusive in ((low, low_in), (high, high_in)) if inclusive and abs(x) != float("inf")]
    for value in inside:
        dataclasses.replace(base, **{f.name: value}).check(section)


def test_sao_train_help_recipe_prints_to_stdout_without_a_recipe(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help-recipe"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("Recipe fields") and "[weight_sync]" in out and "  staleness_bound: int = 4" in out


def test_the_help_loads_without_torch():
    code = "import sys; import sao_megatron.core.config.recipe_help; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
