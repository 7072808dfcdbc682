"""Logits -> probabilities, batched over rows that each carry their own sampling parameters.

Semantics and order follow Hugging Face's logits processors (repetition penalty, temperature,
top-k, top-p), so a request decodes the same distribution here as with `model.generate`.
Everything is vectorised over rows: a batch mixes greedy and sampled requests with different
parameters, and a Python loop per row would dominate the step time on a GPU.

The draft and the target both go through `probs_from_logits` with the same parameters and the
same `presence` masks; that is what makes q and p comparable and the verification lossless.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specdec.params import SamplingParams

# Temperatures this small are greedy in all but name; the floor only keeps logits / temperature
# finite (an inf logit would turn the softmax into NaN).
MIN_TEMPERATURE = 1e-6
# Extreme but valid parameters (a repetition penalty of 1e-300) can still overflow a logit to inf;
# clamped to the largest float32, the softmax stays a distribution (ties share the mass).
LARGEST_LOGIT = torch.finfo(torch.float32).max


@dataclass
class BatchSamplingParams:
    """Per-row sampling parameters as tensors (one row per position to be sampled)."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_k: torch.Tensor  # [N] int64; 0 = disabled
    top_p: torch.Tensor  # [N] float32; 1.0 = disabled
    repetition_penalty: torch.Tensor  # [N] float32; 1.0 = disabled
    # Which transforms any row uses, known without reading the tensors back: a transform no row
    # uses is skipped (a full-vocabulary sort for top-p that nobody asked for costs 20% of a round).
    any_greedy: bool = True
    all_greedy: bool = False
    any_top_k: bool = True
    any_top_p: bool = True

    @classmethod
    def from_params(cls, params: list[SamplingParams], device="cpu") -> BatchSamplingParams:
        """The rows' parameters as tensors on `device`; the same batch of values as a recent call's
        gets that call's tensors (read only): a steady batch builds them once, not 4 tensors a step."""
        rows = tuple((p.temperature, p.top_k, p.top_p, p.repetition_penalty) for p in params)
        return _batch_params(rows, torch.device(device))

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    def __len__(self) -> int:
        return int(self.temperature.shape[0])


@functools.lru_cache(maxsize=64)
def _batch_params(rows: tuple[tuple[float, int, float, float], ...], device: torch.device) -> BatchSamplingParams:
    temperature, top_k, top_p, penalty = zip(*rows) if rows else ((), (), (), ())
    sampled = [t != 0.0 for t in temperature]  # (SamplingParams.greedy: temperature 0)
    return BatchSamplingParams(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        repetition_penalty=torch.tensor(penalty, dtype=torch.float32, device=device),
        any_greedy=not all(sampled),
        all_greedy=not any(sampled),
        any_top_k=any(k > 0 and s for k, s in zip(top_k, sampled)),
        any_top_p=any(p < 1.0 and s for p, s in zip(top_p, sampled)),
    )


def presence_mask(token_lists: list[list[int]], vocab_size: int, device="cpu") -> torch.Tensor:
    """[N, V] bool: True where the token occurs in row's token list (prompt + generated)."""
    mask = torch.zeros(len(token_lists), vocab_size, dtype=torch.bool, device=device)
    rows = [i for i, toks in enumerate(token_lists) for _ in toks]
    cols = [t for toks in token_lists for t in toks]
    if cols:
        mask[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True
    return mask


def presence_for_positions(
    base: torch.Tensor, draft_tokens: torch.Tensor, num_proposed: torch.Tensor
) -> torch.Tensor:
    """[B, K+1, V] bool: position i sees `base` plus draft tokens 0..i-1 (only those < num_proposed).

    The draft penalised token i using the tokens it had proposed before it, so the target must
    use exactly the same set at that position; otherwise p and q would be different functions
    and the acceptance test would not be exact.
    """
    B, K = draft_tokens.shape
    out = base.unsqueeze(1).repeat(1, K + 1, 1)
    if K == 0:
        return out
    dev = base.device
    j = torch.arange(K, device=dev)  # index of the draft token
    i = torch.arange(K + 1, device=dev)  # position that sees it
    # triple (b, i, j) is set when token j is a real draft token and precedes position i.
    valid = (j[None, None, :] < i[None, :, None]) & (j[None, None, :] < num_proposed.to(dev)[:, None, None])
    b_idx, i_idx, j_idx = valid.nonzero(as_tuple=True)
    out[b_idx, i_idx, draft_tokens[b_idx, j_idx]] = True
    return out


def apply_repetition_penalty(
    logits: torch.Tensor, presence: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF RepetitionPenaltyLogitsProcessor: for present tokens, positive logits are divided by the
    penalty and the others multiplied by it (so a penalty > 1 always makes them less likely)."""
    pen = penalty.to(logits.dtype)[:, None]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(presence, penalised, logits)


def probs_from_logits(
    logits: torch.Tensor, params: BatchSamplingParams, presence: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, V] float32 probabilities after penalty, temperature, top-k, top-p (HF order).

    logits: [N, V]; presence: [N, V] bool or None (no repetition penalty). Greedy rows
    (temperature 0) become an exact one-hot at the argmax of the penalised logits, so greedy
    decoding is just a degenerate distribution to the rest of the pipeline. Transforms no row
    uses are skipped (params.any_*).
    """
    logits = logits.float()
    V = logits.shape[1]
    if presence is not None:
        logits = apply_repetition_penalty(logits, presence, params.repetition_penalty.to(logits.device))
    one_hot = greedy = None
    if params.any_greedy:
        greedy = params.greedy.to(logits.device)
        one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if params.all_greedy:
            return one_hot

    temp = params.temperature.to(logits.device)
    if greedy is not None:
        temp = torch.where(greedy, torch.ones_like(temp), temp)
    temp = temp.clamp(MIN_TEMPERATURE, LARGEST_LOGIT)  # 1e300 as float32 would be inf
    scaled = (logits.clamp(-LARGEST_LOGIT, LARGEST_LOGIT) / temp[:, None]).clamp(-LARGEST_LOGIT, LARGEST_LOGIT)
    if params.any_top_p or params.any_top_k:
        k = params.top_k.to(logits.device)
        k = torch.where(k <= 0, torch.full_like(k, V), k.clamp(max=V))
    if params.any_top_p:
        scaled = _top_k_top_p(scaled, k, params.top_p.to(logits.device))
    elif params.any_top_k:
        # top-k: like HF, drop what is strictly below the k-th largest value (ties with it survive).
        kth = torch.topk(scaled, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return probs if one_hot is None else torch.where(greedy[:, None], one_hot, probs)


def _top_k_top_p(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Both filters on one descending sort. top-p keeps the smallest prefix whose mass reaches
    top_p: a token survives when the mass strictly ahead of it is still below top_p (the first
    always survives)."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_ahead = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = (mass_ahead >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)


def top_entries(probs: torch.Tensor, max_entries: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `max_entries` largest probabilities, renormalised, as (ids, probs) [N, n].

    The draft samples from exactly this sparse q and sends it as is: the q the target divides by
    is the one the token was drawn from, so the method stays exact (only acceptance can drop),
    and the wire carries n entries per position instead of the vocabulary. None keeps every entry.
    """
    probs = probs.float()
    if max_entries is None or max_entries >= probs.shape[-1]:
        ids = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
        return ids, probs / probs.sum(dim=-1, keepdim=True)
    vals, ids = torch.topk(probs, k=max(1, max_entries), dim=-1)
    return ids, vals / vals.sum(dim=-1, keepdim=True)
