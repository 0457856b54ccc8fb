"""Every shipped recipe plans as its header says: a `# plan: FITS on N x GPU` line is checked with the
planner `sao plan` runs (in-process, the recipe's own layout and options, N GPUs of that model); a
`# plan: cpu` recipe must launch without GPUs. A recipe without a plan line fails, so a new one must say."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.toml"))
PLAN_LINE = re.compile(r"^# plan: (?:FITS on (\d+) x (\w+)|(cpu))", re.MULTILINE)


def _header_plan(path: Path) -> tuple[int, str] | None:
    """(gpus, gpu) from the header's plan line; None for a CPU recipe."""
    header = path.read_text().split("\n[", 1)[0]
    match = PLAN_LINE.search(header)
    assert match, f"{path.name}: the header needs a '# plan: FITS on N x GPU' or '# plan: cpu' line"
    return None if match.group(3) else (int(match.group(1)), match.group(2))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_plans_as_its_header_says(path):
    from checkpoints.arch import load_recipe
    from parallel.planner import make_plan, plan_input_from_recipe

    recipe = load_recipe(str(path), [], check_files=False)
    expected = _header_plan(path)
    if expected is None:
        assert recipe.launch.gpus_per_node == 0, f"{path.name} says cpu but launches on GPUs"
        return
    gpus, gpu = expected
    assert recipe.launch.nodes * recipe.launch.gpus_per_node == gpus, \
        f"{path.name}: header says {gpus} GPUs, launch.nodes x launch.gpus_per_node gives another count"
    plan = make_plan(plan_input_from_recipe(recipe, gpus, gpu))
    assert not plan.problem, plan.problem
    peak = max(plan.peak, plan.sync_peak) / 2**30
    assert plan.fits, f"{path.name}: DOES NOT FIT on {gpus} x {gpu} (peak {peak:.1f} of {plan.capacity / 2**30:.1f} GiB)"
