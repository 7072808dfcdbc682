"""The speedup speculative decoding should give, from acceptance rate, draft length and cost ratio.

With per-token acceptance rate a (independent tokens), K draft tokens per round and a draft step
costing c target steps (Leviathan et al., 2023):

    tokens per target pass  E = (1 - a^(K+1)) / (1 - a)
    speedup                 S = E / (K c + 1)
"""
from __future__ import annotations

import math


def expected_tokens_per_round(a: float, k: int) -> float:
    """(1 - a^(K+1)) / (1 - a); the a -> 1 limit is K + 1."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {a!r}")
    if k < 0:
        raise ValueError(f"K must be >= 0, got {k!r}")
    if math.isclose(a, 1.0, rel_tol=0.0, abs_tol=1e-12):
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def theoretical_speedup(a: float, k: int, c: float) -> float:
    """(1 - a^(K+1)) / ((1 - a)(K c + 1)): expected speedup over plain decoding of the target."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c!r}")
    return expected_tokens_per_round(a, k) / (k * c + 1.0)
