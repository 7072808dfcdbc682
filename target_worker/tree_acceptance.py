"""The acceptance walk of one request's token tree (specdec.sampling.tree) on the target's logits.

The tree's nodes were scored in the verify pass with a tree attention mask (model.batch.TreeNodes):
row 0 of the logits is the root's (the last committed token), row 1 + i node i's. A node at depth
d is the token at position n + d - 1 (n committed tokens): its accept test draws the ACCEPT uniform
there, with the node's rank among its depth's nodes; the walk's final sample draws the TARGET
uniform at the position it fills, rank 0. A chain (every rank 0) draws exactly the chain's.
"""
from __future__ import annotations

import torch

from specdec.params import SamplingParams
from specdec.round_types import VerifyTask
from specdec.sampling import ACCEPT, TARGET, BatchSamplingParams, presence_mask, probs_from_logits, uniforms
from specdec.sampling.tree import depths_and_ranks, node_paths, tree_verify


def accept_tree(task: VerifyTask, committed: list[int], seed: int, logits: torch.Tensor,
                vocab_size: int) -> tuple[list[int], int]:
    """-> (the accepted nodes from the root down, the next token). logits: [1 + N, V]."""
    params: SamplingParams = task.params
    tokens, parents = task.draft_tokens, task.parents
    if params.argmax_only:  # the logits' argmax is p's
        return tree_verify(logits[0], logits[1:], None, tokens, parents, True, None, None)
    presence = None
    if params.repetition_penalty != 1.0:  # each row's context: the committed tokens, then its path
        paths = node_paths(parents, 0)
        contexts = [committed] + [committed + [tokens[n] for n in path] for path in paths]
        presence = presence_mask(contexts, vocab_size, logits.device)
    p = probs_from_logits(logits, BatchSamplingParams.from_params([params] * len(logits), logits.device), presence)
    if params.greedy:  # (a repetition penalty: the penalised argmax, as one-hot rows)
        return tree_verify(p[0], p[1:], None, tokens, parents, True, None, None)
    q = task.q.to_dense(vocab_size).to(logits.device)
    depths, ranks = depths_and_ranks(parents)
    start = len(committed)
    u_accept = uniforms([seed] * len(tokens), [start + d - 1 for d in depths], ACCEPT, logits.device, ranks)
    u_next = uniforms([seed], [[start + d for d in range(max(depths) + 1)]], TARGET, logits.device)[0]
    return tree_verify(p[0], p[1:], q, tokens, parents, False, u_accept, u_next)
