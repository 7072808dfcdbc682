"""What one scheduler round did: the typed value `Scheduler.step()` returns.

Streaming, metrics, the benchmark and logs all read this report; none of them looks inside the
scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.rounds.request import RequestStats


@dataclass
class RequestUpdate:
    """What one round did for one request; its client receives it as one message."""

    req_id: str
    token_ids: list[int]  # committed this round, after stop conditions
    text: str
    num_speculative_tokens: int = 0  # draft tokens asked for this round (K)
    proposed: int = 0  # draft tokens the drafter offered (may be fewer than K); of a tree, its depth
    accepted: int = 0  # of those, kept by the target
    tree_nodes: int | None = None  # a token tree's nodes, all scored by the target (None: a chain)
    # A tree's root children after the first: tried (the first was rejected), and one of them kept.
    side_tried: bool = False
    side_kept: bool = False
    finished: bool = False
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "deadline" | "error"
    stats: RequestStats | None = None  # set on the last update
    error: str | None = None
    error_kind: str | None = None  # "unavailable" | "internal" | "deadline" (maps to a gRPC code)

    @staticmethod
    def failure(req_id: str, error: str, kind: str, stats: RequestStats | None = None,
                text: str = "") -> RequestUpdate:
        """The last update of a request that did not finish normally (`kind` as error_kind)."""
        return RequestUpdate(req_id=req_id, token_ids=[], text=text, finished=True,
                             finish_reason="deadline" if kind == "deadline" else "error",
                             stats=stats, error=error, error_kind=kind)


@dataclass
class RoundReport:
    updates: list[RequestUpdate] = field(default_factory=list)
    ran: bool = False  # a target pass ran; False when the step only expired or released requests
    batch_size: int = 0  # requests in the round
    draft_seconds: float = 0.0  # in the draft worker's call (compute + transport)
    draft_catch_up: int = 0  # committed tokens the draft call fed beyond one round's worth (after K = 0)
    draft_steps: int = 0  # draft steps the serial draft call took (its largest K)
    draft_proposed: int = 0  # draft tokens it was asked for (the sum of its K's)
    target_prefill: int = 0  # context tokens the target was fed before verifying (first rounds, re-admissions)
    verify_seconds: float = 0.0  # in the target worker's call
    total_seconds: float = 0.0  # the whole step
    queue_depth: int = 0  # requests waiting for admission after the round
    running: int = 0  # requests running after the round
    kv_blocks_used: int = 0  # target KV blocks in use, as the target last reported
    kv_blocks_total: int = 0
    # Requests carried on this round after a lost worker came back, by worker ("target" | "draft").
    resumed: dict[str, list[str]] = field(default_factory=dict)
    workers_down: list[str] = field(default_factory=list)  # workers lost at the end of the step
    replica: int = 0  # which target replica's scheduler ran the step (coordinator.replicas.router)
    # Overlapped drafting (coordinator.rounds.predraft). draft_seconds above is the serial draft call only.
    worker_calls: int = 0  # messages (request + reply) exchanged with the workers in the step
    predraft_tokens: int = 0  # tokens asked of this step's pre-draft call (guesses g included)
    predraft_kept: int = 0  # pre-drafted tokens this round used: the confirmed guesses g + proposals
    predraft_hits: int = 0  # requests whose pre-draft's assumption this round's verdict confirmed
    predraft_misses: int = 0  # requests whose pre-draft it refuted (dropped)
    predraft_seconds: float = 0.0  # the pre-draft call, concurrent with verify_seconds
    predraft_wait_seconds: float = 0.0  # the step waited this long for the pre-draft after the verify

    @property
    def overhead_seconds(self) -> float:
        """Coordinator time: scheduling, stop conditions, detokenization."""
        return max(self.total_seconds - self.draft_seconds - self.verify_seconds, 0.0)

    @property
    def committed_tokens(self) -> int:
        return sum(len(u.token_ids) for u in self.updates)

    @property
    def proposed_tokens(self) -> int:
        return sum(u.proposed for u in self.updates)

    @property
    def accepted_tokens(self) -> int:
        return sum(u.accepted for u in self.updates)

    @property
    def verified_requests(self) -> int:
        """Requests the target verified this round: one target forward pass over each. Only a
        verified request gets an update without an error (expiries and failures carry one)."""
        return sum(1 for u in self.updates if u.error is None) if self.ran else 0

    @property
    def finished(self) -> list[RequestUpdate]:
        return [u for u in self.updates if u.finished]

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Round latency by phase (draft, verify, coordinator, total); empty when no round ran."""
        if not self.ran:
            return {}
        return {"draft": self.draft_seconds, "verify": self.verify_seconds, "coordinator": self.overhead_seconds,
                "total": self.total_seconds}
