"""Drafting with a small model that keeps its own paged KV cache.

Each round the draft learns the tokens the target committed since last time. Its cache holds
what it fed itself last round (the committed prefix plus its own guesses t1..t_{k-1}); it keeps
the longest prefix that still agrees with the committed tokens, drops the rest, and feeds the
remainder in the first of its k batched steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draft_worker.drafter import Drafter
from specdec.kv_cache import PagedKVCache
from specdec.model.runner import ModelRunner
from specdec.params import SamplingParams
from specdec.round_types import DraftInfo, DraftProposal, DraftTask, SparseDist
from specdec.sampling import (
    BatchSamplingParams,
    draw_uniforms,
    make_generator,
    presence_mask,
    probs_from_logits,
    sample_from_probs,
    sparsify_probs,
)


@dataclass
class _DraftSequence:
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # committed tokens, as told by the coordinator
    fed: list[int] = field(default_factory=list)  # tokens whose K/V sit in the draft's cache


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def choose_tokens(logits: torch.Tensor, params: list[SamplingParams], contexts: list[list[int]],
                  generators: list[torch.Generator], max_q_entries: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row; return (tokens [N], q [N, V] or None when every row is greedy).

    Sampled rows draw from q itself, after any sparsification, so the q sent to the target is
    exactly the distribution the token came from.
    """
    needs_presence = any(p.repetition_penalty != 1.0 for p in params)
    if all(p.greedy for p in params) and not needs_presence:
        return logits.argmax(dim=-1), None
    presence = presence_mask(contexts, logits.shape[-1], logits.device) if needs_presence else None
    q = probs_from_logits(logits, BatchSamplingParams.from_params(params, logits.device), presence)
    sampled = torch.tensor([not p.greedy for p in params])
    tokens = q.argmax(dim=-1)  # greedy rows are one-hot
    if sampled.any():
        rows = sampled.nonzero().flatten()
        q_sampled = q[rows]
        if max_q_entries is not None:
            q_sampled = sparsify_probs(q_sampled, max_q_entries)
            q[rows] = q_sampled
        u = draw_uniforms([generators[i] for i in rows.tolist()], 1, logits.device)[:, 0]
        tokens[rows] = sample_from_probs(q_sampled, u)
    return tokens, q


class ModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner, max_q_entries: int | None):
        self.runner = runner
        self.max_q_entries = max_q_entries  # None: send q dense
        self._seqs: dict[str, _DraftSequence] = {}

    @property
    def kv_cache(self) -> PagedKVCache:
        return self.runner.cache

    def info(self) -> DraftInfo:
        return DraftInfo(kind="model", vocab_size=self.runner.vocab_size, max_seq_len=self.runner.max_seq_len,
                         extra={"parameters": self.runner.model.num_parameters})

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if self._seqs.pop(req_id, None) is not None:
                self.runner.cache.free_sequence(req_id)

    def _sync(self, task: DraftTask) -> list[int]:
        """Record the newly committed tokens; roll the cache back; return what must be fed."""
        seq = self._seqs.get(task.req_id)
        if seq is None:
            seq = _DraftSequence(params=task.params, generator=make_generator(task.params.seed))
            self._seqs[task.req_id] = seq
            self.runner.cache.add_sequence(task.req_id)
        seq.tokens.extend(task.new_tokens)
        if not seq.tokens:
            raise ValueError(f"request {task.req_id}: the draft needs at least one token of context")
        if task.num_speculative_tokens == 0:
            return []
        if len(seq.tokens) + task.num_speculative_tokens > self.runner.max_seq_len:
            raise ValueError(f"request {task.req_id}: {len(seq.tokens)} tokens + {task.num_speculative_tokens} "
                             f"speculative tokens exceed the draft's context of {self.runner.max_seq_len}")
        # Keep at least one token to feed: its logits give the first proposal.
        keep = min(common_prefix_length(seq.fed, seq.tokens), len(seq.tokens) - 1)
        self.runner.cache.truncate_to(task.req_id, keep)
        seq.fed = seq.tokens[:keep]
        return seq.tokens[keep:]

    def propose(self, tasks: list[DraftTask]) -> list[DraftProposal]:
        feed = {t.req_id: self._sync(t) for t in tasks}
        wanted = {t.req_id: t.num_speculative_tokens for t in tasks}
        drafted: dict[str, list[int]] = {t.req_id: [] for t in tasks}
        q_rows: dict[str, list[torch.Tensor]] = {t.req_id: [] for t in tasks}
        for step in range(max(wanted.values(), default=0)):
            ids = [r for r in wanted if wanted[r] > step]
            seqs = [self._seqs[r] for r in ids]
            logits = self.runner.run(ids, [feed[r] for r in ids], [1] * len(ids))
            tokens, q = choose_tokens(torch.cat(logits), [s.params for s in seqs],
                                      [s.tokens + drafted[r] for r, s in zip(ids, seqs)],
                                      [s.generator for s in seqs], self.max_q_entries)
            for row, (req_id, seq) in enumerate(zip(ids, seqs)):
                seq.fed.extend(feed[req_id])
                token = int(tokens[row])
                drafted[req_id].append(token)
                feed[req_id] = [token]
                if not seq.params.greedy:
                    q_rows[req_id].append(q[row])
        proposals = []
        for t in tasks:
            rows = q_rows[t.req_id]
            q = SparseDist.from_dense(torch.stack(rows)) if rows else None
            proposals.append(DraftProposal(req_id=t.req_id, tokens=drafted[t.req_id], q=q,
                                           draft_forward_passes=len(drafted[t.req_id])))
        return proposals
