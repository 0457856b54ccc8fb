"""The typed records that travel along each arrow of the data flow (docs/architecture.md).

Conventions, used everywhere:
- A sample's tokens are ``prompt_ids + response_ids``. Per-response-token lists (``loss_mask``,
  ``rollout_logprobs``, ``weight_versions``) have ``len(response_ids)`` entries.
- ``loss_mask`` is 1 for tokens the policy generated (actions) and 0 for observation tokens an
  environment inserted (tool output): they stay in the context but get no loss, value or reward.
- ``routed_experts`` is what SGLang returns: int32 ``[len(prompt_ids) + len(response_ids) - 1,
  num_hidden_layers, top_k]``, the experts each token position was routed to. The layer axis holds
  EVERY hidden layer, column = global 0-based layer id; dense layers (GLM's first_k_dense_replace)
  have all-zero columns, which replay never reads.
- ``indexer_topk`` is what a DSA engine returns (rollout/engines/indexer_topk.py), aligned as routes are:
  int32 ``[len(prompt_ids) + len(response_ids) - 1, num_hidden_layers, index_topk]``, row t the
  keys the query at position t attends, as logical token positions 0..t of the sample, -1 in unused
  slots (checkpoints/arch/dsa.py); a layer that reuses an earlier layer's selection holds a copy.
- In a TrainBatch, position t of a row holds token t, and per-token values at t (logprob, mask,
  advantage) refer to predicting token t from tokens < t. Position 0 never has a loss.
- Response space ``[B, R]`` (an AdvantageBatch) has one row per sample: position i is response
  token i. Response token i of a sample with P prompt tokens sits at t = P + i of its TrainBatch row.
- Records are built once and never changed: a later stage makes a new one (dataclasses.replace).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch


class SampleStatus(str, enum.Enum):
    PENDING = "pending"        # created, not yet generated
    COMPLETED = "completed"    # finished with a stop token
    TRUNCATED = "truncated"    # hit max_new_tokens or the context budget
    ABORTED = "aborted"        # engine aborted it (partial tokens may be kept for resumption)
    FAILED = "failed"          # reward or environment failed; `metadata["error"]` says why


_PER_POSITION = ("routed_experts", "indexer_topk")   # int32 tensors [tokens - 1, layers, k] of a Sample


@dataclass
class Sample:
    """One rollout of one prompt."""

    uid: str                                   # unique and stable across retries and resumes
    prompt_index: int                          # position of the prompt in the prompt stream
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    routed_experts: Optional[torch.Tensor] = None
    indexer_topk: Optional[torch.Tensor] = None
    reward: Optional[float] = None
    reward_info: dict = field(default_factory=dict)
    status: SampleStatus = SampleStatus.PENDING
    group_id: int = 0                          # samples of one prompt share it (group mode)
    prompt_text: str = ""
    response_text: str = ""
    label: Any = None                          # the answer / target the reward checks against
    metadata: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else -1

    def staleness(self, current_version: int) -> int:
        """Versions between the oldest token of this sample and the trainer's current weights."""
        return current_version - self.oldest_version if self.weight_versions else 0

    def check(self) -> None:
        """Raise ValueError (naming the sample and field) if per-token lists disagree in length."""
        n = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"sample {self.uid}: {name} has {len(getattr(self, name))} entries, "
                                 f"response_ids has {n}")
        for name, last in (("routed_experts", "top_k"), ("indexer_topk", "index_topk")):
            value = getattr(self, name)
            if value is not None and value.dim() != 3:
                raise ValueError(f"sample {self.uid}: {name} has shape {tuple(value.shape)}, "
                                 f"expected [tokens - 1, num_hidden_layers, {last}]")
            if value is not None and value.shape[0] != max(self.num_tokens - 1, 0):
                raise ValueError(f"sample {self.uid}: {name} has {value.shape[0]} rows, expected {self.num_tokens - 1}")

    def work_state(self) -> dict:
        """A copy of to_dict() for a driver checkpoint; a sample still being generated leaves out its routes
        and indexer choices: its continuation's engine call returns them for the whole prefix again, and
        they are the largest part of a checkpoint."""
        import copy

        state = copy.deepcopy(self.to_dict())
        if self.status in (SampleStatus.PENDING, SampleStatus.ABORTED):
            for name in _PER_POSITION:
                state.pop(name, None)
        return state

    def to_dict(self) -> dict:
        """JSON-safe form (for rollout dumps and checkpoints)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in _PER_POSITION}
        out["status"] = self.status.value
        for name in _PER_POSITION:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).tolist()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Sample":
        data = dict(data)
        data["status"] = SampleStatus(data.get("status", "pending"))
        tensors = {name: data.pop(name, None) for name in _PER_POSITION}
        sample = cls(**data)
        for name, value in tensors.items():
            if value is not None:
                tensor = torch.tensor(value, dtype=torch.int32)
                setattr(sample, name, tensor if tensor.numel() else tensor.reshape(0, 0, 0))   # [] of a 1-token sample
        return sample


@dataclass(frozen=True)
class TrainBatch:
    """Right-padded rows of whole samples, ready for one micro-batch of the trainer.

    All tensors are ``[rows, seq]`` unless noted. ``loss_mask`` marks positions whose token is an
    action (so prompt, observation and padding positions are 0).
    """

    tokens: torch.Tensor                       # long
    lengths: torch.Tensor                      # long [rows]: real tokens per row
    loss_mask: torch.Tensor                    # float
    rollout_logprobs: torch.Tensor             # float
    advantages: torch.Tensor                   # float
    returns: torch.Tensor                      # float (critic targets)
    weight_versions: torch.Tensor              # long, -1 where not generated
    sample_uids: list[str] = field(default_factory=list)
    old_logprobs: Optional[torch.Tensor] = None   # trainer's logprobs before this step's update
    ref_logprobs: Optional[torch.Tensor] = None   # reference policy (KL penalty)
    old_values: Optional[torch.Tensor] = None     # critic values before this step (value clipping)
    routed_experts: Optional[torch.Tensor] = None  # int32 [rows, seq, num_hidden_layers, topk], -1 = none
    # int32 [rows, seq, num_hidden_layers, index_topk]: at position t the keys (positions 0..t of the
    # row) the query at t attends in each DSA layer, as the engine chose them; -1 = unused slot or none
    indexer_topk: Optional[torch.Tensor] = None
    global_num_tokens: float = 0.0             # action tokens of the whole step (all micro-batches, DP ranks)
    global_num_seqs: float = 0.0               # sequences with >= 1 action token in the whole step
    # the model runs the rows back to back in one packed row (parallel.pack_sequences; parallel/packing.py
    # PackedLayout); fields stay right-padded rows here, results come back in this layout
    packed: bool = False
    # which of the step's optimizer steps (algorithm.mini_batches) trains on this micro-batch: pack_samples
    # splits the samples into that many groups before packing, so no micro-batch straddles two
    mini_batch: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])


def action_counts(batches: Sequence[TrainBatch]) -> tuple[float, float]:
    """(action tokens, sequences with >= 1 action token) over `batches`: the one place the loss
    denominators global_num_tokens / global_num_seqs are counted."""
    tokens = float(sum(b.loss_mask.sum().item() for b in batches))
    seqs = float(sum(int((b.loss_mask.sum(dim=1) > 0).sum()) for b in batches))
    return tokens, seqs


@dataclass(frozen=True)
class AdvantageBatch:
    """What an advantage estimator sees: one row per sample, in response space ``[B, R]``, right-padded
    to the longest response (shapes in sao_megatron/algorithms/advantages.py)."""

    token_rewards: torch.Tensor      # [B, R], the scalar reward on the last action token
    mask: torch.Tensor               # [B, R], 1 = action token
    values: Optional[torch.Tensor]   # [B, R] critic values (0 off the mask), or None
    seq_rewards: torch.Tensor        # [B]
    group_ids: torch.Tensor          # [B] long
    response_lengths: torch.Tensor   # [B] action-token counts
    baseline: Optional[float] = None # running-mean baseline before this batch (estimator 'running_mean')


@dataclass
class LossInputs:
    """What every policy loss receives. Tensors are ``[batch, seq]`` aligned with ``mask``."""

    logp: torch.Tensor                         # current policy logprobs (carries the gradient)
    rollout_logp: torch.Tensor                 # behaviour logprobs reported by the engine
    advantages: torch.Tensor
    mask: torch.Tensor                         # 1 for action tokens
    old_logp: Optional[torch.Tensor] = None    # proximal/old policy (PPO); defaults to rollout_logp
    ref_logp: Optional[torch.Tensor] = None    # reference policy (KL term)
    entropy: Optional[torch.Tensor] = None
    global_num_tokens: Optional[float] = None  # denominator across micro-batches and DP ranks
    global_num_seqs: Optional[float] = None


@dataclass
class LossOutputs:
    """A scalar loss to backpropagate and detached metrics (floats or 0-d tensors)."""

    loss: torch.Tensor
    metrics: dict[str, Any] = field(default_factory=dict)
