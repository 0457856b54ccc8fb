"""The SAO paper's claims, one verdict each, from the learning benchmarks' JSON files.

Each claim is tested by one measured quantity with its 95% interval (bench/stats.py): the claim is
supported when the interval lies on its side of 0, refuted when it lies on the other side, and
"cannot tell" otherwise (or when the file is missing or from a quick run). Claims the miniature cannot
test at all (AIME-scale numbers, the critic ablations) are listed as such.
"""
from __future__ import annotations

from typing import Optional

from bench.report_format import md_table
from bench.stats import ci_text, verdict

# (claim as the paper states it, the algorithms comparison key that tests it)
ALGORITHM_CLAIMS = [
    ("RL improves on the SFT model (AIME25: SFT 80.4 -> GRPO 84.2)", "gain:grpo"),
    ("GRPO+DIS beats GRPO (84.2 -> 93.5)", "grpo_dis-grpo"),
    ("SAO beats GRPO+DIS (93.5 -> 97.3)", "sao-grpo_dis"),
    ("SAO beats GRPO (84.2 -> 97.3)", "sao-grpo"),
]
UNTESTABLE = ("Not testable here: the benchmark numbers themselves (AIME25, SWE-Bench; a 0.5M-parameter model "
              "on one-digit arithmetic is not a reasoning model), and the critic ablations (K=2 vs 1, frozen "
              "attention), which no benchmark here runs.")


def claims_section(results: dict) -> str:
    """Markdown: one row per claim (measured, verdict), or '' when no learning benchmark has a file."""
    rows = []
    algos = _usable(results.get("algorithms"))
    if algos:
        task = sorted(algos["comparisons"])[0]
        for claim, key in ALGORITHM_CLAIMS:
            diff = _algorithm_quantity(algos, task, key)
            what = ("gain of GRPO's final accuracy over its first batch" if key.startswith("gain:")
                    else f"final accuracy {key.replace('-', ' - ')}")
            rows.append([claim, f"{what} on `{task}`: {ci_text(diff) if diff else 'not measured'}",
                         verdict(diff) if diff else "cannot tell"])
    stab = _usable(results.get("stability"))
    if stab and {"sao", "grpo"} <= set(stab["results"]):
        rows.append(_stability_claim(stab))
    online = _usable(results.get("online"))
    if online and "running_mean-sao" in online.get("comparisons", {}):
        diff = online["comparisons"]["running_mean-sao"]
        rows.append(["SAO recovers faster than a running-mean baseline after a preference switch",
                     f"running_mean - sao recovery steps (censored): {ci_text(diff, 1)}", verdict(diff)])
    if not rows:
        return ""
    return "\n\n".join(["**The SAO paper's claims, as this miniature tests them** (each verdict reads the 95% "
                        "interval of the quantity beside it: supports = on the claim's side of 0, refutes = on the "
                        "other side, cannot tell = spans 0; the sections below give the numbers):",
                        md_table(["claim", "measured", "verdict"], rows), UNTESTABLE])


def _usable(result: Optional[dict]) -> Optional[dict]:
    return result if result and not result.get("quick") and "comparisons" in result else None


def _algorithm_quantity(algos: dict, task: str, key: str) -> Optional[dict]:
    if key.startswith("gain:"):
        row = algos["table"].get(f"{task}/{key.split(':')[1]}")
        return row.get("gain") if row else None
    return algos["comparisons"][task].get(key)


def _stability_claim(stab: dict) -> list:
    """SAO stays stable where GRPO collapses: collapse counts (Fisher's exact test) and final accuracy."""
    from bench.stats import fisher_exact

    sao, grpo = stab["results"]["sao"], stab["results"]["grpo"]
    n_sao, n_grpo = len(sao["runs"]), len(grpo["runs"])
    p = fisher_exact(sao["collapsed"], n_sao - sao["collapsed"], grpo["collapsed"], n_grpo - grpo["collapsed"])
    diff = stab["comparisons"].get("sao-grpo")
    if p < 0.05:
        said = "supports" if sao["collapsed"] < grpo["collapsed"] else "refutes"
    else:
        said = "cannot tell"
    measured = (f"collapsed: SAO {sao['collapsed']} of {n_sao}, GRPO {grpo['collapsed']} of {n_grpo} (Fisher exact "
                f"p = {p:.2f}); final accuracy sao - grpo {ci_text(diff) if diff else 'n/a'}")
    return ["SAO stays stable (~1000 steps) where vanilla GRPO collapses (~step 160)", measured, said]
