"""What the round-loop tests share: prompts, engines with K fixed, a spy on verify tasks, and a
check that every cache is empty after a run (the fixtures are in conftest.py)."""
from __future__ import annotations

import json

from coordinator.rounds.scheduler import Scheduler
from draft_worker.ngram_drafter import NgramDrafter
from specdec import LocalEngine

from checkpoints import self_draft_weights

VOCAB = 96
MAX_POS = 128
PROMPTS = [[5, 17, 42, 8, 3], [60, 61, 62], [7] * 9, [1, 2, 3, 1, 2, 3, 1, 2]]
DRAFTS = [None, "ngram", "self"]


def _write_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def _draft_arg(draft, path):
    return str(path) if draft == "self" else draft


def _engine(path, draft=None, **kw) -> LocalEngine:
    """K fixed unless a test asks otherwise: these tests pin the round mechanics, not the policy
    (tests/test_speculation_policy.py does that)."""
    return LocalEngine(str(path), draft=_draft_arg(draft, path),
                       **{"adaptive": False, **self_draft_weights(draft), **kw})


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
