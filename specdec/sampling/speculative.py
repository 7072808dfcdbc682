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

_ROW_AT_A_TIME = 8  # up to this many rows, draws and verdicts are made a row at a time (below)


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
    """_search on the CPU's cdf; up to _ROW_AT_A_TIME rows, each row's target and search in Python
    and numpy (the same float64 arithmetic: the same index), ~30-40 us less fixed overhead a draw
    than torch's batched calls (measured at vocabularies of 4k-128k). A sequential cumsum never
    decreases, so the first value past the target is a step up, a token of positive probability;
    a row whose pick has none anyway (a cumsum that rounded like a parallel scan) is searched
    again on the repaired cdf."""
    probs, uniforms = probs.double(), uniforms.double()
    cdf = torch.cumsum(probs, dim=-1)
    if len(cdf) > _ROW_AT_A_TIME:
        idx = _search(cdf, uniforms)
        bad = (probs.gather(1, idx[:, None]).squeeze(1) <= 0).numpy()
    else:
        last, found, bad = cdf.shape[-1] - 1, [], []
        for row, mass, u in zip(cdf.numpy(), probs.numpy(), uniforms.tolist()):
            total = float(row[-1])
            # u < 1 but u * total may round up to total; stay strictly below so some index qualifies.
            target = min(u * total, math.nextafter(total, 0.0))
            found.append(min(int(np.searchsorted(row, target, side="right")), last))
            bad.append(mass[found[-1]] <= 0)
        idx, bad = torch.from_numpy(np.array(found, dtype=np.int64)), np.array(bad)
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
    if p.device.type == "cpu" and B <= _ROW_AT_A_TIME:
        return _verify_rows_on_cpu(p, q_ids, q_probs, draft_tokens, num_proposed, greedy, u_accept, u_target)
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


def _verify_rows_on_cpu(p, q_ids, q_probs, draft_tokens, num_proposed, greedy, u_accept, u_target):
    """speculative_verify for a few rows on the CPU, a row at a time in Python and numpy: the same
    float32 probabilities compared in float64, the same residual, the same draw (its ~30 torch
    calls took ~0.4 ms a round at batch 1, this ~0.2). Where the batched version sums a row to
    test it, this takes its largest entry: a sum of non-negative numbers is positive exactly when
    some entry is, in any order."""
    p, q_ids, q_probs = p.float().numpy(), q_ids.long().numpy(), q_probs.float().numpy()
    tokens, u_accept = draft_tokens.long().tolist(), u_accept.double().tolist()
    u_target = u_target.double().tolist()
    accepted, dists, u_next, greedy_next = [], [], [], {}
    for b, (proposed, row_greedy) in enumerate(zip(num_proposed.tolist(), greedy.tolist())):
        a = 0
        if row_greedy:  # the greedy rule: while the target's argmax agrees
            while a < proposed and int(p[b, a].argmax()) == tokens[b][a]:
                a += 1
            accepted.append(a)
            greedy_next[b] = int(p[b, a].argmax())
            continue
        while a < proposed:  # u < min(1, p/q), without a division (as in the batched version)
            token = tokens[b][a]
            p_t, q_t = float(p[b, a, token]), float(q_probs[b, a][q_ids[b, a] == token].sum())
            if not (p_t > 0 and (p_t >= q_t or u_accept[b][a] * q_t < p_t)):
                break
            a += 1
        dist = p[b, a]
        if a < proposed:  # a rejection: the residual norm(max(0, p - q)), if it has any mass
            q_next = np.zeros_like(dist)
            np.add.at(q_next, q_ids[b, a], q_probs[b, a])
            residual = np.maximum(dist - q_next, np.float32(0))
            dist = residual if residual.max() > 0 else dist
        accepted.append(a)
        dists.append(dist)
        u_next.append(u_target[b][a])
    u_next = torch.tensor(u_next, dtype=torch.float64)  # host: this path is the CPU's
    drawn = iter(sample_from_probs(torch.from_numpy(np.stack(dists)), u_next).tolist() if dists else ())
    next_token = [greedy_next[b] if b in greedy_next else next(drawn) for b in range(len(accepted))]
    return torch.from_numpy(np.array(accepted, dtype=np.int64)), torch.from_numpy(np.array(next_token, dtype=np.int64))


def speculative_step_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the token one speculative step emits when the draft samples from q:
    P(accept t) + P(reject) * residual(t) = min(p, q) + (1 - beta) * norm(max(0, p - q))."""
    overlap = torch.minimum(p, q)
    beta = overlap.sum()
    residual = (p - q).clamp_min(0)
    mass = residual.sum()
    fallback = residual / mass if mass > 0 else p  # same guard as speculative_verify
    return overlap + (1 - beta) * fallback
