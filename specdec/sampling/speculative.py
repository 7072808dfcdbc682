"""Speculative sampling math (Leviathan et al. 2023; Chen et al. 2023), batched over sequences.

Row b proposed draft_tokens[b, :num_proposed[b]], token i sampled from q[b, i]. The target scored
every prefix, giving p[b, i] for i = 0..K (p[b, num_proposed] is the "bonus" position). Accepting
t_i with probability min(1, p_i(t_i) / q_i(t_i)) and, at the first rejection, sampling from
norm(max(0, p - q)) makes every committed token distributed exactly as p. Greedy rows use the
degenerate version: accept while the target's argmax agrees.

All functions take their randomness as explicit uniforms so callers control the generators
(see specdec.sampling.random) and tests can drive them deterministically.
"""
from __future__ import annotations

import torch


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [N, V] probs (rows need not be normalised) and [N] uniforms -> [N].

    Never returns a zero-probability token, even with u close to 1 or a parallel (GPU) cumsum
    whose rounding differs between neighbours. Rows must have positive mass.
    """
    probs = probs.double()
    cdf = torch.cumsum(probs, dim=-1)
    # At zero-probability tokens repeat the previous value, and force monotonicity with cummax:
    # searchsorted(right=True) picks the first index whose value exceeds the target, which then
    # can only be a strict increase, i.e. a token with positive probability.
    cdf = torch.where(probs > 0, cdf, torch.zeros_like(cdf)).cummax(dim=-1).values
    total = cdf[:, -1]
    target = uniforms.double().to(probs.device) * total
    # u < 1 but u * total may round up to total; stay strictly below so some index qualifies.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def speculative_verify(
    p: torch.Tensor,  # [B, K+1, V] target probs
    q: torch.Tensor,  # [B, K, V] draft probs the draft tokens were sampled from
    draft_tokens: torch.Tensor,  # [B, K] int64, padding beyond num_proposed
    num_proposed: torch.Tensor,  # [B] int64, <= K
    greedy: torch.Tensor,  # [B] bool
    u_accept: torch.Tensor,  # [B, K] uniforms for the accept tests
    u_resample: torch.Tensor,  # [B] uniforms for the correction / bonus token
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (num_accepted [B] int64, next_token [B] int64).

    The committed tokens of row b are draft_tokens[b, :num_accepted[b]] followed by next_token[b].
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
    p_t = p_draft.gather(2, safe_tokens[:, :, None]).squeeze(2)  # [B, K]
    q_t = q.float().gather(2, safe_tokens[:, :, None]).squeeze(2)
    # u < min(1, p/q) written without a division: accept when p >= q, else when u*q < p.
    # q_t is > 0 for a genuinely sampled token; with q_t == 0 this still accepts iff p_t > 0.
    u = u_accept.to(dev).float()
    accept_sampled = (p_t > 0) & ((p_t >= q_t) | (u * q_t < p_t))
    accept_greedy = p_draft.argmax(dim=-1) == safe_tokens
    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled) & valid
    # Accepted count = length of the leading run of accepts.
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    p_next = p[rows, num_accepted].float()  # [B, V]: correction position or bonus position
    rejected = num_accepted < num_proposed
    if K > 0:
        q_next = q[rows, num_accepted.clamp(max=K - 1)].float()
        residual = (p_next - q_next).clamp_min(0)
        # If p == q numerically the residual vanishes (a rejection there has probability ~0);
        # p itself is then the correct distribution to fall back to.
        use_residual = rejected & (residual.sum(dim=-1) > 0)
        dist = torch.where(use_residual[:, None], residual, p_next)
    else:
        dist = p_next
    sampled_next = sample_from_probs(dist, u_resample.to(dev))
    next_token = torch.where(greedy, p_next.argmax(dim=-1), sampled_next)
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
