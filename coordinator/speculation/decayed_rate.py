"""A success rate that forgets: the estimate both the speculation policy (acceptance per draft
token) and the pre-draft gate (pre-drafts kept) keep per request and per kind of request.

rate = (prior_weight * prior + successes) / (prior_weight + trials), where each add() first
decays the past successes and trials by `decay`: recent rounds count most, and the prior (worth
`prior_weight` trials) keeps one unlucky round from deciding anything on its own.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecayedRate:
    decay: float
    prior_weight: float
    successes: float = 0.0
    trials: float = 0.0

    def add(self, successes: float, trials: float) -> None:
        self.successes = self.decay * self.successes + successes
        self.trials = self.decay * self.trials + trials

    def rate(self, prior: float) -> float:
        return (self.prior_weight * prior + self.successes) / (self.prior_weight + self.trials)
