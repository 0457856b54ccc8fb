"""HF (on-disk names) <-> the live Megatron tensors of one rank, through the one name map.

The rules (which HF tensors make up which Megatron tensor, and how they pack) live in
checkpoints/name_map.py and checkpoints/tensor_layouts.py and serve the offline converter too. This
module only resolves a *live* module's tensors against them:

- Local layer and expert indices become global ones through each layer's ``layer_number`` and each
  MoE layer's ``local_expert_indices`` (so PP, VPP and EP offsets come from Megatron itself).
- Transformer Engine names (fused norms, grouped experts) are read as their local-spec equivalents.
- How a tensor splits over TP comes from the parameter's own attributes (``tensor_model_parallel``,
  ``partition_dim``), because a layer spec may replicate what another splits; the rule only says
  whether a dim-0 split is a GLU split (gate and up chunked separately) or a padded vocabulary.
"""
from __future__ import annotations

import re
from typing import Callable, Iterator, Mapping

import torch

from checkpoints.arch import ArchSpec, spec_from_hf_config
from checkpoints.convert import pack_rule, unpack_rule
from checkpoints.name_map import Rule, all_rules, canonical_mcore_name, final_rules
from checkpoints.tensor_layouts import merge_tp, split_tp

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


class MappingError(KeyError):
    """A Megatron tensor with no HF source (or an HF tensor missing from the state dict)."""


def _rule_table(spec: ArchSpec) -> dict[str, Rule]:
    """Global Megatron name -> rule; includes the tied output layer a last pipeline stage holds."""
    return {r.mcore: r for r in all_rules(spec) + final_rules(spec, include_tied_output=True)}


class HFMapping:
    """The name map of one model; `layer_of` / `expert_of` give global indices of local modules."""

    def __init__(self, spec: ArchSpec, layer_of: Callable[[int], int] = lambda i: i,
                 expert_of: Callable[[int, int], int] = lambda i, j: j, rules: dict[str, Rule] | None = None):
        self.spec, self.layer_of, self.expert_of = spec, layer_of, expert_of
        self._rules = rules if rules is not None else _rule_table(spec)

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "HFMapping":
        return cls(spec_from_hf_config(hf_config))

    def for_module(self, module: torch.nn.Module) -> "HFMapping":
        """A copy whose local layer/expert indices resolve through `module` (a GPTModel chunk)."""
        layers = module.decoder.layers

        def expert_of(local: int, j: int) -> int:
            return int(layers[local].mlp.local_expert_indices[j])

        return HFMapping(self.spec, lambda i: int(layers[i].layer_number) - 1, expert_of, self._rules)

    def rule(self, local_name: str) -> Rule:
        """The rule of a live (local-index, local- or TE-spec) Megatron tensor name."""
        name = canonical_mcore_name(local_name)
        match = _LAYER.match(name)
        if match:
            local, suffix = int(match.group(1)), match.group(2)
            expert = _EXPERT.match(suffix)
            if expert:
                suffix = f"mlp.experts.local_experts.{self.expert_of(local, int(expert.group(1)))}.{expert.group(2)}"
            name = f"decoder.layers.{self.layer_of(local)}.{suffix}"
        if name not in self._rules:
            raise MappingError(f"no HF name for Megatron tensor {local_name!r} (global {name!r}) in the "
                               f"{self.spec.arch} name map (checkpoints/name_map.py)")
        return self._rules[name]

    def full_tensor(self, rule: Rule, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The full (unsharded, unpadded) Megatron tensor of `rule` from HF tensors."""
        try:
            return pack_rule(rule, hf, self.spec)
        except KeyError as exc:
            raise MappingError(exc.args[0]) from None

    @staticmethod
    def split_kind(rule: Rule, param: torch.Tensor) -> str:
        """How `param` splits over its TP group: from Megatron's attributes, refined by the rule."""
        if not getattr(param, "tensor_model_parallel", False):
            return "rep"
        if getattr(param, "partition_dim", 0) == 1:
            return "row"
        return rule.split if rule.split in ("glu", "vocab") else "col"

    def shard(self, rule: Rule, full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's slice of `full`, shaped like `param` (a vocabulary is zero-padded first)."""
        kind = self.split_kind(rule, param)
        return split_tp(full, kind, rank, size, padded_rows=param.shape[0] * size if kind == "vocab" else 0)

    def unshard(self, rule: Rule, pieces: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
        """Inverse of shard over the TP pieces in rank order (the vocabulary padding removed)."""
        return merge_tp(pieces, self.split_kind(rule, param), rows=self.spec.vocab_size)

    def to_hf(self, rule: Rule, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors of one full Megatron tensor."""
        yield from unpack_rule(rule, full, self.spec).items()
