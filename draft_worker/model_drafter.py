"""Drafting with a small model that keeps its own paged KV cache.

Each round the draft learns the tokens the target committed since last time. Its cache holds
what it fed itself last round (the committed prefix plus its own guesses t1..t_{k-1}, or, after
a pre-draft, the assumed tokens and the guesses after them, or after a tree, its nodes); it keeps
the longest prefix that still agrees with the context, drops the rest, and feeds the remainder in
the first of its k batched steps. A task with branches > 1 is drafted as a tree (draft_tree).
Where the model runs in the C kernels and every pick is one they make (argmax, or temperature and
top-k), the k steps are one call (ModelRunner.draft_chain): the same bits, no Python in between;
a tree whose other branches are leaves too (its first branch is a chain; the root's other
children come from the first pass's top tokens or q).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draft_worker.draft_tree import DraftedTree, TreeGrowth, distinct_children, greedy_children
from draft_worker.drafter import Drafter
from specdec.kv_cache import PagedKVCache
from specdec.model.cpu_kernels import row_argmax
from specdec.model.runner import ModelRunner
from specdec.params import SamplingParams
from specdec.round_types import DraftInfo, DraftProposal, DraftTask, SparseDist
from specdec.sampling import (
    DRAFT,
    BatchSamplingParams,
    apply_repetition_penalty,
    presence_mask,
    probs_from_logits,
    sample_from_probs,
    stream_key,
    uniforms,
)
from specdec.sampling.transforms import LARGEST_LOGIT, MIN_TEMPERATURE
from specdec.sampling.tree import tree_size


@dataclass
class _DraftSequence:
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # committed tokens, as told by the coordinator
    fed: list[int] = field(default_factory=list)  # tokens whose K/V sit in the draft's cache
    tree: DraftedTree | None = None  # the last round's tree nodes, cached after `fed`


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share. A round changes only the last few tokens of a
    request, so the long shared part is compared by list equality (in C), not token by token."""
    n = min(len(a), len(b))
    head = max(0, n - 64)
    checked = head if a[:head] == b[:head] else 0
    for i in range(checked, n):
        if a[i] != b[i]:
            return i
    return n


def choose_tokens(logits: torch.Tensor, params: list[SamplingParams], contexts: list[list[int]],
                  max_q_entries: int | None, ranks: list[int] | None = None, kernels=None
                  ) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Pick one token per row; return (tokens [N], {row: (q ids [n], q probs [n])} of sampled rows).

    logits: [N, V]; contexts[r]: row r's tokens so far, so len(contexts[r]) is the position of the
    token it picks; ranks[r] its rank in a token tree (None: all 0); kernels: the model's C kernels
    (greedy rows' argmax, temperature-only rows' draws; None: torch's ops). A sampled row's q is its
    top max_q_entries probabilities, renormalised, and the token is drawn from exactly that q with
    the request's DRAFT uniform at that position (and rank): the q sent to the target is the
    distribution the token came from (any q would keep the method exact; a close one keeps
    acceptance high).
    """
    needs_presence = any(p.repetition_penalty != 1.0 for p in params)
    if all(p.argmax_only for p in params):
        return row_argmax(logits, kernels), {}
    rows = [i for i, p in enumerate(params) if not p.greedy]
    u = uniforms([params[i].seed for i in rows], [len(contexts[i]) for i in rows], DRAFT, logits.device,
                 None if ranks is None else [ranks[i] for i in rows])
    most = min(max_q_entries or logits.shape[-1], logits.shape[-1])
    widths = [q_width(params[i], most) for i in rows]
    every_row = len(rows) == len(params)
    if all(map(reads_top_logits_only, params)):
        temperatures = [params[i].temperature for i in rows]
        picks, ids, q = (_drawn_in_c(logits, temperatures, rows, widths, u, kernels)
                         or _drawn_from_top_logits(logits, temperatures, rows, widths, u))
        tokens = picks if every_row else row_argmax(logits, kernels)  # (the greedy rows' picks)
    else:
        presence = presence_mask(contexts, logits.shape[-1], logits.device) if needs_presence else None
        probs = probs_from_logits(logits, BatchSamplingParams.from_params(params, logits.device), presence)
        tokens = probs.argmax(dim=-1)  # greedy rows are one-hot
        if not rows:
            return tokens, {}
        # Largest first: beyond a top-k row's width every entry is 0 (the top-k filter zeroed it).
        top, ids = torch.topk(probs[rows].float(), max(widths), dim=-1)  # [S, n]
        q = top / top.sum(dim=-1, keepdim=True)
        picks = ids.gather(1, sample_from_probs(q, u)[:, None]).squeeze(1)
        tokens = picks if every_row else tokens
    if not every_row:
        tokens[rows] = picks
    # A row keeps its own width, whatever it shared the step with: a request's rows must stack.
    return tokens, {row: (ids[i, :widths[i]], q[i, :widths[i]]) for i, row in enumerate(rows)}


def penalised(logits: torch.Tensor, params: SamplingParams, context: list[int]) -> torch.Tensor:
    """A greedy row's scores [1, V] as its picks read them: the logits, after the repetition
    penalty over `context` where the request has one (its argmax is then the penalised one)."""
    if params.repetition_penalty == 1.0:
        return logits
    presence = presence_mask([context], logits.shape[-1], logits.device)
    penalty = torch.tensor([params.repetition_penalty], device=logits.device)
    return apply_repetition_penalty(logits.float(), presence, penalty)


def q_width(params: SamplingParams, most: int) -> int:
    """A sampled row's own q size: its top-k, at most `most` (the vocabulary, or max_q_entries)."""
    return min(most, params.top_k or most)


def reads_top_logits_only(params: SamplingParams) -> bool:
    """Whether a row's pick reads only the raw logits' top entries (the argmax, or temperature and
    top-k): no repetition penalty, and no top-p for a sampled row. The C kernels make such picks."""
    return params.repetition_penalty == 1.0 and (params.greedy or params.top_p == 1.0)


def _drawn_from_top_logits(logits: torch.Tensor, temperatures: list[float], rows: list[int], widths: list[int],
                           u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature (and top-k) only, in torch: dividing by T keeps the order of the logits, so the
    top entries of softmax(logits / T) are the softmax of the top logits / T: one top-k over the
    vocabulary, no full-vocabulary division or softmax. -> (picks [S], ids [S, n], q [S, n])."""
    top, ids = torch.topk((logits if len(rows) == len(logits) else logits[rows]).float(), max(widths), dim=-1)
    temperature = torch.tensor(temperatures, device=logits.device)[:, None]
    scaled = (top / temperature.clamp(min=MIN_TEMPERATURE, max=LARGEST_LOGIT)).clamp(-LARGEST_LOGIT, LARGEST_LOGIT)
    if min(widths) < max(widths):
        beyond = (torch.arange(max(widths), device=logits.device)[None, :]
                  >= torch.tensor(widths, device=logits.device)[:, None])
        scaled = scaled.masked_fill(beyond, float("-inf"))
    q = torch.softmax(scaled, dim=-1)
    return ids.gather(1, sample_from_probs(q, u)[:, None]).squeeze(1), ids, q


def _drawn_in_c(logits: torch.Tensor, temperatures: list[float], rows: list[int], widths: list[int],
                u: torch.Tensor, kernels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """_drawn_from_top_logits in the model's C kernels, a row at a time (one call where torch made
    a dozen, each slow between the draft's passes); None without them, off the CPU or for a row
    holding a NaN."""
    if kernels is None or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    ids = torch.zeros(len(rows), max(widths), dtype=torch.int64)  # host: logits are on the CPU
    q = torch.zeros(len(rows), max(widths))  # host: as ids
    drawn = kernels.sample_top(logits.contiguous(), rows, widths, temperatures, u.tolist(), ids, q)
    if min(drawn) < 0:
        return None
    chosen = ids.numpy()
    return torch.tensor([chosen[i, at] for i, at in enumerate(drawn)], dtype=torch.int64), ids, q  # host: as ids


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

    def _sync(self, task: DraftTask) -> tuple[list[int], list[int]]:
        """Record the newly committed tokens; roll the cache back; return (the context to draft
        from: committed + assumed tokens, what of it must be fed)."""
        seq = self._seqs.get(task.req_id)
        if seq is None:
            seq = _DraftSequence(params=task.params)
            self._seqs[task.req_id] = seq
            self.runner.cache.add_sequence(task.req_id)
        seq.tokens.extend(task.new_tokens)
        # Assumed tokens are context for this task only: `tokens` stays the committed ones.
        context = seq.tokens + task.assumed_tokens
        if seq.tree is not None:  # keep the path of last round's tree that the context follows
            start = len(seq.fed)
            path = seq.tree.accepted_path(context[start:]) if context[:start] == seq.fed else []
            self.runner.cache.keep_path(task.req_id, start, [start + n for n in path])
            seq.fed += [seq.tree.tokens[n] for n in path]
            seq.tree = None
        if not context:
            raise ValueError(f"request {task.req_id}: the draft needs at least one token of context")
        if task.num_speculative_tokens == 0:
            return context, []
        if len(context) + task.num_speculative_tokens > self.runner.max_seq_len:
            raise ValueError(f"request {task.req_id}: {len(context)} tokens + {task.num_speculative_tokens} "
                             f"speculative tokens exceed the draft's context of {self.runner.max_seq_len}")
        # Keep at least one token to feed: its logits give the first proposal.
        keep = min(common_prefix_length(seq.fed, context), len(context) - 1)
        self.runner.cache.truncate_to(task.req_id, keep)
        seq.fed = context[:keep]
        return context, context[keep:]

    def _branches(self, task: DraftTask, context: list[int]) -> int:
        """How many children the root of this task's tree gets (1: a chain): a tree needs room
        for all its nodes."""
        nodes = tree_size(task.num_speculative_tokens, task.branches, task.side_depth)
        fits = len(context) + nodes <= self.runner.max_seq_len
        return task.branches if task.branches > 1 and task.num_speculative_tokens > 0 and fits else 1

    def _chain_in_c(self, step: int, wanted: dict[str, int], feed: dict[str, list[int]], trees: dict[str, TreeGrowth],
                    drafted: dict[str, list[int]], q_rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> bool:
        """The round's chains from `step` on in one call (ModelRunner.draft_chain: the same tokens
        and q as the steps below, without Python between the passes), where every pick is one the
        C kernels make as choose_tokens would (the argmax, or temperature and top-k alone). A tree
        whose other branches are leaves is its first branch, a chain, and the root's other children
        (from the first pass's top tokens or q)."""
        ids = [r for r in wanted if wanted[r] > step]
        params = [self._seqs[r].params for r in ids]
        if not all(map(reads_top_logits_only, params)):
            return False
        most = min(self.max_q_entries or self.runner.vocab_size, self.runner.vocab_size)
        # (width 0: the argmax, -b: and the top b; a temperature too small for float32 still draws)
        widths = [(-trees[r].branches if r in trees and step == 0 else 0) if p.greedy else q_width(p, most)
                  for r, p in zip(ids, params)]
        feeds = [[trees[r].tokens[0][-1]] if r in trees and step > 0 else feed[r] for r in ids]
        chain = self.runner.draft_chain(ids, feeds, [wanted[r] - step for r in ids], [p.temperature for p in params],
                                        [0 if p.greedy else stream_key(p.seed, DRAFT) for p in params], widths)
        if chain is None:
            return False
        picks, top_ids, top_q = chain
        for i, (req_id, p, width) in enumerate(zip(ids, params, widths)):
            rows = [] if p.greedy else [(top_ids[i, s, :width], top_q[i, s, :width]) for s in range(len(picks[i]))]
            tree, seq = trees.get(req_id), self._seqs[req_id]
            if tree is None:
                seq.fed += [*feed[req_id], *picks[i][:-1]]  # (the last pick is not fed)
                drafted[req_id] += picks[i]
                q_rows[req_id] += rows
                continue
            if step == 0:  # (the first pick is the first child, fed as the chain's)
                seq.fed += feed[req_id]  # (now the context: its length is the children's position)
                first, kernels = picks[i][0], self.runner.model.kernels
                if p.greedy:
                    tree.add_root(*greedy_children(first, top_ids[i, 0, :tree.branches].tolist(), tree.branches))
                else:
                    tree.add_root(*distinct_children(first, rows[0], tree.branches, p.seed, len(seq.fed), kernels))
                picks[i], rows = picks[i][1:], rows[1:]
            tree.add_chain(picks[i], rows)
        return True

    def propose(self, tasks: list[DraftTask]) -> list[DraftProposal]:
        synced = {t.req_id: self._sync(t) for t in tasks}
        context = {req_id: c for req_id, (c, _) in synced.items()}
        feed = {req_id: f for req_id, (_, f) in synced.items()}
        wanted = {t.req_id: t.num_speculative_tokens for t in tasks}
        trees = {t.req_id: TreeGrowth(b, len(context[t.req_id]), t.num_speculative_tokens, t.side_depth)
                 for t in tasks if (b := self._branches(t, context[t.req_id])) > 1}
        drafted: dict[str, list[int]] = {t.req_id: [] for t in tasks}
        q_rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {t.req_id: [] for t in tasks}
        for step in range(max(wanted.values(), default=0)):
            # In one C call from the first pass, or from the second after a catch-up too long for one
            in_c = step <= 1 and all(tree.grows_as_chain() for tree in trees.values())
            if in_c and self._chain_in_c(step, wanted, feed, trees, drafted, q_rows):
                break
            ids = [r for r in wanted if wanted[r] > step]
            seqs = [self._seqs[r] for r in ids]
            shapes = [None] * len(ids)
            for i, req_id in enumerate(ids):
                if req_id in trees and step > 0:
                    feed[req_id], shapes[i] = trees[req_id].leaves(self.runner.cache.length(req_id))
            logits = self.runner.run(ids, [feed[r] for r in ids],
                                     [len(feed[r]) if r in trees and step > 0 else 1 for r in ids],
                                     shapes if any(shapes) else None)
            rows, row_params, row_contexts, row_ranks = [], [], [], []
            for req_id, seq, rows_of in zip(ids, seqs, logits):
                tree = trees.get(req_id)
                if tree is not None and step == 0 and seq.params.greedy:  # the root's children: its top tokens
                    scores = penalised(rows_of[:1], seq.params, context[req_id])
                    first = int(row_argmax(scores, self.runner.model.kernels)[0])
                    top = torch.topk(scores[0], tree.branches).indices.tolist()
                    tree.add_root(*greedy_children(first, top, tree.branches))
                elif tree is None or step == 0:  # a chain's token, or a sampled tree's first child
                    rows.append(rows_of)
                    row_params.append(seq.params)
                    row_contexts.append(context[req_id] + drafted[req_id])
                    row_ranks.append(0)
                else:  # each growing branch's next token, from its own row
                    rows.append(rows_of)
                    row_params += [seq.params] * len(tree.growing)
                    row_contexts += [context[req_id] + tree.tokens[j] for j in tree.growing]
                    row_ranks += range(len(tree.growing))  # (its rank among the nodes of its depth)
            if rows:
                tokens, q = choose_tokens(torch.cat(rows), row_params, row_contexts, self.max_q_entries, row_ranks,
                                          self.runner.model.kernels)
                tokens = tokens.tolist()
            row = 0
            for req_id, seq in zip(ids, seqs):
                tree = trees.get(req_id)
                if tree is None or step == 0:  # (a tree's nodes are cached as tree.cached)
                    seq.fed.extend(feed[req_id])
                if tree is None:
                    drafted[req_id].append(tokens[row])
                    feed[req_id] = [tokens[row]]
                    if row in q:
                        q_rows[req_id].append(q[row])
                    row += 1
                elif step == 0 and not seq.params.greedy:
                    tree.add_root(*distinct_children(tokens[row], q[row], tree.branches, seq.params.seed,
                                                     len(context[req_id]), self.runner.model.kernels))
                    row += 1
                elif step > 0:
                    chosen = range(row, row + len(tree.growing))
                    tree.add([tokens[r] for r in chosen], [q.get(r) for r in chosen])
                    row += len(tree.growing)
        proposals = []
        for t in tasks:
            tokens, parents, rows = drafted[t.req_id], [], q_rows[t.req_id]
            if t.req_id in trees:
                tokens, parents, rows = trees[t.req_id].proposal()
                self._seqs[t.req_id].tree = trees[t.req_id].cached
            q = None
            if rows:
                q = SparseDist(token_ids=torch.stack([r[0] for r in rows]), probs=torch.stack([r[1] for r in rows]))
            proposals.append(DraftProposal(req_id=t.req_id, tokens=tokens, q=q, parents=parents,
                                           draft_forward_passes=t.num_speculative_tokens))
        return proposals
