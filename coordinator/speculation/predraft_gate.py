"""Which requests get a pre-draft: those whose pre-drafts are kept often enough to pay.

A pre-draft is not free even on separate devices: it is a message each way, its q rows (sampled
requests) are serialized and parsed in the coordinator beside the verify call, and where the
workers share cores it slows the verify. It saves a serial draft call only when kept, i.e. when
the target accepts the whole proposal *and* the draft guessed its bonus token, roughly alpha^(K+1).
Measured on the 2-core machine (README "Overlapped drafting"): kept ~50% of the time it gains,
kept under ~30% it loses up to a quarter of the throughput, more so for sampled requests.

Terms:
- hit rate: a request's kept / tried pre-drafts, both decayed by DECAY per verdict, plus a prior
  worth PRIOR_WEIGHT verdicts: the recent hit rate of all requests of its kind (greedy or
  sampled); seeded sampled requests use the constant SEEDED_PRIOR, so whether they are
  pre-drafted depends on their own tokens only (the verdicts), never on batch mates.
- a request is pre-drafted while its hit rate is at least THRESHOLD[greedy]; below it, one probe
  every PROBE_EVERY rounds keeps the estimate alive (acceptance drifts within a request).
- a batch: one draft call serves the whole batch, and it takes as many steps as the longest
  proposal still missing; pre-drafts spare that call only if *every* request's pre-draft is kept,
  with probability about the product of their hit rates. Below BATCH_THRESHOLD only seeded
  sampled requests are pre-drafted (by their own rule, which must not depend on batch mates).
"""
from __future__ import annotations

from dataclasses import dataclass

from coordinator.speculation.decayed_rate import DecayedRate

DECAY = 0.8
GLOBAL_DECAY = 0.95
PRIOR_WEIGHT = 3.0
SEEDED_PRIOR = 0.5
INITIAL_PRIOR = 0.5
THRESHOLD = {True: 0.3, False: 0.45}  # by greedy: a sampled pre-draft costs more (q rows both ways)
PROBE_EVERY = 8
BATCH_THRESHOLD = 0.3


@dataclass
class _Record(DecayedRate):
    """A request's pre-draft record (successes: kept, trials: tried) and the rounds it was turned
    down since its last pre-draft."""

    decay: float = DECAY
    prior_weight: float = PRIOR_WEIGHT
    rounds_off: int = 0


class PreDraftGate:
    def __init__(self):
        self._records: dict[str, _Record] = {}
        self._global = {True: _Record(GLOBAL_DECAY), False: _Record(GLOBAL_DECAY)}

    def hit_rate(self, req_id: str, greedy: bool, seeded: bool) -> float:
        prior = SEEDED_PRIOR if seeded else self._global[greedy].rate(INITIAL_PRIOR)
        return self._records.setdefault(req_id, _Record()).rate(prior)

    def admits(self, req_id: str, greedy: bool, seeded: bool) -> bool:
        """Pre-draft this request this round? (Counts the rounds it was turned down, for probes.)"""
        record = self._records.setdefault(req_id, _Record())
        if self.hit_rate(req_id, greedy, seeded) >= THRESHOLD[greedy] or record.rounds_off >= PROBE_EVERY:
            record.rounds_off = 0
            return True
        record.rounds_off += 1
        return False

    def select(self, candidates: list[tuple[str, bool, bool]]) -> set[str]:
        """The requests to pre-draft this round, of candidates (req_id, greedy, seeded): every
        request that proposes this round and has room for a next one."""
        admitted = {req_id for req_id, greedy, seeded in candidates if self.admits(req_id, greedy, seeded)}
        if len(candidates) < 2:
            return admitted
        all_kept = 1.0
        for req_id, greedy, seeded in candidates:
            all_kept *= self.hit_rate(req_id, greedy, seeded) if req_id in admitted else 0.0
        if all_kept >= BATCH_THRESHOLD:
            return admitted
        return {req_id for req_id, _, seeded in candidates if seeded and req_id in admitted}

    def observe(self, req_id: str, greedy: bool, hit: bool) -> None:
        self._records.setdefault(req_id, _Record()).add(hit, 1)
        self._global[greedy].add(hit, 1)

    def forget(self, req_id: str) -> None:
        self._records.pop(req_id, None)
