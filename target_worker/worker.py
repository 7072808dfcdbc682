"""Verification of draft tokens against the target model, one batched K+1 pass per round.

The target's cache holds every committed token except the last one. A round feeds
[uncached committed tokens, t1..tk] (on the first round the whole prompt), scores all k+1
positions at once, accepts/rejects with the request's uniforms at those positions
(specdec.sampling.random), and truncates the cache back to the committed tokens minus the new
last one (whose K/V the next round computes). Proposals are checked first (proposal_check): one
that cannot be verified fails its own request only. A token tree (VerifyTask.parents) is scored in
the same pass, each node attending to its own path (model.batch.TreeNodes), walked by
tree_acceptance, and only its accepted path stays in the cache, moved into place (keep_path).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import TargetConfig
from specdec.model.batch import TreeNodes
from specdec.model.cpu_kernels import row_argmax
from specdec.model.runner import ModelRunner
from specdec.params import SamplingParams
from specdec.round_types import TargetInfo, VerifyOutcome, VerifyResult, VerifyTask
from specdec.sampling import (
    ACCEPT,
    TARGET,
    BatchSamplingParams,
    presence_for_positions,
    presence_mask,
    probs_from_logits,
    random_seed,
    sample_from_probs,
    speculative_verify,
    uniforms,
)
from specdec.sampling.tree import is_chain, leading_chain, node_paths
from target_worker.proposal_check import proposal_problems
from target_worker.sampled_chains import drawn_in_c, verdicts_in_c
from target_worker.tree_acceptance import accept_tree


@dataclass
class _TargetSequence:
    params: SamplingParams
    seed: int  # the request's, or a fresh one for a request sent without (then not reproducible)
    tokens: list[int]  # committed: prompt + generated


def greedy_accept(target_argmax: torch.Tensor, drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """Greedy verification without building distributions: accept while the target's argmax
    equals the draft token; the next token is the argmax at the first mismatch (or the bonus).
    target_argmax: [B, K_max + 1]. Same result as speculative_verify on one-hot p, much cheaper."""
    rows = target_argmax.tolist()
    accepted, next_tokens = [], []
    for row, draft in zip(rows, drafts):
        a = 0
        while a < len(draft) and row[a] == draft[a]:
            a += 1
        accepted.append(a)
        next_tokens.append(row[a])
    return accepted, next_tokens


def padded_proposals(tasks: list[VerifyTask], positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every task's sparse q in one [B, positions, n] pair (ids, probs); padding has probability 0
    (greedy tasks, and positions beyond a task's draft, are all padding)."""
    width = max([t.q.token_ids.shape[1] for t in tasks if t.q is not None and t.draft_tokens], default=1)
    ids = torch.zeros(len(tasks), positions, width, dtype=torch.long, device=device)
    probs = torch.zeros(len(tasks), positions, width, device=device)
    for row, task in enumerate(tasks):
        if task.q is not None and task.draft_tokens:
            k, n = task.q.token_ids.shape
            ids[row, :k, :n] = task.q.token_ids.to(device, non_blocking=True)
            probs[row, :k, :n] = task.q.probs.to(device, non_blocking=True)
    return ids, probs


def padded_logits(logits: list[torch.Tensor], positions: int) -> torch.Tensor:
    """Every sequence's logits rows ([n_i, V] each) in one [B, positions, V]; missing rows are 0."""
    if all(rows.shape[0] == positions for rows in logits):  # the usual case: one copy, no padding
        return torch.cat(logits).view(len(logits), positions, -1)
    padded = logits[0].new_zeros(len(logits), positions, logits[0].shape[-1])
    for row, rows in enumerate(logits):
        padded[row, :rows.shape[0]] = rows
    return padded


def pad_rows(rows: list[list[int]], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long,
                        device=device).reshape(len(rows), width)


def _is_tree(task: VerifyTask) -> bool:
    return bool(task.parents) and not is_chain(task.parents)


class TargetWorker:
    def __init__(self, runner: ModelRunner, model_name: str = ""):
        self.runner = runner
        self.model_name = model_name
        self._seqs: dict[str, _TargetSequence] = {}

    @classmethod
    def from_config(cls, config: TargetConfig) -> TargetWorker:
        return cls(ModelRunner.load(config, config.model), model_name=config.model)

    @property
    def cache(self):
        return self.runner.cache

    def info(self) -> TargetInfo:
        c = self.runner.model.config
        return TargetInfo(vocab_size=c.vocab_size, max_seq_len=c.max_position_embeddings,
                          eos_token_ids=list(c.eos_token_ids), kv_block_size=self.cache.block_size,
                          kv_blocks_total=self.cache.allocator.num_blocks, model_name=self.model_name,
                          num_parameters=self.runner.model.num_parameters)

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if self._seqs.pop(req_id, None) is not None:
                self.cache.free_sequence(req_id)

    def _check(self, task: VerifyTask) -> None:
        """Reject a malformed task before any state changes, so one bad task cannot corrupt a round."""
        seq = self._seqs.get(task.req_id)
        if seq is None and not task.new_tokens:
            raise ValueError(f"request {task.req_id}: first round must carry the prompt")
        if seq is not None and task.new_tokens:
            raise ValueError(f"request {task.req_id}: only the first round may carry new tokens")
        vocab = self.runner.vocab_size
        bad = [t for t in task.new_tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {task.req_id}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        length = (len(seq.tokens) if seq else 0) + len(task.new_tokens)
        if length + len(task.draft_tokens) + 1 > self.runner.max_seq_len:
            raise ValueError(f"request {task.req_id}: {length} tokens + {len(task.draft_tokens)} draft "
                             f"tokens exceed the target's context of {self.runner.max_seq_len}")

    def _admit(self, task: VerifyTask) -> _TargetSequence:
        seq = self._seqs.get(task.req_id)
        if seq is None:
            seed = random_seed() if task.params.seed is None else task.params.seed
            seq = _TargetSequence(params=task.params, seed=seed, tokens=[])
            self._seqs[task.req_id] = seq
            self.cache.add_sequence(task.req_id)
        seq.tokens.extend(task.new_tokens)
        return seq

    def verify(self, tasks: list[VerifyTask], finished: list[str]) -> VerifyResult:
        self.release(finished)
        if not tasks:
            return self._result([])
        for task in tasks:
            self._check(task)
        refused = proposal_problems(tasks, self.runner.vocab_size)
        if refused:
            verified = self.verify([t for t in tasks if t.req_id not in refused], [])
            by_id = {o.req_id: o for o in verified.outcomes}
            by_id.update({r: VerifyOutcome(req_id=r, num_accepted=0, tokens=[], error=why)
                          for r, why in refused.items()})
            return self._result([by_id[t.req_id] for t in tasks])
        seqs = [self._admit(t) for t in tasks]
        ids = [t.req_id for t in tasks]
        cached = [self.cache.length(r) for r in ids]
        feeds = [s.tokens[c:] + t.draft_tokens for s, c, t in zip(seqs, cached, tasks)]
        num_proposed = [len(t.draft_tokens) for t in tasks]
        # A tree's nodes sit in the cache from the first draft token's index on: len(seq.tokens). Its
        # leading chain is fed as causal tokens: only the other nodes take attention rows of their own.
        trees = [TreeNodes(len(s.tokens), node_paths(t.parents, len(s.tokens))[leading_chain(t.parents):])
                 if _is_tree(t) else None for s, t in zip(seqs, tasks)]
        logits = self.runner.run(ids, feeds, [k + 1 for k in num_proposed], trees if any(trees) else None)
        chains = [i for i, tree in enumerate(trees) if tree is None]
        paths: list[list[int]] = [[] for _ in tasks]
        next_tokens = [0] * len(tasks)
        if chains:
            accepted, chain_next = self._accept([tasks[i] for i in chains], [seqs[i] for i in chains],
                                                [logits[i] for i in chains], [num_proposed[i] for i in chains])
            for i, a, nxt in zip(chains, accepted, chain_next):
                paths[i], next_tokens[i] = list(range(a)), nxt
        for i, tree in enumerate(trees):
            if tree is not None:
                paths[i], next_tokens[i] = accept_tree(tasks[i], seqs[i].tokens, seqs[i].seed, logits[i],
                                                       self.runner.vocab_size, self.runner.model.kernels)
        outcomes = []
        for task, seq, path, nxt in zip(tasks, seqs, paths, next_tokens):
            committed = [task.draft_tokens[n] for n in path] + [nxt]
            # Keep K/V of the committed tokens fed so far and of the accepted draft tokens.
            start = len(seq.tokens)
            self.cache.keep_path(task.req_id, start, [start + n for n in path])
            seq.tokens.extend(committed)
            outcomes.append(VerifyOutcome(req_id=task.req_id, num_accepted=len(path), tokens=committed))
        return self._result(outcomes)

    def _result(self, outcomes: list[VerifyOutcome]) -> VerifyResult:
        alloc = self.cache.allocator
        return VerifyResult(outcomes=outcomes, kv_blocks_used=alloc.num_used, kv_blocks_total=alloc.num_blocks)

    def _sample(self, seqs: list[_TargetSequence], logits: torch.Tensor) -> list[int]:
        """One token per sequence from its last logits [B, V]: argmax, or a draw with its TARGET
        uniform at the position (what speculative_verify does with nothing proposed)."""
        params = [s.params for s in seqs]
        if all(p.argmax_only for p in params):
            return row_argmax(logits, self.runner.model.kernels).tolist()
        presence = None
        if any(p.repetition_penalty != 1.0 for p in params):
            presence = presence_mask([s.tokens for s in seqs], logits.shape[-1], logits.device)
        probs = probs_from_logits(logits, BatchSamplingParams.from_params(params, logits.device), presence)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return probs.argmax(dim=-1).tolist()  # (greedy rows are one-hot)
        u = uniforms([seqs[i].seed for i in rows], [len(seqs[i].tokens) for i in rows], TARGET, probs.device)
        if len(rows) == len(seqs):  # (no argmax, no gathering and scattering of rows: ~60 us a step)
            return sample_from_probs(probs, u).tolist()
        tokens = probs.argmax(dim=-1)
        tokens[rows] = sample_from_probs(probs[rows], u)
        return tokens.tolist()

    def _accept(self, tasks: list[VerifyTask], seqs: list[_TargetSequence], logits: list[torch.Tensor],
                num_proposed: list[int]) -> tuple[list[int], list[int]]:
        """Accept/reject every sequence's draft; returns (num_accepted, next_token) lists: requests
        sampled with a temperature only in C (sampled_chains), the rest at once in torch's ops."""
        kernels = self.runner.model.kernels
        in_c = [i for i, (s, rows) in enumerate(zip(seqs, logits)) if drawn_in_c(s.params, rows, kernels)]
        verdicts = {}
        if in_c:
            verdicts = dict(zip(in_c, verdicts_in_c([tasks[i] for i in in_c], [len(seqs[i].tokens) for i in in_c],
                                                    [seqs[i].seed for i in in_c], [logits[i] for i in in_c], kernels)))
        rest = [i for i in range(len(tasks)) if verdicts.get(i) is None]
        if rest:
            verdicts.update(zip(rest, zip(*self._accept_batched(
                [tasks[i] for i in rest], [seqs[i] for i in rest], [logits[i] for i in rest],
                [num_proposed[i] for i in rest]))))
        return [verdicts[i][0] for i in range(len(tasks))], [verdicts[i][1] for i in range(len(tasks))]

    def _accept_batched(self, tasks: list[VerifyTask], seqs: list[_TargetSequence], logits: list[torch.Tensor],
                        num_proposed: list[int]) -> tuple[list[int], list[int]]:
        """Accept/reject every sequence's draft at once in torch's ops."""
        params = [s.params for s in seqs]
        k_max = max(num_proposed)
        vocab = self.runner.vocab_size
        device = logits[0].device
        if k_max == 0:  # nothing proposed: plain decoding, the target's own sample at each position
            return [0] * len(tasks), self._sample(seqs, torch.cat(logits))
        padded = padded_logits(logits, k_max + 1)
        if all(p.argmax_only for p in params):
            return greedy_accept(row_argmax(padded, self.runner.model.kernels), [t.draft_tokens for t in tasks])
        draft = pad_rows([t.draft_tokens for t in tasks], k_max, device)
        proposed = torch.tensor(num_proposed, device=device)
        presence = None
        if any(x.repetition_penalty != 1.0 for x in params):
            base = presence_mask([s.tokens for s in seqs], vocab, device)
            presence = presence_for_positions(base, draft, proposed).flatten(0, 1)
        batch_params = BatchSamplingParams.from_params([x for x in params for _ in range(k_max + 1)], device)
        p = probs_from_logits(padded.flatten(0, 1), batch_params, presence).view(len(seqs), k_max + 1, vocab)
        q_ids, q_probs = padded_proposals(tasks, k_max, device)
        # The uniforms of a draft position are a function of the request's seed and the absolute
        # position only: what shares the batch, or how many tokens were proposed, changes nothing.
        seeds = [s.seed for s in seqs]
        positions = [[len(s.tokens) + i for i in range(k_max + 1)] for s in seqs]
        u_accept = uniforms(seeds, positions, ACCEPT, device)[:, :k_max]
        u_target = uniforms(seeds, positions, TARGET, device)
        greedy = torch.tensor([x.greedy for x in params], device=device)
        accepted, nxt = speculative_verify(p, q_ids, q_probs, draft, proposed, greedy, u_accept, u_target)
        return accepted.tolist(), nxt.tolist()
