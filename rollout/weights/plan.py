"""Who sends the policy's weights to the engines, decided once per run: the weight-update plan.

From the trainer's ParallelDims, the engines (count, TP) and the weight_sync section, `plan_weight_update`
gives every trainer rank its `SenderRole`; sao_megatron/trainer/weight_updates.py asks it instead of
deciding on its own, and build_weight_sync (factory.py) takes the role as it is. Torch-free: `sao plan`
and the recipe check can read it without a process group.

The roles (docs/weights.md, section 2, "Pipeline parallelism" and "Shard writes in a multi-rank run"):
- rank0: the driver rank gathers every stage's tensors and sends them (one sender: weight_sync.senders =
  driver, or pp = 1, or a single-rank trainer); export scope "all".
- stage: with broadcast and weight_sync.senders = per_stage (pp > 1), each stage's first rank sends its
  own stage's tensors on its own group `sao_weights_pp<stage>_...`, one stage after the other; export
  scope "stage".
- share: with shard writes from a multi-rank trainer every rank sends, from the tensors its TP group
  gathered, its share of the engine ranks (holder i of n serves engine-rank slots equal to i mod n);
  export scope "shares". None labels the version: the driver rank does, once every rank's writes landed.
- none: every other rank takes part in the export's collectives and sends nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.core.dims import ParallelDims

KINDS = ("none", "rank0", "stage", "share")


@dataclass(frozen=True)
class SenderRole:
    """One trainer rank's part in every weight update."""

    rank: int
    kind: str              # one of KINDS
    scope: str             # what the rank's export yields in its turn (every rank exports): "all" | "stage" | "shares"
    stage: int = 0         # its pipeline stage (a stage sender's group name carries it)
    holder: int = 0        # share: its index among the n ranks of its TP group holding a gathered tensor
    holders: int = 1       # n (expert tensors are held by the expert-TP group: the export names each tensor's)
    labels_versions: bool = True   # its sender labels the version itself (shares: the driver does, after all)
    snapshot: bool = True  # its export copies each tensor; False (broadcast): views of the live parameters,
    #                        which the sender sends or copies before the push returns (training waits for it)

    @property
    def sends(self) -> bool:
        return self.kind != "none"


@dataclass(frozen=True)
class WeightPlan:
    """Every rank's role, and how the ranks take turns: "one" (a single sender, one turn), "per_stage" (pp
    turns, stage s's sender in turn s) or "shares" (every rank at once, then the driver labels)."""

    method: str
    turns: str
    pp: int
    engines: int
    engine_tp: int
    roles: tuple[SenderRole, ...]
    sender_bytes: float = 0.0   # what one sender holds during a push beyond its shards (0: model not read)

    def role(self, rank: int) -> SenderRole:
        return self.roles[rank]

    @property
    def shares_endpoints(self) -> bool:
        """Ranks other than the driver send too: they need the driver's engine URLs (a collective)."""
        return self.turns != "one"

    @property
    def senders(self) -> int:
        return sum(r.sends for r in self.roles)


def plan_weight_update(dims: ParallelDims, weight_sync, engines: int, engine_tp: int,
                       world_size: int | None = None, sender_bytes: float = 0.0) -> WeightPlan:
    """Each rank's SenderRole under Megatron's rank order tp-cp-ep-dp-pp (pipeline outermost: the ranks
    of one stage are contiguous, the stage's first rank is its sender)."""
    world = world_size if world_size is not None else dims.world_size
    per_stage = max(world // max(dims.pp, 1), 1)
    turns = _turns(weight_sync, dims.pp, world)
    snapshot = weight_sync.method != "broadcast"   # disk and shard writes keep tensors past their turn
    roles = tuple(_role(rank, turns, rank // per_stage, rank % per_stage, dims.tp, snapshot) for rank in range(world))
    return WeightPlan(weight_sync.method, turns, dims.pp, engines, engine_tp, roles, sender_bytes)


def _turns(weight_sync, pp: int, world: int) -> str:
    if world > 1 and weight_sync.method == "shard_writes":
        return "shares"
    if world > 1 and pp > 1 and weight_sync.method == "broadcast" and weight_sync.senders == "per_stage":
        return "per_stage"
    return "one"


def _role(rank: int, turns: str, stage: int, index: int, tp: int, snapshot: bool) -> SenderRole:
    if turns == "shares":
        return SenderRole(rank, "share", "shares", stage, holder=rank % tp, holders=tp, labels_versions=False,
                          snapshot=snapshot)
    scope = "stage" if turns == "per_stage" else "all"
    if rank == 0:
        return SenderRole(rank, "rank0", scope, stage, snapshot=snapshot)
    if turns == "per_stage" and index == 0:
        return SenderRole(rank, "stage", scope, stage, snapshot=snapshot)
    return SenderRole(rank, "none", scope, stage, snapshot=snapshot)


def plan_from_recipe(recipe, world_size: int, hf: dict | None = None) -> WeightPlan:
    """The plan of a recipe's run; with the model's config.json (`hf`) it carries the sender's memory need
    (memory.py, the rule weight_sync.max_sender_mb is checked against)."""
    from .memory import recipe_sender_need

    roll = recipe.rollout
    engines = len(roll.engine_urls) or roll.num_engines
    need = recipe_sender_need(recipe, hf).total if hf is not None else 0.0
    return plan_weight_update(ParallelDims.from_config(recipe.parallel, world_size), recipe.weight_sync, engines,
                              roll.engine_tp, world_size, need)
