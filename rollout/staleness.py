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


def admission_room(*, bound: int, engine_version: int, next_train_version: int, pace: int, ahead: int) -> int:
    """Samples that may start now and still be trained within the staleness bound.

    A sample started now is generated from ``engine_version`` on, so its staleness when trained is at
    most the trainer's version then minus ``engine_version``. The buffer hands samples out oldest
    first, ``pace`` per policy step, so ``ahead`` samples already owed to the trainer (buffered, in
    flight, or waiting for their group) go first: the new one is trained by the batch
    ``ahead // pace`` after the next, when the trainer's version is at most
    ``next_train_version + ahead // pace`` (a step raises it by one at most). Keeping that within
    ``engine_version + bound`` gives

        ahead < (bound + 1 + engine_version - next_train_version) * pace

    which is AReaL's rollout-controller capacity (areal/core/staleness_manager.py,
    StalenessManager.get_capacity): ``(max_staleness + version + 1) * batch_size - (accepted +
    running)``, with the samples consumed so far written as ``next_train_version * pace`` and the
    rest of "accepted" (buffered) in ``ahead``. Counting versions instead of consumed samples keeps
    it right when steps consume without raising the version (critic warm-up) and across a resume.

    Samples finishing out of start order (a long response started early) can still go over the
    bound; get_batch drops those (``rollout/dropped_stale``).
    """
    return (bound + 1 + engine_version - next_train_version) * pace - ahead
