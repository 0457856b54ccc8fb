"""A changing environment for simulated online learning (task "online").

The prompt is a single lowercase letter ("x:"); which answer is rewarded depends on the phase,
and the phase switches every `switch_every` trainer steps, cycling through `rules`:

    phase(step) = (step // switch_every) % len(rules)

Style rules (the default): the rewarded character class changes, whatever the letter.
Score = the fraction of the (stripped) response's characters in the class; 0 for an empty response.
- "digits":      0-9
- "capitals":    A-Z
- "punctuation": string.punctuation
A random-init model scores about the class's share of the vocabulary (0.1-0.3) and the tiny model
learns a style within a few tens of steps, so the reward visibly drops at each switch and recovers:
"steps to recover" measures adaptation rather than noise.

Drift rules (`DRIFT_RULES`, the --full online bench): overlapping classes, as real drift overlaps,
so that every phase is reachable at its start by construction rather than by credit for the old class:
- "drift_digits":      0123456789        (shares 8, 9 with drift_capitals)
- "drift_capitals":    89ABCDEFGHIJ      (shares I, J with drift_punctuation)
- "drift_punctuation": IJ!#$%&*+?@^~012  (shares 0, 1, 2 with drift_digits)
Score = the number of distinct in-class characters / max(len(response), DRIFT_LENGTH): 1.0 takes
DRIFT_LENGTH different characters of the class, and a repeated or short answer scores less. This keeps
a policy that learned a phase spread over its class rather than on one character (which alone would
decide whether the next phase starts at 0 or at 1). A policy at 1.0 answering 8 characters of its class
at random starts the next phase at 2 x 8/10 / 8 = 0.20, 2 x 8/12 / 8 = 0.17 and 3 x 8/16 / 8 = 0.19
(tests/unit/rollout/rewards/test_online_environment.py); one that learned less, or on fewer characters, can
start far lower (or higher, from characters it still emits from two phases back). The
cycle of three returns to drift_digits at phase 4. The return link goes through 0, 1, 2, which the
capitals phase does not reward, so a drift_punctuation policy reaches it only by finding them again
(or by digits it still emits): three of its 16 characters, because with two of 12 (0, 1) all three
measured runs started phase 4 below 0.05. Measured starts, and what a 40-step phase learns instead:
bench/online.py. DRIFT_LENGTH = 8 is the tiny recipes' max_new_tokens; with fewer tokens 1.0 cannot
be reached.

Letter rules (each maps the letter to the rewarded target string):
- "upper":  x -> "X"
- "double": x -> "xx"
- "next":   x -> "y"  (z wraps to a)
Score: 1.0 for the exact target; 0.5 if the response starts with the target; else 0. The tiny model
stays near 0 on these within a phase of tens of steps; they are for larger models.

This follows the SAO paper's online-learning simulation, where the rewarded style switches between
pools and a learned baseline should recover faster after each switch than a running mean.

The environment is stateless: the driver stamps the trainer step into the sample
(``metadata["env_step"]``) before the reward runs, so scoring needs no shared mutable state and a
resumed run scores identically.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from rollout.rewards.tasks import STYLES, Problem, style_score

RULES = {
    "upper": lambda c: c.upper(),
    "double": lambda c: c * 2,
    "next": lambda c: string.ascii_lowercase[(string.ascii_lowercase.index(c) + 1) % 26],
}
DEFAULT_RULES = ("digits", "capitals", "punctuation")
DRIFT_CLASSES = {
    "drift_digits": "0123456789",
    "drift_capitals": "89ABCDEFGHIJ",
    "drift_punctuation": "IJ!#$%&*+?@^~012",
}
DRIFT_RULES = tuple(DRIFT_CLASSES)
DRIFT_LENGTH = 8
KNOWN_RULES = sorted(RULES.keys() | STYLES.keys() | DRIFT_CLASSES.keys())


def drift_score(response: str, chars: str) -> float:
    """Distinct characters of the stripped response in `chars`, over max(its length, DRIFT_LENGTH)."""
    r = response.strip()
    return len(set(r) & set(chars)) / max(len(r), DRIFT_LENGTH)


@dataclass(frozen=True)
class ChangingEnvironment:
    switch_every: int = 50
    rules: tuple = field(default=DEFAULT_RULES)

    def __post_init__(self):
        if self.switch_every < 1:
            raise ValueError(f"online environment: switch_every={self.switch_every} < 1; use 1 or more steps")
        unknown = [r for r in self.rules if r not in KNOWN_RULES]
        if unknown or not self.rules:
            raise ValueError(f"rollout.env_rules: unknown rules {unknown} (or none); choose from {KNOWN_RULES}")

    def phase(self, step: int) -> int:
        return (max(step, 0) // self.switch_every) % len(self.rules)

    def rule(self, step: int) -> str:
        return self.rules[self.phase(step)]

    def target(self, letter: str, step: int) -> str:
        return RULES[self.rule(step)](letter)

    def make(self, rng: random.Random) -> Problem:
        letter = rng.choice(string.ascii_lowercase)
        meta = {"task": "online", "switch_every": self.switch_every, "rules": list(self.rules)}
        return Problem(f"{letter}:", letter, meta)

    def score(self, response: str, letter: str, step: int) -> float:
        r = response.strip()
        if self.rule(step) in DRIFT_CLASSES:
            return drift_score(r, DRIFT_CLASSES[self.rule(step)])
        if self.rule(step) in STYLES:
            return style_score(r, self.rule(step))
        target = self.target(letter, step)
        if r == target:
            return 1.0
        return 0.5 if r.startswith(target) else 0.0

    @classmethod
    def from_metadata(cls, metadata: dict) -> "ChangingEnvironment":
        return cls(switch_every=int(metadata["switch_every"]), rules=tuple(metadata["rules"]))
