"""`sao bench stability --arms`: a subset of the variant's arms, in the variant's order, SAO always among them."""
from __future__ import annotations

import inspect

import pytest

from bench import runner
from bench.algorithms import ARMS_FULL
from bench.stability import run, select_arms


def test_arms_keep_the_variants_order():
    assert select_arms(["grpo", "sao"], list(ARMS_FULL)) == ["sao", "grpo"]


@pytest.mark.parametrize("arms, says", [(["sao", "nope"], "unknown arms ['nope']"), (["grpo"], "sao is missing")])
def test_a_bad_arm_list_is_one_line_naming_the_option(arms, says):
    with pytest.raises(ValueError) as err:
        select_arms(arms, list(ARMS_FULL))
    message = str(err.value)
    assert message.startswith("--arms ") and says in message and "\n" not in message


def test_the_runner_hands_arms_to_the_benchmarks_that_take_them(monkeypatch, tmp_path):
    seen = {}

    def fake_run(quick=False, out_dir=None, full=False, jobs=1, arms=None):
        seen.update(arms=arms, full=full)
        return {"summary": ""}

    assert "arms" in inspect.signature(run).parameters
    monkeypatch.setattr("bench.stability.run", fake_run)
    result = runner.run_one("stability", False, tmp_path, full=True, jobs=2, arms=["sao", "grpo"])
    assert seen == {"arms": ["sao", "grpo"], "full": True}
    assert result["command"] == "sao bench stability --full --arms sao,grpo --jobs 2"


def test_full_stability_moves_only_the_arms_in_full_arm_lr_and_keeps_the_rest_of_the_setting(monkeypatch):
    from bench import stability

    monkeypatch.setattr(stability, "FULL_ARM_LR", {"gspo": "1e-4"})
    moved, kept = stability.arm_setting("gspo", True), stability.arm_setting("sao", True)
    assert kept == stability.FULL_SETTING
    assert moved == ["algorithm.lr=1e-4" if x.startswith("algorithm.lr=") else x for x in stability.FULL_SETTING]
    assert moved != kept and stability.arm_setting("gspo", False) == stability.SETTING    # the quick/default setting is shared


def test_the_stability_report_names_an_arm_run_at_its_own_lr():
    from bench.report_stability import _arm_lr_text

    setting = ["algorithm.lr=3e-4", "rollout.staleness_bound=8"]
    said = _arm_lr_text({"setting": setting, "arm_lr": {"sao": "3e-4", "gspo": "1e-4"}})
    assert "except gspo at 1e-4" in said and "sao" not in said and "did not learn at 3e-4" in said
    assert _arm_lr_text({"setting": setting, "arm_lr": {"sao": "3e-4"}}) == ""
    assert _arm_lr_text({"setting": setting}) == ""          # a file from before arm_lr
