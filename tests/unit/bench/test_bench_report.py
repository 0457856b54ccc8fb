"""The results report renders from the JSON files alone, says "not measured" for what is missing and
never writes the repository's docs/results.md from a quick or foreign out dir; the online benchmark's
recovery count on hand-made reward curves."""
from __future__ import annotations

import json
import pytest

from bench import REPO
from bench.online import recovery_per_switch
from bench.registry import BENCHMARKS, RUN_ORDER
from bench.report import render, report_path

PIPELINE = {"bench": "pipeline", "quick": False, "full": False, "wall_s": 37.4, "command": "sao bench pipeline",
            "machine": {"platform": "Linux", "python": "3.11.7", "cpus": 2, "accelerator": None},
            "summary": "SIMULATED engines: 4.75x", "simulated_engine": True, "speedup_samples_per_s": 4.75,
            "async_single": {"trainer_idle_after_first_batch": 0.004}}


def test_missing_results_are_reported_as_not_measured(tmp_path):
    text = render(tmp_path, tmp_path / "results.md")
    assert text.startswith("# Results\n")
    for name in RUN_ORDER:
        assert f"`sao bench {name}`)\n\nNot measured: there is no `{name}.json`" in text


def test_the_registry_lists_each_benchmark_once_with_a_module_that_runs_it():
    import importlib
    import inspect

    names = [b.name for b in BENCHMARKS]
    assert len(set(names)) == len(names) and sorted(RUN_ORDER) == sorted(names)
    for name in names:
        run = importlib.import_module(f"bench.{name}").run
        assert "quick" in inspect.signature(run).parameters, name


def test_numbers_and_notes_come_from_the_json(tmp_path):
    (tmp_path / "pipeline.json").write_text(json.dumps(PIPELINE))
    text = render(tmp_path, tmp_path / "results.md")
    assert "Measured by `sao bench pipeline` on 2 CPU cores, no GPU, Python 3.11.7 (Linux); wall time 37 s." in text
    assert "**simulated**" in text and "met (4.75x)" in text
    slower = dict(PIPELINE, simulated_engine=False, speedup_samples_per_s=2.0)
    (tmp_path / "pipeline.json").write_text(json.dumps(slower))
    text = render(tmp_path, tmp_path / "results.md")
    assert "**simulated**" not in text and "NOT met (2.00x)" in text


def test_quick_and_foreign_out_dirs_never_render_the_repository_report(tmp_path):
    assert report_path(REPO / "results", quick=False) == REPO / "docs" / "results.md"
    assert report_path(REPO / "results", quick=True) == REPO / "results" / "results.md"
    assert report_path(tmp_path, quick=False) == tmp_path / "results.md"


def _rows(phases: list[int], rewards: list[float], warmup: int = 2) -> list[dict]:
    rows = [{"step": i + 1, "env/phase": 0, "rollout/raw_reward": 0.0} for i in range(warmup)]  # critic warm-up
    return rows + [{"step": warmup + i + 1, "env/phase": p, "rollout/raw_reward": r, "train/pg_loss": 0.0}
                   for i, (p, r) in enumerate(zip(phases, rewards))]


def test_recovery_counts_steps_of_the_new_phase_only():
    # phase 0 ends at 0.5 (target 0.4). Phase 1's first batch (0.9) still holds old-rule rewards and is
    # left out; then the moving average of phase 1's own steps is 0.375 after 4 of them and first reaches
    # the target after 5 ((0.1+0.2+0.5+0.7+0.7)/5 = 0.44): 6 steps after the switch.
    before = [0.5] * 6
    after = [0.9, 0.1, 0.2, 0.5, 0.7, 0.7, 0.7]
    phases = [0] * 6 + [1] * 7
    [switch] = recovery_per_switch(_rows(phases, before + after), ("digits", "capitals", "punctuation"))
    assert switch["from"] == "digits" and switch["to"] == "capitals"
    assert switch["before"] == pytest.approx(0.5) and switch["target"] == pytest.approx(0.4)
    assert switch["dip"] == pytest.approx(0.44) and switch["informative"] is False  # the dip already meets it
    assert switch["recovery_steps"] == 6 and switch["steps_in_phase"] == 7


def test_a_late_batch_of_the_old_phase_stays_in_the_new_segment_and_never_is_none():
    phases = [0] * 5 + [1, 0, 1, 1]           # one batch after the switch still reports phase 0
    rewards = [0.5] * 5 + [0.0] * 4
    [switch] = recovery_per_switch(_rows(phases, rewards), ("digits", "capitals", "punctuation"))
    assert switch["steps_in_phase"] == 4 and switch["recovery_steps"] is None and switch["informative"] is True


def _policy_rows(acc, entropy=None, gap=None):
    n = len(acc)
    entropy = entropy or [1.0] * n
    gap = gap or [0.1] * n
    return ([{"step": 0, "rollout/accuracy": acc[0]}]      # a critic warm-up step: no policy metrics
            + [{"step": i + 1, "rollout/accuracy": a, "train/entropy": e, "train/train_rollout_logprob_abs_diff": g,
                "train/grad_norm": 1.0, "rollout/staleness": 2.0, "rollout/staleness_max": 8}
               for i, (a, e, g) in enumerate(zip(acc, entropy, gap))])


def test_collapse_is_a_fall_from_the_peak_an_entropy_collapse_on_wrong_answers_or_a_ratio_divergence():
    from bench.stability import collapse_signals

    steady = collapse_signals(_policy_rows([0.4] * 10 + [0.7] * 30))
    assert not steady["collapsed"] and steady["peak_acc"] == pytest.approx(0.7) and steady["staleness_max"] == 8
    fell = collapse_signals(_policy_rows([0.4] * 10 + [0.8] * 20 + [0.1] * 20))
    assert fell["reward_collapse"] and fell["collapsed"] and fell["max_acc_drop"] == pytest.approx(0.7)
    small = collapse_signals(_policy_rows([0.1] * 20 + [0.16] * 10 + [0.07] * 20))   # below half, but by < 0.1
    assert not small["reward_collapse"]
    certain_and_wrong = collapse_signals(_policy_rows([0.4] * 20 + [0.3] * 20, entropy=[1.0] * 20 + [0.05] * 20))
    assert certain_and_wrong["entropy_collapse"] and not certain_and_wrong["reward_collapse"]
    certain_and_right = collapse_signals(_policy_rows([0.4] * 20 + [0.9] * 20, entropy=[1.0] * 20 + [0.05] * 20))
    assert not certain_and_right["collapsed"]                     # converged, not collapsed
    diverged = collapse_signals(_policy_rows([0.5] * 40, gap=[0.1] * 30 + [0.5] * 10))
    assert diverged["ratio_divergence"] and diverged["logprob_gap_last_over_first"] == pytest.approx(5.0)


def _stability(sao_collapsed: int, grpo_collapsed: int) -> dict:
    def runs(k):
        return [{"collapsed": i < k, "final_acc": 0.2 if i < k else 0.7} for i in range(5)]

    results = {a: {"runs": runs(k), "collapsed": k} for a, k in (("sao", sao_collapsed), ("grpo", grpo_collapsed))}
    return {"quick": False, "results": results}


def _arm(final: list[float], gain: list[float] | None = None) -> dict:
    return {"per_seed": {"final_acc": final, "gain": gain or [0.0] * len(final)}}


def _claim_rows(text: str) -> dict:
    return {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| claim")}


def test_each_claim_gets_the_verdict_its_holm_corrected_test_gives():
    from bench.report_claims import claims_section

    ten = [0.01 * i for i in range(10)]
    high, mid, low = [0.8 + x for x in ten], [0.5 + x for x in ten], [0.2 + x for x in ten]
    algos = {"quick": False, "table": {
        "chain:1:1/grpo": _arm(mid, gain=[0.1 + x for x in ten]), "chain:1:1/grpo_dis": _arm(high),
        "chain:1:1/sao": _arm([0.785 + x for x in reversed(ten)]), "chain:1:1/ppo": _arm(low)}}
    text = claims_section({"algorithms": algos, "stability": _stability(0, 5)})
    rows = _claim_rows(text)
    assert rows["RL improves on the SFT model"][-1] == "supports"
    assert rows["GRPO+DIS beats GRPO"][-1] == "supports"
    assert rows["SAO beats GRPO+DIS"][-1] == "cannot tell"         # 0.785-0.875 vs 0.80-0.89 overlap
    assert rows["SAO beats GRPO"][-1] == "supports"
    assert rows["SAO (DIS) beats PPO-clip with a critic"][-1] == "supports"
    stable = rows["SAO stays stable where vanilla GRPO collapses"]
    # Fisher p = 2/252 is the 5th smallest of 6 (the 10-seed tests are far smaller): Holm multiplies it by 2
    assert "Fisher" in stable[2] and float(stable[4]) == pytest.approx(4 / 252, abs=1e-3) and stable[-1] == "supports"
    from bench.stats import holm

    tested = [r for r in rows.values() if r[3] != "n/a"]
    assert [float(r[4]) for r in tested] == pytest.approx(holm([float(r[3]) for r in tested]), abs=1e-3)
    untested = rows["DIS beats PPO-clip inside SAO (same critic, same samples)"]   # the arm is not in the file
    assert "`sao_ppo_clip` is not in this file's `chain:1:1` runs" in untested[2]
    assert "not yet run at full size" in untested[2]
    assert untested[3:] == ["n/a", "n/a", "cannot tell"] and f"all {len(tested)} tested rows" in text
    # the default design records its arms too: the ablations it leaves to --full stay rows that say so
    default = dict(algos, task_runs={"chain:1:1": {"arms": ["sao", "grpo", "grpo_dis", "gspo", "ppo"]}})
    kept = _claim_rows(claims_section({"algorithms": default}))
    assert "not yet run at full size" in kept["SAO's critic beats a running-mean baseline (single rollout both)"][2]
    assert "secondary source" in rows["GRPO+DIS beats GRPO"][1] and "Provenance" in text
    assert claims_section({"stability": _stability(0, 5)}).count("| supports |") == 1   # alone: p = 0.008
    assert "| refutes |" in claims_section({"stability": _stability(5, 0)})
    assert claims_section({"algorithms": dict(algos, quick=True)}) == ""     # a smoke run makes no claim


def test_online_phase_levels_average_each_phase_over_seeds():
    from bench.report_learning import phase_levels

    table = {"sao": {"switches": [{"from": "digits", "before": 0.9}, {"from": "digits", "before": 0.7},
                                  {"from": "capitals", "before": 0.5}]},
             "grpo": {"switches": [{"from": "digits", "before": 0.4}]}}
    assert phase_levels(table) == {"digits": {"sao": pytest.approx(0.8), "grpo": 0.4},
                                    "capitals": {"sao": 0.5}}


def _memory(peak_ratio: float, allocated: bool = True) -> dict:
    def pair(ratio: float) -> dict:
        return {"predicted": 100.0 * 2**20, "measured": ratio * 100 * 2**20, "ratio": ratio}

    layout = {"state": pair(1.0), "activations": pair(1.05), "prediction": {"kernels": "local"}}
    layout |= {"peak": pair(peak_ratio), "peak_rss": pair(1.5)} if allocated else {"peak": pair(1.5)}
    return {"method": "how it was measured", "layouts": {"single": layout, "tp2": layout}}


def test_parallel_memory_verdict_holds_the_allocated_peak_to_the_target_and_lists_rss():
    from bench.report_systems import parallel_memory

    met = parallel_memory(_memory(1.04))
    assert "Peak allocated (state + tensors alive at the forward/backward peak): 2 of 2 layouts within" in met
    assert "peak RSS is 1.50-1.50x" in met and "not met" not in met
    assert "| single | peak (allocated) | 100.00 | 104.00 | 1.04 |" in met
    assert "The peak part of the target is not met" in parallel_memory(_memory(1.30))
    old = parallel_memory(_memory(0, allocated=False))      # a file from before the allocated peak
    assert "Peak allocated: not measured in this file" in old and "| single | peak (RSS) |" in old


def test_a_hand_written_tail_survives_a_re_render(tmp_path):
    from bench.report import HAND_WRITTEN, write_report

    doc = tmp_path / "results.md"
    write_report(tmp_path, doc)
    assert HAND_WRITTEN not in doc.read_text()
    doc.write_text(doc.read_text() + "\n" + HAND_WRITTEN + "\n\n## Measured by hand\nnumbers\n")
    write_report(tmp_path, doc)
    text = doc.read_text()
    assert text.count(HAND_WRITTEN) == 1 and text.endswith("## Measured by hand\nnumbers\n")
    assert text.index("## The tiny demo") < text.index(HAND_WRITTEN)


def test_the_repository_report_keeps_its_hand_written_sections():
    from bench.report import HAND_WRITTEN

    assert HAND_WRITTEN in (REPO / "docs" / "results.md").read_text()


def test_a_run_that_learned_then_fell_records_its_peak_gain_and_the_step_it_collapsed():
    from bench.stability import collapse_signals

    # 10 steps at 0.4, 20 at 0.8, then 0.1: the moving average of 10 is (8 - 0.7k) / 10 k steps into the
    # fall, first below half the peak (0.4) at k = 6, policy step 36. Start = the first 10 batches (0.4).
    run = collapse_signals(_policy_rows([0.4] * 10 + [0.8] * 20 + [0.1] * 20))
    assert run["peak_gain"] == pytest.approx(0.4) and run["learned"] and run["collapse_step"] == 36
    flat = collapse_signals(_policy_rows([0.4] * 20 + [0.45] * 20))
    assert flat["peak_gain"] == pytest.approx(0.05) and not flat["learned"] and flat["collapse_step"] is None


def test_the_stability_report_draws_survival_from_collapse_steps_and_says_when_a_file_has_none():
    from bench.report_stability import stability_section

    def runs(steps):
        return [{"collapsed": s is not None, "collapse_step": s, "steps": 50, "final_acc": 0.3, "peak_acc": 0.8,
                 "start_acc": 0.4, "peak_gain": 0.4, "max_acc_drop": 0.5, "grad_norm_spikes": 0,
                 "staleness_mean": 1.0, "staleness_max": 2} for s in steps]

    result = {"quick": False, "results": {"sao": {"runs": runs([None] * 5), "seeds": [1, 2, 3, 4, 5], "collapsed": 0},
                                          "grpo": {"runs": runs([5, 6, 7, 8, 9]), "seeds": [1, 2, 3, 4, 5],
                                                   "collapsed": 5}}}
    text = stability_section(result, lambda *a: "")
    assert "| sao | never reached | 1.00 |" in text and "| grpo | 7 | 0.00 |" in text
    assert "| sao vs grpo | 0 (" in text and "5 of 5" in text
    assert "No run collapsed" not in text and "never learned" not in text
    assert "Every arm first learns in this setting: at least 5 of 5 runs" in text
    unlearned = {a: dict(v, runs=[dict(x, peak_gain=0.05) for x in v["runs"]]) for a, v in result["results"].items()}
    assert "runs that never learned" in stability_section(dict(result, results=unlearned), lambda *a: "")
    assert "Every arm first learns" not in stability_section(dict(result, results=unlearned), lambda *a: "")
    assert "grpo: 5 of its 5" in stability_section(dict(result, results=unlearned), lambda *a: "")
    calm = {a: dict(v, runs=[dict(x, collapsed=False) for x in v["runs"]]) for a, v in result["results"].items()}
    assert "No run collapsed in this file" in stability_section(dict(result, results=calm), lambda *a: "")
    assert "No run's accuracy collapsed" not in text
    # a ratio divergence but no accuracy collapse anywhere: nothing for the log-rank test, and it says so
    no_drop = {a: dict(v, runs=[dict(x, collapse_step=None) for x in v["runs"]]) for a, v in result["results"].items()}
    no_drop["sao"]["runs"][0].update(collapsed=True, ratio_divergence=True)
    said = stability_section(dict(result, results=no_drop), lambda *a: "")
    assert "No run's accuracy collapsed in any arm" in said and "cannot tell" in said
    for run in result["results"]["sao"]["runs"]:
        del run["collapse_step"]
    assert "Time to collapse: not recorded in this file" in stability_section(result, lambda *a: "")


def test_the_engine_section_reports_the_spread_and_the_padding_bound():
    from bench.engine import padding_bound, quartiles
    from bench.report_systems import engine_section

    # 2 rows, budgets 8 and 16: generate decodes 2 x 16 slots for 24 useful tokens -> at most 4/3 from padding
    assert padding_bound([8, 16]) == pytest.approx(4 / 3)
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0) and quartiles([1.0, 3.0]) == (1.5, 2.5)
    r = {"ratio": 2.0, "model_preset": "small", "torch_threads": 1, "summary": "engine",
         "reference_server_s": [1.0, 1.0, 2.0], "hf_generate_s": [1.5, 3.0, 3.0], "output_budgets": [8, 16]}
    text = engine_section(r, lambda *a: "")
    # per-repeat ratios 1.5, 3.0, 1.5: quartiles 1.5 and 2.25
    assert "per-repeat ratios 1.50, 3.00, 1.50 (interquartile range 1.50-2.25x)" in text
    assert "gains at most 1.33x" in text and "exceeds that bound" in text
    assert "exceeds" not in engine_section(dict(r, ratio=1.2), lambda *a: "")


def test_the_pipeline_section_separates_asynchrony_from_single_rollouts_when_the_file_has_the_group_arm():
    from bench.report_systems import pipeline_section

    base = dict(PIPELINE, sync_group={"samples_per_s": 10.0})
    assert "not yet run at full size" in pipeline_section(base, None)
    both = dict(base, async_single={"samples_per_s": 40.0, "trainer_idle_after_first_batch": 0.0},
                async_group={"samples_per_s": 20.0})
    text = pipeline_section(both, None)
    assert "= 2.00x (asynchrony alone)" in text and "= 2.00x (single rollouts alone)" in text


def test_a_stale_file_is_named_in_its_section_and_the_rest_of_the_report_still_renders(tmp_path):
    (tmp_path / "pipeline.json").write_text(json.dumps({k: v for k, v in PIPELINE.items()
                                                         if k != "speedup_samples_per_s"}))
    text = render(tmp_path, tmp_path / "results.md")
    assert "Not rendered: `pipeline.json` has no field 'speedup_samples_per_s'" in text
    assert "rerun `sao bench pipeline`" in text and "## Parallel layouts" in text
