"""The coordinator's round loop: limits, stop conditions, per-request K, continuous batching and
seeded sampling, through LocalEngine and the Scheduler itself."""
from __future__ import annotations

import shutil

import pytest
import torch

from coordinator.rounds.request import Request
from draft_worker.worker import DraftWorker
from specdec import LocalEngine, SamplingParams
from specdec.config import DraftConfig
from specdec.round_types import DraftTask

from round_helpers import (
    DRAFTS,
    MAX_POS,
    PROMPTS,
    VOCAB,
    SpyTarget,
    _assert_caches_empty,
    _engine,
    _write_config,
)

# ---------------------------------------------------------------- limits

def test_plain_decoding_matches_hf_generate(hf_model, reference):
    for prompt in PROMPTS[:2]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert reference(prompt, 20) == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("draft", DRAFTS)
def test_max_new_tokens_exact_and_never_zero_tokens(target_dir, reference, draft):
    engine = _engine(target_dir, draft, num_speculative_tokens=4)
    spy = SpyTarget(engine.scheduler)
    engine.scheduler.target = spy
    for n in (1, 2, 5, 23):
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=n))
        for prompt, out in zip(PROMPTS, outs):
            assert out.finish_reason == "length"
            assert len(out.token_ids) == n
            assert out.token_ids == reference(prompt, n)
            assert out.stats.target_forward_passes <= n
        # sampled requests respect the limit too
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=n, temperature=1.0, seed=4))
        assert [len(o.token_ids) for o in outs] == [n] * len(PROMPTS)
    if draft == "self":
        assert any(k > 0 for _, k in spy.drafts)
    _assert_caches_empty(engine)


@pytest.mark.parametrize("draft", DRAFTS)
def test_every_round_commits_at_least_one_token(target_dir, draft):
    engine = _engine(target_dir, draft, num_speculative_tokens=3)
    sched = engine.scheduler
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=1) for n, t in ((9, 0.0), (14, 1.0), (3, 0.0))]
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        sched.add_request(Request(f"r{i}", p, sp, num_speculative_tokens=[None, 1, 0][i]))
    finished = set()
    while sched.has_work():
        before = {rid: len(run.generated) for rid, run in sched.running.items()}
        updates = sched.step().updates
        after_ids = set(before) | {u.req_id for u in updates}
        for u in updates:
            assert u.token_ids, f"{u.req_id} committed zero tokens in a round"
            if u.finished:
                finished.add(u.req_id)
        for rid in after_ids - finished:
            assert len(sched.running[rid].generated) > before.get(rid, 0)
    assert finished == {"r0", "r1", "r2"}
    _assert_caches_empty(engine)


@pytest.mark.parametrize("draft", DRAFTS)
def test_k_shrinks_at_the_end_of_the_context(target_dir, reference, draft):
    engine = _engine(target_dir, draft, num_speculative_tokens=6, kv_block_size=8)
    spy = SpyTarget(engine.scheduler)
    engine.scheduler.target = spy
    prompt = [(i * 7) % VOCAB for i in range(MAX_POS - 28)]
    prompt[-20:] = prompt[:20]  # give the n-gram drafter something to find
    params = SamplingParams(max_new_tokens=28)
    assert len(prompt) + params.max_new_tokens == MAX_POS
    [out] = engine.generate([prompt], params)
    assert len(out.token_ids) == 28 and out.finish_reason == "length"
    assert out.token_ids == reference(prompt, 28)
    # the same at the limit with a sampled request, and two such requests in one batch
    outs = engine.generate([prompt, prompt[1:] + [3]], SamplingParams(max_new_tokens=28, temperature=1.0, seed=9))
    assert [len(o.token_ids) for o in outs] == [28, 28]
    # one token past the context is refused up front
    with pytest.raises(ValueError, match="exceeds the context length 128"):
        engine.generate([prompt + [1]], params)
    _assert_caches_empty(engine)


def test_k_shrinks_near_max_new_tokens(target_dir):
    engine = _engine(target_dir, "self", num_speculative_tokens=5)
    spy = SpyTarget(engine.scheduler)
    engine.scheduler.target = spy
    [out] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=7))
    # self-draft accepts everything: round 1 drafts 5 (commits 6), round 2 may draft 0 (commits 1)
    assert [k for _, k in spy.drafts] == [5, 0]
    assert out.stats.target_forward_passes == 2 and out.stats.proposed_tokens == 5
    assert out.stats.acceptance_rate == 1.0


def test_draft_with_shorter_context_limits_requests(target_dir, tmp_path):
    short = tmp_path / "short_draft"
    shutil.copytree(target_dir, short)
    _write_config(short, max_position_embeddings=64)
    engine = LocalEngine(str(target_dir), draft=str(short), num_speculative_tokens=4)
    assert engine.scheduler.max_seq_len == 64
    [out] = engine.generate([[3] * 40], SamplingParams(max_new_tokens=24))
    assert len(out.token_ids) == 24
    with pytest.raises(ValueError, match="context length 64"):
        engine.generate([[3] * 40], SamplingParams(max_new_tokens=25))


# ---------------------------------------------------------------- EOS

@pytest.fixture(scope="module")
def eos_setup(target_dir, reference, tmp_path_factory):
    """A copy of the checkpoint whose EOS is a token greedy decoding produces mid-way."""
    prompt = PROMPTS[0]
    full = reference(prompt, 30)
    index = next(i for i in range(4, 30) if full[i] not in full[:i])
    path = tmp_path_factory.mktemp("sched_eos")
    for f in target_dir.iterdir():
        shutil.copy(f, path / f.name)
    _write_config(path, eos_token_id=[VOCAB - 1, full[index]] if full[index] != VOCAB - 1 else full[index])
    return path, prompt, full, index


@pytest.mark.parametrize("draft", DRAFTS)
def test_eos_stops_and_ignore_eos_continues(eos_setup, draft):
    path, prompt, full, index = eos_setup
    engine = _engine(path, draft, num_speculative_tokens=4)
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=30))
    assert out.finish_reason == "eos"
    assert out.token_ids == full[:index + 1]
    assert out.token_ids[-1] == full[index]
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert out.finish_reason == "length" and out.token_ids == full
    # EOS as the very last allowed token reports eos
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=index + 1))
    assert out.finish_reason == "eos" and out.token_ids == full[:index + 1]
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=index))
    assert out.finish_reason == "length" and out.token_ids == full[:index]
    _assert_caches_empty(engine)


# ---------------------------------------------------------------- per-request K

def test_per_request_speculative_tokens_give_identical_greedy_output(target_dir, reference):
    engine = _engine(target_dir, "self", num_speculative_tokens=3)
    expected = [reference(p, 17) for p in PROMPTS]
    for k in (None, 0, 1, 2, 7):
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=17), num_speculative_tokens=k)
        assert [o.token_ids for o in outs] == expected, k
        for o in outs:
            if k == 0:
                assert o.stats.proposed_tokens == 0 and o.stats.acceptance_rate is None
                assert o.stats.target_forward_passes == 17 and o.stats.draft_forward_passes == 0
            else:
                assert o.stats.acceptance_rate == 1.0
                assert o.stats.target_forward_passes < 17
    # mixed K within one batch, through the scheduler
    sched = engine.scheduler
    for i, (p, k) in enumerate(zip(PROMPTS, (0, 1, None, 5))):
        sched.add_request(Request(f"mix{i}", p, SamplingParams(max_new_tokens=17), num_speculative_tokens=k))
    got = {}
    while sched.has_work():
        for u in sched.step().updates:
            got.setdefault(u.req_id, []).extend(u.token_ids)
    assert [got[f"mix{i}"] for i in range(4)] == expected
    _assert_caches_empty(engine)


# ---------------------------------------------------------------- continuous batching

@pytest.mark.parametrize("draft", DRAFTS)
def test_requests_join_between_steps_and_match_running_alone(target_dir, reference, draft):
    engine = _engine(target_dir, draft, num_speculative_tokens=3)
    sched = engine.scheduler
    lens = [25, 12, 18, 9]
    got = {f"j{i}": [] for i in range(4)}
    joins = {0: 0, 2: 1, 3: 2, 6: 3}  # step -> request joining before it
    step, shared_rounds = 0, 0
    while step < 200 and (step <= max(joins) or sched.has_work()):
        if step in joins:
            i = joins[step]
            sched.add_request(Request(f"j{i}", PROMPTS[i], SamplingParams(max_new_tokens=lens[i])))
        updates = sched.step().updates
        shared_rounds += len(updates) > 1
        for u in updates:
            got[u.req_id].extend(u.token_ids)
            if u.finished:
                assert u.finish_reason == "length"
        step += 1
    assert shared_rounds > 2
    for i in range(4):
        assert got[f"j{i}"] == reference(PROMPTS[i], lens[i]), i
    _assert_caches_empty(engine)


# ---------------------------------------------------------------- seeded sampling

@pytest.mark.parametrize("draft", DRAFTS)
def test_seeded_sampling_is_reproducible_alone_and_batched(target_dir, draft):
    engine = _engine(target_dir, draft, num_speculative_tokens=3)
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=20, seed=1234)
    [alone] = engine.generate([PROMPTS[0]], sp)
    [again] = engine.generate([PROMPTS[0]], sp)
    assert again.token_ids == alone.token_ids
    others = [SamplingParams(max_new_tokens=n, temperature=t, seed=s)
              for n, t, s in ((7, 0.8, 1), (25, 1.0, None), (13, 0.0, None))]
    outs = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]], [others[0], sp, others[1], others[2]])
    assert outs[1].token_ids == alone.token_ids
    # a request that joins a batch mid-way gets the same tokens as well
    sched = engine.scheduler
    sched.add_request(Request("early", PROMPTS[3], SamplingParams(max_new_tokens=30, temperature=1.0)))
    sched.step()
    sched.step()
    sched.add_request(Request("seeded", PROMPTS[0], sp))
    got = []
    while sched.has_work():
        for u in sched.step().updates:
            if u.req_id == "seeded":
                got.extend(u.token_ids)
    assert got == alone.token_ids
    # and a different seed gives a different sample
    [other] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, temperature=1.0, top_k=20, seed=4321))
    assert other.token_ids != alone.token_ids
    _assert_caches_empty(engine)


# ---------------------------------------------------------------- draft rounds

def test_draft_q_rows_keep_their_own_width_in_mixed_batches(target_dir):
    """A request's q rows must all have its own width (top_k, or the q cap), whatever else shared
    a draft step: here the top-k request drafts 4 tokens, the others fewer, so its later steps
    run alone."""
    drafter = DraftWorker.from_config(DraftConfig(model=str(target_dir), max_q_entries=16, kv_block_size=4)).drafter
    tasks = [DraftTask("k3", PROMPTS[0], 4, SamplingParams(temperature=1.0, top_k=3, seed=1)),
             DraftTask("all", PROMPTS[1], 2, SamplingParams(temperature=1.0, seed=2)),
             DraftTask("greedy", PROMPTS[2], 1, SamplingParams())]
    proposals = {p.req_id: p for p in drafter.propose(tasks)}
    assert proposals["k3"].q.token_ids.shape == (4, 3) and proposals["all"].q.token_ids.shape == (2, 16)
    assert proposals["greedy"].q is None
    for p in proposals.values():
        if p.q is not None:  # every drafted token lies in its own q's support
            for row, token in enumerate(p.tokens):
                assert float(p.q.probs[row][p.q.token_ids[row] == token].sum()) > 0


@pytest.mark.parametrize("max_q_entries", [16, VOCAB])
def test_q_rows_keep_their_width_when_a_top_p_request_leaves_the_draft_steps(target_dir, max_q_entries):
    """A top-p request beside a top-k one samples through another branch (full distributions);
    once the top-p request's steps end, the top-k request's later steps take the top-k branch.
    Its rows must still stack (found by scripts/gpu_check.py's mixed batch: a width of 256 in
    one step and 5 in the next, before each row kept its own width in both branches)."""
    drafter = DraftWorker.from_config(DraftConfig(model=str(target_dir), max_q_entries=max_q_entries,
                                                  kv_block_size=4)).drafter
    tasks = [DraftTask("k5", PROMPTS[0], 4, SamplingParams(temperature=0.8, top_k=5, seed=1)),
             DraftTask("p", PROMPTS[1], 1, SamplingParams(temperature=0.8, top_p=0.9, seed=2)),
             DraftTask("all", PROMPTS[2], 2, SamplingParams(temperature=0.8, seed=3))]
    proposals = {p.req_id: p for p in drafter.propose(tasks)}
    widest = max_q_entries
    assert proposals["k5"].q.token_ids.shape == (4, 5)
    assert proposals["p"].q.token_ids.shape == (1, widest) and proposals["all"].q.token_ids.shape == (2, widest)
    for p in proposals.values():  # each token lies in its own q's support, which sums to 1
        assert torch.allclose(p.q.probs.sum(dim=1), torch.ones(len(p.tokens)))
        for row, token in enumerate(p.tokens):
            assert float(p.q.probs[row][p.q.token_ids[row] == token].sum()) > 0


class _ScriptedK:
    """A stand-in policy that asks the same K of every request each round, from a script."""

    def __init__(self, script: list[int]):
        self.script, self.reports, self.backlogs = list(script), [], []

    def choose(self, requests) -> list[int]:
        """A round's K: one for all, or a list (one per request, in the order they came)."""
        self.backlogs.append([r.backlog for r in requests])
        k = self.script.pop(0) if self.script else 0
        return [min(k if isinstance(k, int) else k[i], r.cap) for i, r in enumerate(requests)]

    def settled(self, req_ids) -> bool:
        return False  # (every round follows the script)

    def tree_shape(self, req_id: str) -> tuple[int, int]:
        return 1, 0  # (chains)

    def observe(self, report, greedy) -> None:
        self.reports.append(report)

    def forget(self, req_id: str) -> None:
        pass


def test_a_request_back_from_k_zero_reports_the_backlog_its_draft_call_fed(target_dir):
    """Rounds at K = 0 leave the drafter behind; the call that resumes drafting feeds the backlog
    first, and the round report says how much (the cost model must not take it for step time)."""
    engine = _engine(target_dir, draft="self", num_speculative_tokens=2)
    policy = engine.scheduler.policy = _ScriptedK([2, 0, 0, 0, 0, 2])
    engine.generate([[5, 17, 42, 8]], [SamplingParams(max_new_tokens=14, ignore_eos=True)])
    drafted = [r for r in policy.reports if r.ran and any(u.num_speculative_tokens for u in r.updates)]
    assert drafted[0].draft_catch_up == 4 - 3  # the prompt: 4 tokens, one round's worth is 3
    first_round = len(drafted[0].updates[0].token_ids)
    assert drafted[1].draft_catch_up == first_round + 4 - 3  # that round's tokens, 4 rounds at K = 0, less 3
    # The policy is told that backlog before it chooses (to price a probe), and the target's first
    # pass, which fed the prompt, says so (the cost model must not take it for a verify pass).
    assert policy.backlogs[0] == [1] and policy.backlogs[5] == [drafted[1].draft_catch_up]
    ran = [r for r in policy.reports if r.ran]
    assert ran[0].target_prefill == 4 and all(r.target_prefill == 0 for r in ran[1:])
    _assert_caches_empty(engine)


def test_a_request_at_k_zero_beside_one_drafting_keeps_its_backlog_for_its_own_first_draft(target_dir):
    """A draft call made for one request takes nothing of a request at K = 0 beside it: the drafter
    would only store those tokens and feed them at that request's next draft call, which would then
    pay a catch-up that neither the policy (pricing its K) nor the round report had counted."""
    engine = _engine(target_dir, draft="self", num_speculative_tokens=2)
    policy = engine.scheduler.policy = _ScriptedK([[2, 0], [2, 0], [0, 2]])
    fed = []  # per draft call: req_id -> (tokens fed, K)
    propose = engine.scheduler.draft.propose

    def spy(tasks, releases):
        fed.append({t.req_id: (len(t.new_tokens), t.num_speculative_tokens) for t in tasks})
        return propose(tasks, releases)

    engine.scheduler.draft.propose = spy
    prompts = [[5, 17, 42, 8], [9, 4, 33, 21, 7, 12]]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 2)
    first, second = (u.req_id for u in policy.reports[0].updates)  # (in the order they came)
    assert [set(call) for call in fed[:2]] == [{first}, {first}]
    third = [r for r in policy.reports if r.ran][2]
    committed = sum(len(u.token_ids) for r in policy.reports[:2] for u in r.updates if u.req_id == second)
    assert fed[2][second] == (len(prompts[1]) + committed, 2)  # its prompt and every token since
    assert policy.backlogs[2][1] == third.draft_catch_up == len(prompts[1]) + committed - 3  # (K + 1 = 3)
    assert [len(o.token_ids) for o in outs] == [12, 12]
    _assert_caches_empty(engine)
