"""A request as the coordinator tracks it."""
from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.rounds.text_stream import TextStream
from specdec.params import SamplingParams


@dataclass
class RequestStats:
    proposed: int = 0  # draft tokens offered to the target
    accepted: int = 0  # draft tokens the target kept
    rounds: int = 0  # rounds this request took part in = target forward passes over it
    draft_forward_passes: int = 0
    generated: int = 0
    prompt_tokens: int = 0
    has_draft: bool = False

    @property
    def target_forward_passes(self) -> int:
        return self.rounds

    @property
    def acceptance_rate(self) -> float | None:
        if not self.has_draft or self.proposed == 0:
            return None
        return self.accepted / self.proposed

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward pass (1.0 for plain decoding)."""
        return self.generated / self.rounds if self.rounds else 0.0


@dataclass
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    num_speculative_tokens: int | None = None  # None = the server default, 0 = no speculation
    deadline: float | None = None  # time.monotonic() value after which the request is cut off
    client_seed: bool = False  # the client chose the seed: the output must be reproducible


@dataclass
class RunningRequest:
    request: Request
    num_speculative_tokens: int  # the most it asks for per round; 0: plain decoding
    stream: TextStream
    generated: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    unsent_to_draft: list[int] = field(default_factory=list)
    started_target: bool = False

    @property
    def remaining_tokens(self) -> int:
        """Tokens it may still commit before max_new_tokens."""
        return self.request.params.max_new_tokens - len(self.generated)

    @property
    def draft_backlog(self) -> int:
        """Committed tokens the drafter has not seen beyond one round's worth (K + 1): the backlog of
        rounds at K = 0 (or the prompt), which its next draft call feeds first."""
        return max(len(self.unsent_to_draft) - self.num_speculative_tokens - 1, 0)
