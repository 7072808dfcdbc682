"""Speculative sampling math (Leviathan et al. 2023; Chen et al. 2023), batched over sequences.

Row b proposed draft_tokens[b, :num_proposed[b]], token i sampled from q[b, i], a sparse
distribution: probability q_probs[b, i, j] on token q_ids[b, i, j] (the draft's top entries; it
sampled from exactly these). The target scored every prefix, giving p[b, i] for i = 0..K
(p[b, num_proposed] is the "bonus" position). Accepting
t_i with probability min(1, p_i(t_i) / q_i(t_i)) and, at the first rejection, sampling from
norm(max(0, p - q)) makes every committed token distributed exactly as p. Greedy rows use the
degenerate version: accept while the target's argmax agrees.

All functions take their randomness as explicit float64 uniforms, so callers decide where it comes
from (specdec.sampling.random: a function of the request's seed and the token position) and tests
can drive it deterministically.
"""
from __future__ import annotations

import math

import numpy as np
import torch

_ROW_SEARCHES = 8  # rows searched one at a time (a few us each); more: one batched search


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [N, V] probs (rows need not be normalised) and [N] uniforms -> [N].

    Never returns a zero-probability token, even with u close to 1 or a parallel (GPU) cumsum
    whose rounding differs between neighbours. Rows must have positive mass.
    """
    if probs.device.type == "cpu":
        return _sample_on_cpu(probs, uniforms)
    probs, uniforms = probs.double(), uniforms.double().to(probs.device)
    # A parallel scan may round a zero-probability token's cdf value above its neighbour's: every
    # row is searched on the repaired cdf (no flag read back: a sync per draft step on a GPU).
    return _search(_repaired(probs, torch.cumsum(probs, dim=-1)), uniforms)


def _sample_on_cpu(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """_search on the CPU's cdf; up to _ROW_SEARCHES rows, each row's target and search in Python
    and numpy (the same float64 arithmetic: the same index), ~70 us less fixed overhead a draw
    than torch's batched calls. A sequential cumsum never decreases, so the first value past the
    target is a step up, a token of positive probability; a row whose pick has none anyway (a
    cumsum that rounded like a parallel scan) is searched again on the repaired cdf."""
    probs, uniforms = probs.double(), uniforms.double()
    cdf = torch.cumsum(probs, dim=-1)
    if len(cdf) > _ROW_SEARCHES:
        idx = _search(cdf, uniforms)
        bad = (probs.gather(1, idx[:, None]).squeeze(1) <= 0).numpy()
    else:
        rows, mass, last, found = cdf.numpy(), probs.numpy(), cdf.shape[-1] - 1, []
        for row, u in zip(rows, uniforms.tolist()):
            total = float(row[-1])
            # u < 1 but u * total may round up to total; stay strictly below so some index qualifies.
            target = min(u * total, math.nextafter(total, 0.0))
            found.append(min(int(np.searchsorted(row, target, side="right")), last))
        idx = torch.from_numpy(np.array(found, dtype=np.int64))
        bad = mass[np.arange(len(found)), found] <= 0
    if bad.any():
        bad = torch.from_numpy(bad)
        idx[bad] = _search(_repaired(probs[bad], cdf[bad]), uniforms[bad])
    return idx


def _repaired(probs: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """[N, V] cdf with each zero-probability token's value the previous token's, made monotone:
    where the cdf was right already, a search finds the same positive-probability index."""
    return torch.where(probs > 0, cdf, 0.0).cummax(dim=-1).values


def _search(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[N, V] non-decreasing cdf, [N] uniforms -> [N] first index whose value exceeds u * total."""
    total = cdf[:, -1]
    # u < 1 but u * total may round up to total; stay strictly below so some index qualifies.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return idx.clamp_(max=cdf.shape[-1] - 1)


def speculative_verify(
    p: torch.Tensor,  # [B, K+1, V] target probs
    q_ids: torch.Tensor,  # [B, K, n] int64 token ids of the proposal distributions
    q_probs: torch.Tensor,  # [B, K, n] their probabilities (padding entries: 0)
    draft_tokens: torch.Tensor,  # [B, K] int64, padding beyond num_proposed
    num_proposed: torch.Tensor,  # [B] int64, <= K
    greedy: torch.Tensor,  # [B] bool
    u_accept: torch.Tensor,  # [B, K] float64 uniforms of the accept tests, per draft position
    u_target: torch.Tensor,  # [B, K+1] float64 uniforms of the target's own sample, per position
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (num_accepted [B] int64, next_token [B] int64).

    The committed tokens of row b are draft_tokens[b, :num_accepted[b]] followed by next_token[b],
    sampled with u_target[b, num_accepted[b]]: the correction at the first rejected position, or
    the bonus token after K accepted ones.
    """
    B, K1, V = p.shape
    K = K1 - 1
    dev = p.device
    rows = torch.arange(B, device=dev)
    num_proposed = num_proposed.to(dev)
    greedy = greedy.to(dev)
    tokens = draft_tokens.to(dev).long()
    valid = torch.arange(K, device=dev)[None, :] < num_proposed[:, None]
    # Padding may hold any id (e.g. -1); point it at token 0 so gathers stay in range.
    safe_tokens = torch.where(valid, tokens, torch.zeros_like(tokens))

    p_draft = p[:, :K].float()
    p_t = p_draft.gather(2, safe_tokens[:, :, None]).squeeze(2).double()  # [B, K]
    q_ids, q_probs = q_ids.to(dev).long(), q_probs.to(dev).float()
    q_t = torch.where(q_ids == safe_tokens[:, :, None], q_probs, 0.0).sum(dim=2).double()
    # u < min(1, p/q) written without a division: accept when p >= q, else when u*q < p. The
    # target checks that every proposed token has q_t > 0 before it gets here.
    u = u_accept.to(dev).double()
    accept = (p_t > 0) & ((p_t >= q_t) | (u * q_t < p_t))
    any_greedy = bool(greedy.any())  # argmax over the vocabulary only for rows that need it
    if any_greedy:
        accept = torch.where(greedy[:, None], p_draft.argmax(dim=-1) == safe_tokens, accept)
    accept &= valid
    # Accepted count = length of the leading run of accepts.
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    p_next = p[rows, num_accepted].float()  # [B, V]: correction position or bonus position
    rejected = num_accepted < num_proposed
    if K > 0:
        at = num_accepted.clamp(max=K - 1)
        q_next = torch.zeros_like(p_next).scatter_add_(1, q_ids[rows, at], q_probs[rows, at])  # [B, V]
        residual = (p_next - q_next).clamp_min(0)
        # If p == q numerically the residual vanishes (a rejection there has probability ~0);
        # p itself is then the correct distribution to fall back to.
        use_residual = rejected & (residual.sum(dim=-1) > 0)
        dist = torch.where(use_residual[:, None], residual, p_next)
    else:
        dist = p_next
    u_next = u_target.to(dev).double().gather(1, num_accepted[:, None]).squeeze(1)
    sampled_next = sample_from_probs(dist, u_next)
    next_token = torch.where(greedy, p_next.argmax(dim=-1), sampled_next) if any_greedy else sampled_next
    return num_accepted, next_token


def speculative_step_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the token one speculative step emits when the draft samples from q:
    P(accept t) + P(reject) * residual(t) = min(p, q) + (1 - beta) * norm(max(0, p - q))."""
    overlap = torch.minimum(p, q)
    beta = overlap.sum()
    residual = (p - q).clamp_min(0)
    mass = residual.sum()
    fallback = residual / mass if mass > 0 else p  # same guard as speculative_verify
    return overlap + (1 - beta) * fallback
