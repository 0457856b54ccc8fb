"""Per-token weight versions and the staleness bound.

Staleness of a sample at trainer version v is ``v - min(weight_versions)`` (records.Sample). A sample
over the bound tau (``rollout.staleness_bound``) is dropped or regenerated (``rollout.stale_policy``),
as GLM-5/SAO do (drop when w_current - w_oldest > tau); a group is judged by its stalest member.

Versions of new tokens, in order of preference:
1. the engine's per-token report (``GenerateResult.output_weight_versions``): exact;
2. no weight change during the request (version at submit == version at finish): exact;
3. otherwise (an in-place update happened mid-request and the engine does not say where):
   every new token gets the older of the two versions. That over-estimates staleness, never
   under-estimates it, so the bound stays a guarantee.
"""
from __future__ import annotations

from dataclasses import dataclass

from rollout.engine import EngineError, GenerateResult
from sao_megatron.core.records import Sample


def token_versions(result: GenerateResult, submit_version: int) -> list[int]:
    n = len(result.output_ids)
    reported = result.output_weight_versions
    if reported is not None:
        if len(reported) != n:
            raise EngineError(f"engine {result.engine}: request {result.rid} reported {len(reported)} token "
                             f"versions for {n} output tokens")
        return [int(v) for v in reported]
    return [min(submit_version, int(result.weight_version))] * n


def group_staleness(group: list[Sample], current_version: int) -> int:
    return max(s.staleness(current_version) for s in group)


def is_stale(group: list[Sample], current_version: int, bound: int) -> bool:
    return group_staleness(group, current_version) > bound


@dataclass
class StalenessStats:
    """Staleness of the samples handed to the trainer in the last batch, and drops so far."""

    mean: float = 0.0
    max: int = 0
    dropped: int = 0          # samples dropped or sent back for regeneration, cumulative

    def observe(self, batch: list[Sample], current_version: int) -> None:
        values = [s.staleness(current_version) for s in batch]
        self.mean = sum(values) / len(values) if values else 0.0
        self.max = max(values) if values else 0
