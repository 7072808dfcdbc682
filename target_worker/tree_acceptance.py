"""The acceptance walk of one request's token tree (specdec.sampling.tree) on the target's logits.

The tree's nodes were scored in the verify pass with a tree attention mask (model.batch.TreeNodes):
row 0 of the logits is the root's (the last committed token), row 1 + i node i's. A node at depth
d is the token at position n + d - 1 (n committed tokens): its accept test draws the ACCEPT uniform
there, with the node's rank among its depth's nodes; the walk's final sample draws the TARGET
uniform at the position it fills, rank 0. A chain (every rank 0) draws exactly the chain's. A
greedy request walks its rows' argmax; a temperature-only one's walk runs in the model's C kernels
(CpuKernels.verify_sampled_tree: the same rule and uniforms, p to float32 rounding), chosen by its
own parameters only, as its chains are (sampled_chains).
"""
from __future__ import annotations

import torch

from specdec.model.cpu_kernels import row_argmax
from specdec.params import SamplingParams
from specdec.round_types import VerifyTask
from specdec.sampling import ACCEPT, TARGET, BatchSamplingParams, presence_mask, probs_from_logits, uniforms
from specdec.sampling.tree import depths_and_ranks, greedy_tree_walk, node_paths, tree_verify
from target_worker.sampled_chains import drawn_in_c


def accept_tree(task: VerifyTask, committed: list[int], seed: int, logits: torch.Tensor, vocab_size: int,
                kernels=None) -> tuple[list[int], int]:
    """-> (the accepted nodes from the root down, the next token). logits: [1 + N, V]; kernels:
    the model's C kernels (greedy rows' argmax, a temperature-only request's walk; None: torch)."""
    params: SamplingParams = task.params
    tokens, parents = task.draft_tokens, task.parents
    if params.argmax_only:  # the logits' argmax is p's
        return greedy_tree_walk(row_argmax(logits, kernels).tolist(), tokens, parents)
    if not params.greedy:
        u_accept, u_next = _walk_uniforms(task, len(committed), seed, logits.device)
    if drawn_in_c(params, logits, kernels):  # (the same walk, rule and uniforms; None: a NaN)
        walked = kernels.verify_sampled_tree(logits.contiguous(), params.temperature, tokens, parents,
                                             task.q.token_ids.long().contiguous(), task.q.probs.float().contiguous(),
                                             u_accept, u_next)
        if walked is not None:
            return walked
    presence = None
    if params.repetition_penalty != 1.0:  # each row's context: the committed tokens, then its path
        paths = node_paths(parents, 0)
        contexts = [committed] + [committed + [tokens[n] for n in path] for path in paths]
        presence = presence_mask(contexts, vocab_size, logits.device)
    p = probs_from_logits(logits, BatchSamplingParams.from_params([params] * len(logits), logits.device), presence)
    if params.greedy:  # (a repetition penalty: the penalised argmax, as one-hot rows)
        return tree_verify(p[0], p[1:], None, tokens, parents, True, None, None)
    q = task.q.to_dense(vocab_size).to(logits.device)
    return tree_verify(p[0], p[1:], q, tokens, parents, False, u_accept, u_next)


def _walk_uniforms(task: VerifyTask, start: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(u_accept [N], u_next [depth + 1]) of a tree whose first node is at position `start`."""
    depths, ranks = depths_and_ranks(task.parents)
    u_accept = uniforms([seed] * len(task.draft_tokens), [start + d - 1 for d in depths], ACCEPT, device, ranks)
    return u_accept, uniforms([seed], [[start + d for d in range(max(depths) + 1)]], TARGET, device)[0]
