"""Admission and KV reservation (coordinator.rounds.admission): bad input refused with clear
errors, requests started only when their KV blocks fit and the batch has room, aborts and
deadlines before and after a request starts."""
from __future__ import annotations

import time

import pytest

from coordinator.rounds.request import Request
from draft_worker.ngram_drafter import NgramDrafter
from specdec import SamplingParams
from specdec.config import SchedulerConfig

from round_helpers import (
    DRAFTS,
    MAX_POS,
    PROMPTS,
    VOCAB,
    _assert_caches_empty,
    _engine,
)

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




# ---------------------------------------------------------------- Admission on its own

def _admission(blocks: int = 10, batch: int = 4):
    from coordinator.rounds.admission import Admission
    from specdec.round_types import TargetInfo

    info = TargetInfo(vocab_size=VOCAB, max_seq_len=MAX_POS, eos_token_ids=[], kv_block_size=8,
                      kv_blocks_total=blocks)
    return Admission(SchedulerConfig(max_batch_size=batch, num_speculative_tokens=3), info, MAX_POS, None,
                     drafting=True)


def test_admission_starts_moved_requests_first_then_new_ones_in_order_while_their_blocks_fit():
    admission, running = _admission(blocks=10), {}
    for name, new_tokens in (("big", 60), ("small", 5), ("late", 5)):  # 9, 2 and 2 blocks of 8
        admission.add(Request(name, [1, 2, 3], SamplingParams(max_new_tokens=new_tokens)))
    assert admission.admit(running) == [] and list(running) == ["big"]  # "small" waits behind it
    assert admission.reserved == {"big": 9} and admission.queue_depth == 2
    moved = running.pop("big")
    admission.reserved.pop("big")
    admission.adopt(moved, policy_state="its evidence")
    assert admission.admit(running) == [("big", "its evidence")] and list(running) == ["big"]
    assert moved.unsent_to_draft == [1, 2, 3] and not moved.started_target  # fed again as one prompt


def test_admission_fixes_a_seed_for_requests_without_one_and_keeps_a_clients():
    admission = _admission()
    drawn, chosen = Request("a", [1], SamplingParams(temperature=0.8)), Request("b", [1], SamplingParams(seed=7))
    admission.add(drawn)
    admission.add(chosen)
    assert drawn.params.seed is not None and not drawn.client_seed
    assert chosen.params.seed == 7 and chosen.client_seed
    assert admission.take("b")[0] is chosen and admission.take("b") is None and admission.knows("a")
