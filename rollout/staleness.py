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

from rollout.engines.engine import EngineError, GenerateResult
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
    """Samples over the bound so far (the batch's own staleness: rollout/batch_metrics.py)."""

    dropped: int = 0          # samples dropped or sent back for regeneration, cumulative


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


class StalenessControl:
    """The RolloutDriver's part that keeps samples within the bound: what may start (admission) and
    what a batch may not contain (the bound itself). State lives on the driver (driver.py)."""

    def _admission_room(self) -> int:
        """Samples that may start now and still be trained within the staleness bound (admission_room);
        never less than what a waiting get_batch still needs, so the trainer is never starved."""
        if not self.staleness_admission:
            return 1 << 30
        ahead = len(self._active) + self.buffer.num_ready + self.buffer.num_partial
        live = [v for n, v in self._versions.items() if n not in self._dead and n not in self._awaiting_weights]
        next_version = self._current_version if self._next_version is None else self._next_version
        room = admission_room(bound=self.cfg.staleness_bound, engine_version=min(live or self._versions.values()),
                              next_train_version=next_version, pace=max(self._pace, 1), ahead=ahead)
        return max(room, self._wanted - ahead)

    def _apply_staleness_bound(self) -> None:
        for group in self.buffer.take_stale(self._current_version, self.cfg.staleness_bound):
            self.stats.dropped += len(group)
            if self.cfg.stale_policy == "regenerate":
                self._pending.extendleft(reversed([fresh_copy(s) for s in group]))


# what a rollout wrote into a sample's metadata (agents included), dropped when it is generated again
ROLLOUT_KEYS = ("error", "engine", "env_step", "turns", "submitted", "workspace")   # not attempts: request ids stay unique


def fresh_copy(sample: Sample) -> Sample:
    """The sample as drawn from its prompt, to be generated again from scratch under the same uid."""
    keep = {k: v for k, v in sample.metadata.items() if k not in ROLLOUT_KEYS}
    return Sample(uid=sample.uid, prompt_index=sample.prompt_index, prompt_ids=sample.prompt_ids,
                  group_id=sample.group_id, prompt_text=sample.prompt_text, label=sample.label, metadata=keep)
