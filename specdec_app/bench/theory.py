"""The speedup speculative decoding should give, from acceptance rate, draft length and cost ratio.

With per-token acceptance rate a (independent tokens), K draft tokens per round and a draft step
costing c target steps (Leviathan et al., 2023):

    tokens per target pass  E = (1 - a^(K+1)) / (1 - a)
    speedup                 S = E / (K c + 1)

When K is chosen per round (adaptive, up to a cap), the reference is the best fixed K under the
cap: max over k in 1..cap of S(a, k, c).
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


def best_fixed_k_speedup(a: float, max_k: int, c: float) -> tuple[float, int]:
    """(speedup, k) of the fixed k in 1..max_k with the highest theoretical speedup (the smallest
    such k on ties)."""
    if max_k < 1:
        raise ValueError(f"the largest K must be >= 1, got {max_k!r}")
    return max(((theoretical_speedup(a, k, c), k) for k in range(1, max_k + 1)), key=lambda sk: (sk[0], -sk[1]))
