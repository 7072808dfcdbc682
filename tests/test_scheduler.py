"""The coordinator's round loop: limits, stop conditions, validation, aborts, deadlines,
continuous batching and seeded sampling, through LocalEngine and the Scheduler itself."""
from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
import transformers

from coordinator.request import Request
from coordinator.scheduler import Scheduler
from draft_worker.ngram_drafter import NgramDrafter
from draft_worker.worker import DraftWorker
from specdec import LocalEngine, SamplingParams
from specdec.config import NGRAM, DraftConfig, SchedulerConfig, WorkerConfig
from specdec.model.decoder import load_model
from specdec.model.runner import ModelRunner
from specdec.round_types import DraftTask
from target_worker.worker import TargetWorker

VOCAB = 96
MAX_POS = 128
PROMPTS = [[5, 17, 42, 8, 3], [60, 61, 62], [7] * 9, [1, 2, 3, 1, 2, 3, 1, 2]]
DRAFTS = [None, "ngram", "self"]


def _write_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(99)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
                                   initializer_range=0.2)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("sched_target")
    hf_model.save_pretrained(path)
    _write_config(path, eos_token_id=None)  # no EOS unless a test asks for one
    return path


def _draft_arg(draft, path):
    return str(path) if draft == "self" else draft


def _engine(path, draft=None, **kw) -> LocalEngine:
    """K fixed unless a test asks otherwise: these tests pin the round mechanics, not the policy
    (tests/test_speculation_policy.py does that)."""
    return LocalEngine(str(path), draft=_draft_arg(draft, path), **{"adaptive": False, **kw})


def _assert_caches_empty(engine: LocalEngine):
    tcache = engine.target_worker.cache
    tcache.check_accounting()
    assert tcache.allocator.num_used == 0 and tcache.sequence_ids() == []
    drafter = engine.draft_worker.drafter if engine.draft_worker else None
    if drafter is not None and hasattr(drafter, "runner"):
        drafter.runner.cache.check_accounting()
        assert drafter.runner.cache.allocator.num_used == 0
    if isinstance(drafter, NgramDrafter):
        assert drafter._tokens == {}


class SpyTarget:
    """Checks every verify task against the scheduler's view of its request: the draft never
    overflows the context or max_new_tokens."""

    def __init__(self, scheduler: Scheduler):
        self.inner = scheduler.target
        self.scheduler = scheduler
        self.drafts: list[tuple[str, int]] = []

    def info(self):
        return self.inner.info()

    def verify(self, tasks, finished):
        for t in tasks:
            run = self.scheduler.running[t.req_id]
            length = len(run.request.prompt_ids) + len(run.generated)
            remaining = run.request.params.max_new_tokens - len(run.generated)
            assert remaining >= 1
            assert len(t.draft_tokens) <= remaining - 1
            assert length + len(t.draft_tokens) + 1 <= self.scheduler.max_seq_len
            self.drafts.append((t.req_id, len(t.draft_tokens)))
        return self.inner.verify(tasks, finished)


@pytest.fixture(scope="module")
def reference(target_dir):
    """Target-only greedy outputs (plain decoding), cached per (prompt, max_new_tokens)."""
    engine = _engine(target_dir)
    cache = {}

    def get(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = engine.generate([prompt], SamplingParams(max_new_tokens=n))[0].token_ids
        return cache[key]

    return get


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


# ---------------------------------------------------------------- validation

def test_bad_input_raises_clear_errors_and_engine_keeps_working(target_dir, reference):
    engine = _engine(target_dir, "self", num_speculative_tokens=3)
    ok = SamplingParams(max_new_tokens=6)
    cases = [
        ([[]], ok, "prompt is empty"),
        ([[1, VOCAB]], ok, "outside the vocabulary"),
        ([[1, -1]], ok, "outside the vocabulary"),
        ([[1] * 100], SamplingParams(max_new_tokens=29), "exceeds the context length"),
        ([[1, 2], [3]], [ok], "got 1 SamplingParams for 2 prompts"),
        ([[1, 2], [1, 2, 3]], [ok, ok, ok], "got 3 SamplingParams for 2 prompts"),
        # a good prompt next to a bad one: nothing is queued
        ([[1, 2, 3], [VOCAB + 3]], ok, "outside the vocabulary"),
    ]
    for prompts, params, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompts, params)
        assert not engine.scheduler.waiting and not engine.scheduler.running
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine.generate([[1, 2]], ok, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine.generate([[1, 2]], ok, num_speculative_tokens=65)
    with pytest.raises(TypeError):
        engine.generate("a string prompt", ok)
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate(["text needs a tokenizer"], ok)
    bad_params = [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(seed=-3), "seed"),
        (dict(stop=[""]), "stop"),
    ]
    for kw, field in bad_params:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    # duplicate request id on the scheduler
    sched = engine.scheduler
    sched.add_request(Request("dup", [1, 2], ok))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("dup", [3], ok))
    assert sched.abort("dup")
    # still serving, and correctly
    outs = engine.generate(PROMPTS[:2], ok)
    assert [o.token_ids for o in outs] == [reference(p, 6) for p in PROMPTS[:2]]
    _assert_caches_empty(engine)


def test_request_larger_than_the_kv_cache_is_refused(target_dir):
    engine = _engine(target_dir, kv_cache_blocks=4, kv_block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=10))
    [out] = engine.generate([[1] * 5], SamplingParams(max_new_tokens=6))
    assert len(out.token_ids) == 6


def test_admission_waits_for_kv_blocks(target_dir, reference):
    # each request reserves ceil(20 / 4) + 1 = 6 of 10 blocks: only one runs at a time
    engine = _engine(target_dir, "self", kv_cache_blocks=10, kv_block_size=4)
    sched = engine.scheduler
    for i in range(3):
        sched.add_request(Request(f"w{i}", PROMPTS[i], SamplingParams(max_new_tokens=20 - len(PROMPTS[i]))))
    got, max_running = {}, 0
    while sched.has_work():
        for u in sched.step().updates:
            got.setdefault(u.req_id, []).extend(u.token_ids)
        max_running = max(max_running, len(sched.running))
        engine.target_worker.cache.check_accounting()
    assert max_running == 1
    assert [got[f"w{i}"] for i in range(3)] == [reference(PROMPTS[i], 20 - len(PROMPTS[i])) for i in range(3)]
    _assert_caches_empty(engine)


def test_max_batch_size_is_respected(target_dir, reference):
    engine = _engine(target_dir, "ngram", max_batch_size=2)
    sched = engine.scheduler
    for i, p in enumerate(PROMPTS):
        sched.add_request(Request(f"b{i}", p, SamplingParams(max_new_tokens=8)))
    got = {}
    while sched.has_work():
        for u in sched.step().updates:
            got.setdefault(u.req_id, []).extend(u.token_ids)
        assert len(sched.running) <= 2
    assert [got[f"b{i}"] for i in range(4)] == [reference(p, 8) for p in PROMPTS]


# ---------------------------------------------------------------- abort and deadlines

@pytest.mark.parametrize("draft", DRAFTS)
def test_abort_running_request_frees_its_blocks_after_the_next_step(target_dir, reference, draft):
    engine = _engine(target_dir, draft, num_speculative_tokens=3, kv_block_size=4)
    sched = engine.scheduler
    tcache = engine.target_worker.cache
    sched.add_request(Request("keep", PROMPTS[0], SamplingParams(max_new_tokens=30)))
    sched.add_request(Request("drop", PROMPTS[3], SamplingParams(max_new_tokens=30, temperature=1.0, seed=2)))
    got = {"keep": [], "drop": []}
    for _ in range(2):
        for u in sched.step().updates:
            got[u.req_id].extend(u.token_ids)
    assert tcache.has_sequence("drop")
    drop_blocks = len(tcache.block_table("drop"))
    used = tcache.allocator.num_used
    assert sched.abort("drop") is True
    assert "drop" not in sched.running
    assert sched.abort("drop") is False and sched.abort("never-added") is False
    for u in sched.step().updates:
        assert u.req_id == "keep"
        got["keep"].extend(u.token_ids)
    assert not tcache.has_sequence("drop")
    assert tcache.allocator.num_used <= used - drop_blocks + 2  # keep grew by at most a couple of blocks
    tcache.check_accounting()
    drafter = engine.draft_worker.drafter if engine.draft_worker else None
    if drafter is not None and hasattr(drafter, "runner"):
        assert not drafter.runner.cache.has_sequence("drop") and "drop" not in drafter._seqs
    if isinstance(drafter, NgramDrafter):
        assert "drop" not in drafter._tokens
    # aborting the last running request: the next (idle) step flushes its blocks
    assert sched.abort("keep")
    assert not sched.running and sched.has_work()
    assert sched.step().updates == []
    assert not sched.has_work()
    _assert_caches_empty(engine)
    # the kept request's tokens so far are exactly target greedy decoding
    assert got["keep"] == reference(PROMPTS[0], 30)[:len(got["keep"])]


def test_abort_waiting_request_never_runs(target_dir):
    engine = _engine(target_dir, max_batch_size=1)
    sched = engine.scheduler
    sched.add_request(Request("first", PROMPTS[0], SamplingParams(max_new_tokens=3)))
    sched.add_request(Request("second", PROMPTS[1], SamplingParams(max_new_tokens=3)))
    sched.step()
    assert sched.queue_depth == 1
    assert sched.abort("second")
    seen = set()
    while sched.has_work():
        seen |= {u.req_id for u in sched.step().updates}
    assert seen == {"first"}
    _assert_caches_empty(engine)


def test_deadline_in_the_past_before_start(target_dir):
    engine = _engine(target_dir, "self")
    sched = engine.scheduler
    sched.add_request(Request("late", PROMPTS[0], SamplingParams(max_new_tokens=5), deadline=time.monotonic() - 1))
    sched.add_request(Request("fine", PROMPTS[1], SamplingParams(max_new_tokens=5)))
    updates = sched.step().updates
    late = [u for u in updates if u.req_id == "late"]
    assert len(late) == 1 and late[0].finished and late[0].finish_reason == "deadline"
    assert late[0].token_ids == [] and late[0].error_kind == "deadline"
    assert late[0].stats is not None
    while sched.has_work():
        assert all(u.req_id == "fine" for u in sched.step().updates)
    _assert_caches_empty(engine)


@pytest.mark.parametrize("draft", DRAFTS)
def test_deadline_cuts_off_a_running_request(target_dir, draft):
    engine = _engine(target_dir, draft, num_speculative_tokens=2)
    sched = engine.scheduler
    req = Request("d", PROMPTS[2], SamplingParams(max_new_tokens=40))
    sched.add_request(req)
    got = []
    for _ in range(2):
        for u in sched.step().updates:
            got.extend(u.token_ids)
            assert not u.finished
    req.deadline = time.monotonic() - 0.001
    updates = sched.step().updates
    assert len(updates) == 1
    u = updates[0]
    assert u.finished and u.finish_reason == "deadline" and u.token_ids == []
    assert u.stats.generated == len(got) > 0
    assert not sched.running
    sched.step()  # flush
    assert not sched.has_work()
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


# ---------------------------------------------------------------- worker failures

class FlakyTarget:
    def __init__(self, inner, fail_on_call: int):
        self.inner, self.fail_on_call, self.calls = inner, fail_on_call, 0

    def info(self):
        return self.inner.info()

    def verify(self, tasks, finished):
        self.calls += 1
        if self.calls == self.fail_on_call:
            self.inner.verify(tasks, finished)  # the worker did the work, then the reply was lost
            raise RuntimeError("injected failure")
        return self.inner.verify(tasks, finished)


def test_worker_failure_ends_the_round_and_frees_everything(target_dir, reference):
    model = load_model(str(target_dir))
    target = TargetWorker(ModelRunner(model, WorkerConfig(kv_cache_blocks=64, kv_block_size=4)))
    draft = DraftWorker.from_config(DraftConfig(model=NGRAM))
    flaky = FlakyTarget(target, fail_on_call=3)
    sched = Scheduler(flaky, draft, None, SchedulerConfig(num_speculative_tokens=3, adaptive=False))
    sched.add_request(Request("a", PROMPTS[0], SamplingParams(max_new_tokens=10)))
    sched.add_request(Request("b", PROMPTS[3], SamplingParams(max_new_tokens=10)))
    reasons = {}
    while sched.has_work():
        for u in sched.step().updates:
            if u.finished:
                reasons[u.req_id] = u.finish_reason
                if u.finish_reason == "error":
                    assert "injected failure" in u.error and u.error_kind == "internal"
    assert reasons == {"a": "error", "b": "error"}
    target.cache.check_accounting()
    assert target.cache.allocator.num_used == 0 and target._seqs == {}
    assert draft.drafter._tokens == {}
    # the scheduler keeps serving
    sched.add_request(Request("c", PROMPTS[1], SamplingParams(max_new_tokens=8)))
    got = []
    while sched.has_work():
        for u in sched.step().updates:
            got.extend(u.token_ids)
    assert got == reference(PROMPTS[1], 8)
    assert target.cache.allocator.num_used == 0


def test_scheduler_config_rejects_a_negative_default(target_dir):
    with pytest.raises(ValueError, match="scheduler.num_speculative_tokens"):
        SchedulerConfig(num_speculative_tokens=-1)


@pytest.mark.parametrize("draft", DRAFTS)
def test_request_id_can_be_reused_right_after_it_ends(target_dir, reference, draft):
    """The release of the old request and the admission of the new one land in the same round:
    the workers must release first, then start the new sequence from scratch."""
    engine = _engine(target_dir, draft, num_speculative_tokens=3)
    sched = engine.scheduler

    def run_to_end(rid):
        got = []
        while sched.has_work():
            for u in sched.step().updates:
                if u.req_id == rid:
                    got.extend(u.token_ids)
        return got

    sched.add_request(Request("x", PROMPTS[0], SamplingParams(max_new_tokens=20)))
    sched.step()
    sched.step()
    assert sched.abort("x")
    sched.add_request(Request("x", PROMPTS[1], SamplingParams(max_new_tokens=9)))
    assert run_to_end("x") == reference(PROMPTS[1], 9)
    # finished normally, then reused before any flush step
    sched.add_request(Request("y", PROMPTS[2], SamplingParams(max_new_tokens=2)))
    while "y" in sched.running or sched.waiting:
        sched.step()
    sched.add_request(Request("y", PROMPTS[3], SamplingParams(max_new_tokens=11)))
    assert run_to_end("y") == reference(PROMPTS[3], 11)
    _assert_caches_empty(engine)


class LyingDrafter:
    """Wraps a draft worker; for request "evil" it claims q = 0 on the tokens it proposes, which
    an unsuspecting verifier would accept whenever the target gives them any probability."""

    def __init__(self, inner):
        self.inner = inner

    def info(self):
        return self.inner.info()

    def propose(self, tasks, finished):
        proposals = self.inner.propose(tasks, finished)
        for p in proposals:
            if p.req_id == "evil" and p.tokens:
                p.q.probs[:] = torch.where(p.q.token_ids == torch.tensor(p.tokens)[:, None], 0.0, p.q.probs)
                p.q.probs[:] /= p.q.probs.sum(dim=1, keepdim=True).clamp_min(1e-9)
        return proposals


def test_a_drafter_that_lies_about_q_fails_only_its_own_request(target_dir):
    engine = _engine(target_dir, "self", num_speculative_tokens=3)
    sched = engine.scheduler
    sched.draft = LyingDrafter(sched.draft)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, seed=4)
    sched.add_request(Request("evil", PROMPTS[0], sampled))
    sched.add_request(Request("fair", PROMPTS[1], sampled))
    updates = {}
    while sched.has_work():
        for u in sched.step().updates:
            updates.setdefault(u.req_id, []).append(u)
    evil, fair = updates["evil"][-1], updates["fair"][-1]
    assert evil.finish_reason == "error" and evil.error_kind == "internal"
    assert "refused" in evil.error and "probability 0 under the q" in evil.error
    assert fair.finish_reason == "length"
    alone = _engine(target_dir, "self", num_speculative_tokens=3).generate([PROMPTS[1]], sampled)[0]
    assert sum((u.token_ids for u in updates["fair"]), []) == alone.token_ids
    _assert_caches_empty(engine)


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


class _ScriptedK:
    """A stand-in policy that asks the same K of every request each round, from a script."""

    def __init__(self, script: list[int]):
        self.script, self.reports, self.backlogs = list(script), [], []

    def choose(self, requests) -> list[int]:
        self.backlogs.append([r.backlog for r in requests])
        k = self.script.pop(0) if self.script else 0
        return [min(k, r.cap) for r in requests]

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
