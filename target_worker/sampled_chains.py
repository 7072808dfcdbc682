"""Temperature-only requests' chains verified in the model's C kernels, a request at a time.

A request sampled with a temperature and nothing else (no top-k, top-p or repetition penalty) on a
CPU model with the kernels has its accept tests, residual and draw made by one C call
(CpuKernels.verify_sampled_chains) instead of the batched torch ops of speculative_verify: the same
rule and uniforms, p computed as the transforms compute it (equal to float32 rounding). Which path a
request takes depends on its own parameters only, never on what shares its batch, so a seeded
request draws the same tokens however it is batched. A row holding a NaN is left to torch's path.
"""
from __future__ import annotations

import torch

from specdec.params import SamplingParams
from specdec.round_types import VerifyTask
from specdec.sampling import ACCEPT, TARGET, uniforms


def drawn_in_c(params: SamplingParams, logits: torch.Tensor, kernels) -> bool:
    """Whether a request's verdicts are made in C: temperature only, float32 logits on the CPU."""
    return (kernels is not None and not params.greedy and params.top_k == 0 and params.top_p == 1.0
            and params.repetition_penalty == 1.0 and logits.device.type == "cpu" and logits.dtype == torch.float32)


def verdicts_in_c(tasks: list[VerifyTask], committed: list[int], seeds: list[int], logits: list[torch.Tensor],
                  kernels) -> list[tuple[int, int] | None]:
    """(accepted count, next token) of each task, or None where torch's path must take it (a NaN).

    committed[i]: task i's committed token count (the position of its first draft token);
    logits[i]: [K_i + 1, V], the target's rows at its draft positions and the one after."""
    k_max = max(len(t.draft_tokens) for t in tasks)
    positions = [[n + i for i in range(k_max + 1)] for n in committed]
    u_target = uniforms(seeds, positions, TARGET)
    # (nothing proposed: no accept tests, no uniforms for them)
    u_accept = uniforms(seeds, [row[:k_max] for row in positions], ACCEPT) if k_max else u_target[:, :0]
    q_ids = [t.q.token_ids.long().contiguous() if t.draft_tokens else _NO_Q[0] for t in tasks]
    q_probs = [t.q.probs.float().contiguous() if t.draft_tokens else _NO_Q[1] for t in tasks]
    return kernels.verify_sampled_chains([rows.contiguous() for rows in logits], [t.params.temperature for t in tasks],
                                         [t.draft_tokens for t in tasks], q_ids, q_probs, u_accept, u_target)


_NO_Q = (torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1))  # host: a chain of no tokens has no q
