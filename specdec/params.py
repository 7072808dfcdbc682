"""Per-request sampling parameters, validated once at the edge."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature == 0 means greedy decoding (argmax); top_k == 0 and top_p == 1.0 disable those
    filters; repetition_penalty == 1.0 disables the penalty. `seed` (an unsigned 64-bit integer)
    makes sampling reproducible: every random draw is a function of the seed and the token's
    position (specdec.sampling.random), so batching never changes what a seeded request gets.
    Unseeded requests get a random seed when they are admitted.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept a list for `stop` (a common call style) but keep the dataclass hashable.
        if not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Greedy with no repetition penalty: each token is the raw logits' argmax, so no
        distribution needs building."""
        return self.greedy and self.repetition_penalty == 1.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field; the gRPC layer maps it to INVALID_ARGUMENT."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (self.repetition_penalty > 0.0) or self.repetition_penalty == float("inf"):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1.0 disables it), got {self.repetition_penalty!r}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 64):
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
