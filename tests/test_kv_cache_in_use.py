"""Paged KV cache in use: a failed pass changes nothing, a malformed task or an untrustworthy
proposal fails only its own request, random verify rounds and churn through the scheduler keep
exact block accounting, and on an accelerator the cache takes its fraction of free memory."""
from __future__ import annotations

import copy
import json
import random
import time

import pytest
import torch
import transformers

from coordinator.rounds.request import Request
from specdec import LocalEngine, SamplingParams
from specdec.config import TargetConfig, WorkerConfig
from specdec.kv_cache import KVCacheFull, PagedKVCache
from specdec.model.decoder import load_model
from specdec.model.runner import ModelRunner
from specdec.round_types import SparseDist, VerifyTask
from target_worker.worker import TargetWorker

from checkpoints import JumpingK

VOCAB = 96


def _tiny_config(**overrides) -> transformers.LlamaConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.2)
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def _save(model, path, eos=None):
    model.save_pretrained(path)
    cfg_path = path / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["eos_token_id"] = eos
    cfg_path.write_text(json.dumps(raw))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(target_dir, draft_dir): the draft is the target with slightly perturbed weights, so a
    run sees a real mix of accepted and rejected draft tokens (greedy and sampled)."""
    torch.manual_seed(1234)
    target = transformers.LlamaForCausalLM(_tiny_config())
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    target_dir = _save(target, tmp_path_factory.mktemp("kv_target"))
    draft_dir = _save(draft, tmp_path_factory.mktemp("kv_draft"))
    return target_dir, draft_dir


# ---------------------------------------------------------------- a failed pass changes nothing

def _snapshot(cache: PagedKVCache):
    return ({s: list(cache.block_table(s)) for s in cache.sequence_ids()},
            {s: cache.length(s) for s in cache.sequence_ids()},
            sorted(cache.allocator._free))


def test_failed_pass_leaves_cache_unchanged(checkpoints):
    target_dir, _ = checkpoints
    model = load_model(target_dir)
    runner = ModelRunner(model, WorkerConfig(kv_cache_blocks=3, kv_block_size=4))
    cache = runner.cache
    prompt = [5, 17, 42, 8, 3, 77, 21, 60]
    cache.add_sequence("a")
    runner.run(["a"], [prompt], [1])  # 8 tokens: 2 full blocks, 1 free
    cache.add_sequence("b")

    before = _snapshot(cache)
    with pytest.raises(KVCacheFull):
        runner.run(["b"], [[1, 2, 3, 4, 5]], [1])  # needs 2 blocks
    assert _snapshot(cache) == before
    # a takes the last free block, then b fails: a's growth must be rolled back too
    with pytest.raises(KVCacheFull):
        runner.run(["a", "b"], [[9], [1, 2]], [1, 1])
    assert _snapshot(cache) == before
    cache.check_accounting()
    # a pass that fails inside the model (token id outside the vocabulary) after slots were given
    with pytest.raises(IndexError, match="out of (bounds|range)"):
        runner.run(["a"], [[VOCAB + 7]], [1])
    assert _snapshot(cache) == before
    passes = runner.forward_passes

    # The surviving sequence still decodes exactly as on a fresh cache.
    logits = runner.run(["a"], [[9, 10]], [2])[0]
    fresh = ModelRunner(model, WorkerConfig(kv_cache_blocks=3, kv_block_size=4))
    fresh.cache.add_sequence("a")
    expected = fresh.run(["a"], [prompt + [9, 10]], [2])[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert runner.forward_passes == passes + 1
    cache.check_accounting()


def test_target_rejects_malformed_task_without_state_change(checkpoints):
    target_dir, _ = checkpoints
    worker = TargetWorker.from_config(TargetConfig(model=str(target_dir), kv_cache_blocks=16, kv_block_size=4))
    greedy = SamplingParams(max_new_tokens=10)
    worker.verify([VerifyTask("a", [1, 2, 3], [], None, greedy)], [])
    before = _snapshot(worker.cache)
    bad_tasks = [  # what only a coordinator bug can send: the whole round is refused
        VerifyTask("a", [4], [], None, greedy),  # new tokens after the first round
        VerifyTask("z", [], [1], None, greedy),  # first round without a prompt
        VerifyTask("a", [], list(range(130)), None, greedy),  # beyond the context
        VerifyTask("y", [VOCAB], [], None, greedy),  # a prompt token outside the vocabulary
    ]
    for bad in bad_tasks:
        with pytest.raises(ValueError):
            # the good task comes first in the batch: it must not be admitted either
            worker.verify([VerifyTask("fresh", [7, 8], [], None, greedy), bad], [])
        assert _snapshot(worker.cache) == before
        assert "fresh" not in worker._seqs
    worker.release(["a"])
    assert worker.cache.allocator.num_used == 0


def _q(rows: list[dict[int, float]]) -> SparseDist:
    width = max(len(r) for r in rows)
    ids = [list(r) + [0] * (width - len(r)) for r in rows]
    probs = [list(r.values()) + [0.0] * (width - len(r)) for r in rows]
    return SparseDist(token_ids=torch.tensor(ids), probs=torch.tensor(probs))


@pytest.mark.parametrize("draft,q,reason", [
    ([VOCAB], None, "outside the vocabulary"),  # a draft token the model does not have
    ([5, 6], None, "needs q for each of its 2 draft tokens"),
    ([5, 6], _q([{5: 1.0}]), "needs q for each of its 2 draft tokens"),
    ([5], _q([{6: 1.0}]), "probability 0 under the q"),  # q = 0 at the token: must not be accepted
    ([5], _q([{5: 0.0, 6: 1.0}]), "probability 0 under the q"),
    ([5], _q([{5: 0.7, 6: 0.7}]), "sum to 1"),
    ([5], _q([{5: 1.5, 6: -0.5}]), "negative"),
    ([5], _q([{5: float("nan")}]), "non-finite"),
    ([5], _q([{5: 0.5, VOCAB + 3: 0.5}]), "outside the vocabulary"),
])
def test_an_untrustworthy_proposal_fails_its_own_request_only(checkpoints, draft, q, reason):
    target_dir, _ = checkpoints
    worker = TargetWorker.from_config(TargetConfig(model=str(target_dir), kv_cache_blocks=16, kv_block_size=4))
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    worker.verify([VerifyTask("bad", [1, 2, 3], [], None, sampled)], [])
    before = _snapshot(worker.cache)
    result = worker.verify([VerifyTask("good", [7, 8], [9], _q([{9: 1.0}]), sampled),
                            VerifyTask("bad", [], draft, q, sampled)], [])
    good, bad = result.outcomes
    assert (good.req_id, good.error, len(good.tokens)) == ("good", "", good.num_accepted + 1)
    assert bad.req_id == "bad" and reason in bad.error and bad.tokens == [] and bad.num_accepted == 0
    assert worker.cache.length("bad") == before[1]["bad"]  # the refused request's cache is untouched
    worker.release(["good", "bad"])
    assert worker.cache.allocator.num_used == 0


@pytest.mark.parametrize("draft,q", [
    ([5], _q([{5: 1.0}])), ([5, 6], _q([{5: 0.5, 6: 0.5}, {6: 1.0}])), ([5], _q([{6: 1.0}])),
    ([5, 6], _q([{5: 1.0}, {5: 0.0, 6: 1.0}])), ([5], _q([{5: 0.7, 6: 0.7}])), ([5], _q([{5: 1.5, 6: -0.5}])),
    ([5], _q([{5: float("nan")}])), ([5], _q([{5: 0.5, VOCAB + 3: 0.5}])), ([5], _q([{5: 0.5, -1: 0.5}])),
])
def test_the_q_checks_in_numpy_give_the_devices_verdicts_and_reasons(draft, q):
    """A CPU's q is checked in numpy (torch's fixed cost per op); a device's in torch. The same q
    gets the same verdict from each check, and the same reason for the first that fails."""
    from target_worker.proposal_check import _first_failure, _q_checks

    task = VerifyTask("r", [], draft, q, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3))
    host, device = _q_checks(task, VOCAB, on_host=True), _q_checks(task, VOCAB, on_host=False)
    assert [bool(flag) for flag, _ in host] == [bool(flag) for flag, _ in device]
    if not all(bool(flag) for flag, _ in host):
        assert _first_failure(host) == _first_failure(device)


# ---------------------------------------------------------------- random verify rounds, directly

def _random_q(rng: random.Random, tokens: list[int], vocab: int) -> SparseDist:
    """A random sparse q per position that gives the drafted token positive mass."""
    rows = []
    for t in tokens:
        row = torch.zeros(vocab)
        others = rng.sample(range(vocab), rng.randrange(0, 4))
        for o in others:
            row[o] = rng.random()
        row[t] = rng.random() + 0.05
        rows.append(row / row.sum())
    return SparseDist.from_dense(torch.stack(rows))


@pytest.mark.parametrize("seed", [0, 1])
def test_target_verify_with_random_drafts_keeps_accounting(checkpoints, seed):
    target_dir, _ = checkpoints
    rng = random.Random(seed)
    worker = TargetWorker.from_config(TargetConfig(model=str(target_dir), kv_cache_blocks=60, kv_block_size=4))
    cache = worker.cache
    max_len = worker.runner.max_seq_len
    committed: dict[str, list[int]] = {}
    started: set[str] = set()
    params: dict[str, SamplingParams] = {}
    budget: dict[str, int] = {}
    next_id = 0
    accepted_any = rejected_any = False
    for _ in range(40):
        if len(committed) < 4 and rng.random() < 0.6:
            rid = f"r{next_id}"
            next_id += 1
            committed[rid] = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
            budget[rid] = rng.randrange(1, 30)
            params[rid] = rng.choice([SamplingParams(), SamplingParams(temperature=1.0, seed=seed + next_id),
                                      SamplingParams(temperature=0.7, top_k=5, seed=next_id)])
        finished = []
        for rid in list(committed):
            if rng.random() < 0.1:  # cancelled mid-generation (or before it started)
                finished.append(rid)
                del committed[rid]
        tasks = []
        for rid, toks in committed.items():
            k = max(0, min(rng.randrange(0, 6), budget[rid] - 1, max_len - len(toks) - 1))
            draft = [rng.randrange(VOCAB) for _ in range(k)]
            if draft and rng.random() < 0.5:
                # give greedy requests a fighting chance: sometimes draft what the target would pick
                draft[0] = toks[-1]
            q = _random_q(rng, draft, VOCAB) if draft and not params[rid].greedy else None
            tasks.append(VerifyTask(rid, [] if rid in started else list(toks), draft, q, params[rid]))
        result = worker.verify(tasks, finished)
        cache.check_accounting()
        assert result.kv_blocks_used == cache.allocator.num_used
        assert [o.req_id for o in result.outcomes] == [t.req_id for t in tasks]
        for task, out in zip(tasks, result.outcomes):
            assert 0 <= out.num_accepted <= len(task.draft_tokens)
            assert len(out.tokens) == out.num_accepted + 1  # never zero tokens
            assert out.tokens[:out.num_accepted] == task.draft_tokens[:out.num_accepted]
            accepted_any |= out.num_accepted > 0
            rejected_any |= out.num_accepted < len(task.draft_tokens)
            started.add(task.req_id)
            committed[task.req_id].extend(out.tokens)
            budget[task.req_id] -= len(out.tokens)
            # the target caches every committed token except the last
            assert cache.length(task.req_id) == len(committed[task.req_id]) - 1
        for rid in [r for r in committed if budget[r] <= 0]:  # finished by length
            del committed[rid]
            worker.release([rid])
            cache.check_accounting()
        assert set(cache.sequence_ids()) <= set(committed) | set(finished) | started
    worker.verify([], list(committed))
    cache.check_accounting()
    assert accepted_any and rejected_any
    assert cache.allocator.num_used == 0 and cache.sequence_ids() == []
    assert worker._seqs == {}


# ---------------------------------------------------------------- churn through the scheduler

@pytest.mark.parametrize("seed,policy", [(0, "fixed"), (1, "fixed"), (2, "jumping"), (3, "jumping")])
def test_scheduler_churn_never_leaks_blocks(checkpoints, seed, policy):
    """Random arrivals, aborts, deadlines, greedy and sampled requests, per-request K, a small
    cache: after every round both caches account for every block exactly, and at the end every
    block is free. Greedy requests that ran to completion still match target-only decoding."""
    target_dir, draft_dir = checkpoints
    rng = random.Random(seed)
    engine = LocalEngine(target_dir, draft=draft_dir, num_speculative_tokens=4, max_batch_size=4,
                         kv_cache_blocks=24, kv_block_size=4, adaptive=False)
    sched = engine.scheduler
    if policy == "jumping":  # K between 0 and the cap, changing every round
        sched.policy = JumpingK(seed)
    tcache = engine.target_worker.cache
    dcache = engine.draft_worker.drafter.runner.cache
    requests: dict[str, Request] = {}
    generated: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    n_added = 0
    proposed = accepted = max_batch = 0
    for _step in range(80):
        if n_added < 16 and rng.random() < 0.3:
            rid = f"c{n_added}"
            n_added += 1
            sampled = rng.random() < 0.4
            params = SamplingParams(max_new_tokens=rng.randrange(1, 25),
                                    temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
                                    top_k=rng.choice([0, 8]), seed=rng.randrange(1000), ignore_eos=True)
            req = Request(rid, [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))], params,
                          num_speculative_tokens=rng.choice([None, None, 0, 1, 6]))
            sched.add_request(req)
            requests[rid], generated[rid] = req, []
        live = [r for r in requests if r not in reasons]
        if live and rng.random() < 0.12:
            rid = rng.choice(live)
            if sched.abort(rid):
                reasons[rid] = "cancelled"
        elif live and rng.random() < 0.05:
            requests[rng.choice(live)].deadline = time.monotonic() - 1.0
        before = {rid: len(run.generated) for rid, run in sched.running.items()}
        updates = sched.step().updates
        max_batch = max(max_batch, len(sched.running))
        tcache.check_accounting()
        dcache.check_accounting()
        for u in updates:
            assert u.req_id not in reasons, "update for a request that already finished"
            generated[u.req_id].extend(u.token_ids)
            if u.finish_reason not in ("deadline",):
                assert u.token_ids, "a round committed zero tokens"
            assert u.finish_reason != "error", u.error
            if u.finished:
                reasons[u.req_id] = u.finish_reason
                proposed += u.stats.proposed
                accepted += u.stats.accepted
        for rid, n in before.items():
            if rid in sched.running:
                assert len(sched.running[rid].generated) > n
        for rid, run in sched.running.items():
            if run.started_target:
                assert tcache.length(rid) == len(run.request.prompt_ids) + len(run.generated) - 1
        # only live requests (or ones whose release is still pending) hold cache blocks
        pending = set(sched.failover.release_target) | set(sched.failover.release_draft)
        assert set(tcache.sequence_ids()) <= set(sched.running) | pending
        assert set(dcache.sequence_ids()) <= set(sched.running) | pending
    for rid in [r for r in requests if r not in reasons]:
        sched.abort(rid)
        reasons[rid] = "cancelled"
    while sched.has_work():
        sched.step()
    tcache.check_accounting()
    dcache.check_accounting()
    assert tcache.allocator.num_used == 0 and dcache.allocator.num_used == 0
    assert tcache.sequence_ids() == [] and dcache.sequence_ids() == []
    assert engine.target_worker._seqs == {} and engine.draft_worker.drafter._seqs == {}
    assert "cancelled" in reasons.values() and "length" in reasons.values()
    assert max_batch >= 2  # requests really shared rounds
    assert 0 < accepted < proposed  # a genuine mix of accepts and rejections

    for rid, reason in reasons.items():
        if reason == "length":
            assert len(generated[rid]) == requests[rid].params.max_new_tokens
    # greedy requests that completed are exactly target-only greedy decoding
    done = [rid for rid, why in reasons.items() if why == "length" and requests[rid].params.greedy]
    assert done
    reference = LocalEngine(target_dir, kv_cache_blocks=200, kv_block_size=4)
    outs = reference.generate([requests[r].prompt_ids for r in done], [requests[r].params for r in done])
    for rid, out in zip(done, outs):
        assert generated[rid] == out.token_ids, rid
    # the engine is still usable after the churn
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(out[0].token_ids) == 5
    assert tcache.allocator.num_used == 0 and dcache.allocator.num_used == 0
