"""Temperature-only requests verified in C (target_worker.sampled_chains): the same verdicts as
speculative_verify, whose chi-square suites and negative controls pin the rule down, on chains
that are accepted whole, rejected early (the residual draw) and empty (plain decoding); a row with
a NaN and the other sampling parameters keep torch's path; the kernel refuses what it would misread."""
from __future__ import annotations

import pytest
import torch

from draft_worker.model_drafter import choose_tokens
from specdec.model.cpu_kernels import KernelArgumentError, load_cpu_kernels
from specdec.params import SamplingParams
from specdec.round_types import SparseDist, VerifyTask
from specdec.sampling import ACCEPT, TARGET, BatchSamplingParams, probs_from_logits, speculative_verify, uniforms
from target_worker.sampled_chains import drawn_in_c, verdicts_in_c

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler on this machine")
COMMITTED = 9  # the requests' committed tokens: their first draft token's position


def drafted_chain(target: torch.Tensor, noise: float, params: SamplingParams, gen) -> VerifyTask:
    """A chain drafted (as the draft worker does) from the target's logits [K + 1, V] plus noise."""
    k = target.shape[0] - 1
    if not k:
        return VerifyTask("r", [], [], None, params)
    draft_logits = target[:k] + noise * torch.randn(target[:k].shape, generator=gen)
    contexts = [[0] * (COMMITTED + i) for i in range(k)]
    tokens, q = choose_tokens(draft_logits, [params] * k, contexts, 64, kernels=kernels)
    sparse = SparseDist(token_ids=torch.stack([q[i][0] for i in range(k)]),
                        probs=torch.stack([q[i][1] for i in range(k)]))
    return VerifyTask("r", [], tokens.tolist(), sparse, params)


def torch_verdict(task: VerifyTask, target: torch.Tensor) -> tuple[int, int]:
    k, vocab = len(task.draft_tokens), target.shape[-1]
    p = probs_from_logits(target, BatchSamplingParams.from_params([task.params] * (k + 1), "cpu"))
    positions = [[COMMITTED + i for i in range(k + 1)]]
    if k:
        q_ids, q_probs = task.q.token_ids[None], task.q.probs[None]
    else:
        q_ids, q_probs = torch.zeros(1, 0, 1, dtype=torch.long), torch.zeros(1, 0, 1)
    accepted, nxt = speculative_verify(p.view(1, k + 1, vocab), q_ids, q_probs,
                                       torch.tensor(task.draft_tokens, dtype=torch.long).view(1, k),
                                       torch.tensor([k]), torch.tensor([False]),
                                       uniforms([task.params.seed], positions, ACCEPT)[:, :k],
                                       uniforms([task.params.seed], positions, TARGET))
    return int(accepted), int(nxt)


def test_verdicts_in_c_are_speculative_verifys_on_accepted_rejected_and_empty_chains():
    gen = torch.Generator().manual_seed(0)
    seen = {"whole": 0, "rejected": 0, "empty": 0}
    for trial in range(300):
        vocab, k = [4096, 50, 1000][trial % 3], trial % 5
        params = SamplingParams(temperature=[0.8, 1.0, 0.3][trial % 3], seed=trial)
        target = torch.randn(k + 1, vocab, generator=gen) * 2
        task = drafted_chain(target, [0.3, 1.0][trial % 2], params, gen)
        (accepted, nxt), = verdicts_in_c([task], [COMMITTED], [trial], [target], kernels)
        assert (accepted, nxt) == torch_verdict(task, target)
        seen["empty" if not k else "whole" if accepted == k else "rejected"] += 1
    assert min(seen.values()) >= 30, seen  # every branch of the walk, many times


def test_a_batch_gives_each_request_its_own_verdict():
    gen = torch.Generator().manual_seed(1)
    targets = [torch.randn(k + 1, 300, generator=gen) * 2 for k in (3, 0, 2)]
    tasks = [drafted_chain(t, 0.5, SamplingParams(temperature=0.9, seed=40 + i), gen) for i, t in enumerate(targets)]
    together = verdicts_in_c(tasks, [COMMITTED] * 3, [40, 41, 42], targets, kernels)
    alone = [verdicts_in_c([task], [COMMITTED], [40 + i], [t], kernels)[0]
             for i, (task, t) in enumerate(zip(tasks, targets))]
    assert together == alone == [torch_verdict(task, t) for task, t in zip(tasks, targets)]


def test_a_nan_row_and_other_sampling_parameters_keep_torchs_path():
    gen = torch.Generator().manual_seed(2)
    target = torch.randn(3, 200, generator=gen)
    task = drafted_chain(target, 0.5, SamplingParams(temperature=1.0, seed=5), gen)
    target[0, 17] = float("nan")  # (the first row: every walk reads it)
    assert verdicts_in_c([task], [COMMITTED], [5], [target], kernels) == [None]
    logits = torch.zeros(2, 10)
    assert drawn_in_c(SamplingParams(temperature=0.7), logits, kernels)
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=5),
                   SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.7, repetition_penalty=1.2)):
        assert not drawn_in_c(params, logits, kernels)
    assert not drawn_in_c(SamplingParams(temperature=0.7), logits.double(), kernels)
    assert not drawn_in_c(SamplingParams(temperature=0.7), logits, None)


def test_q_padding_outside_the_vocabulary_is_ignored_and_bad_shapes_refused():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    q_ids = torch.tensor([[4, -1, 99]])  # padding ids with probability 0: never indexed
    q_probs = torch.tensor([[1.0, 0.0, 0.0]])
    u_accept, u_target = torch.tensor([[0.5]], dtype=torch.float64), torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    (accepted, nxt), = kernels.verify_sampled_chains([logits], [1.0], [[4]], [q_ids], [q_probs], u_accept, u_target)
    assert accepted in (0, 1) and 0 <= nxt < 20 and (accepted == 1 or nxt != 4)  # a rejected 4 has no residual
    for draft, ids, x in (([20], q_ids, logits), ([4, 5], q_ids, logits), ([4], q_ids[0], logits),
                          ([4], q_ids, logits[:1])):
        with pytest.raises(KernelArgumentError, match="verify_sampled_chains"):
            kernels.verify_sampled_chains([x], [1.0], [draft], [ids], [q_probs], u_accept, u_target)
