"""What the bench compares and what it records: the systems (`SYSTEMS`), the decoding modes, one
timed run's result (`RunResult`) and repeated runs pooled into one row (`pool_runs`).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import NamedTuple


class SystemSpec(NamedTuple):
    label: str
    needs_draft: bool  # loads the draft checkpoint
    batch1_only: bool
    drafter: str | None = None  # specdec's drafter: "model", "ngram", or None (plain decoding, and HF)
    adaptive: bool = False  # specdec chooses K per request and round (its default) instead of always K
    tree: bool = False  # drafts token trees (--tree-branches children of the root) instead of chains


SYSTEMS = {
    "engine": SystemSpec("specdec plain", False, False),
    "spec-draft": SystemSpec("specdec + draft model", True, False, "model", adaptive=True),
    "spec-draft-fixed": SystemSpec("specdec + draft model (fixed K)", True, False, "model"),
    "spec-draft-tree": SystemSpec("specdec + draft model, tree", True, False, "model", adaptive=True, tree=True),
    "spec-draft-tree-fixed": SystemSpec("specdec + draft model, tree (fixed K)", True, False, "model", tree=True),
    "spec-ngram": SystemSpec("specdec + n-gram", False, False, "ngram", adaptive=True),
    "spec-ngram-fixed": SystemSpec("specdec + n-gram (fixed K)", False, False, "ngram"),
    "hf": SystemSpec("HF generate", False, False),
    "hf-assisted": SystemSpec("HF assisted (draft)", True, True),
}
SPECDEC_SYSTEMS = ("engine", "spec-draft", "spec-draft-fixed", "spec-draft-tree", "spec-draft-tree-fixed", "spec-ngram",
                   "spec-ngram-fixed")
SPECULATIVE_SYSTEMS = tuple(key for key in SPECDEC_SYSTEMS if SYSTEMS[key].drafter is not None)



@dataclass(frozen=True)
class Mode:
    name: str  # "greedy" or "T=0.8"
    temperature: float

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RunResult:
    system: str
    label: str
    batch: int
    mode: str
    k: int | None  # draft length (None for plain decoding); the most per round for adaptive systems
    prompt_set: str = ""  # which prompts ("code", "prose", or a --prompts file's stem)
    adaptive: bool | None = None  # specdec speculation: K chosen per request and round (else always k)
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float | None = None
    skipped: str | None = None  # why this combination was not measured
    acceptance_rate: float | None = None  # accepted / proposed (the engine's statistic)
    alpha: float | None = None  # per-token acceptance: accepted / tested (see _TimedTarget)
    tested: int | None = None  # draft tokens the target tested (accepted ones + the first rejected)
    rounds_without_draft: int | None = None  # target passes whose drafter proposed nothing
    mean_accepted_length: float | None = None  # tokens committed per target forward pass
    proposed: int | None = None
    accepted: int | None = None
    target_forward_passes: int | None = None
    draft_forward_passes: int | None = None
    # K asked per request per round (rounds with a target pass): {"0": n0, "1": n1, ...} up to k.
    k_histogram: dict[str, int] | None = None
    mean_k: float | None = None
    draft_steps: int | None = None  # sum over rounds of the largest K asked in the round
    # Token trees: accepted / tested at each depth (1, 2, ..), and the draft tokens (nodes) each
    # target pass verified on average (a chain's: its proposed tokens).
    acceptance_by_depth: list[float] | None = None
    nodes_per_pass: float | None = None
    tree_share: float | None = None  # of the requests' passes with a draft, the share with a tree (the rest chains)
    # Where the wall time went (specdec only): draft worker, target worker, the rest (scheduler,
    # stop conditions, Python glue).
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    other_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    # Filled in by the report: ratios and the expected speedup.
    vs_engine_plain: float | None = None
    vs_hf_plain: float | None = None
    vs_hf_assisted: float | None = None
    cost_ratio_c: float | None = None
    # (1-a^(K+1))/((1-a)(Kc+1)) with a = alpha; for adaptive rows the best fixed K's: max over k <= K.
    theoretical_speedup: float | None = None
    theory_k: int | None = None  # the K that theoretical_speedup is for
    theoretical_speedup_with_verify_cost: float | None = None  # same, verify pass at its measured cost
    share_of_theory: float | None = None  # vs_engine_plain / theoretical_speedup
    # Greedy only: share of prompts whose output equals specdec plain's, token for token.
    same_output_as_plain: float | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # generated ids, prompt order

    def to_json(self) -> dict:
        data = asdict(self)
        del data["outputs"]
        return data

    @property
    def share_k0(self) -> float | None:
        """Share of request-rounds that did not speculate (K = 0)."""
        total = sum(self.k_histogram.values()) if self.k_histogram else 0
        return self.k_histogram.get("0", 0) / total if total else None


_SUMMED = ("tokens", "seconds", "proposed", "accepted", "tested", "rounds_without_draft", "target_forward_passes",
           "draft_forward_passes", "draft_steps", "draft_seconds", "verify_seconds", "other_seconds")


def pool_runs(runs: list[RunResult]) -> RunResult:
    """One row from repeated timed runs of one system on one row's prompts: counts and seconds
    summed, rates recomputed from the sums (tokens/s = all tokens / all seconds), outputs and
    notes from the first run."""
    if len(runs) == 1 or runs[0].skipped:
        return runs[0]
    pooled = dataclasses.replace(runs[0], notes=list(runs[0].notes))
    for name in _SUMMED:
        values = [getattr(r, name) for r in runs]
        setattr(pooled, name, None if any(v is None for v in values) else sum(values))
    if pooled.k_histogram is not None:
        counts: Counter[int] = Counter()
        for r in runs:
            counts.update({int(n): c for n, c in (r.k_histogram or {}).items()})
        pooled.k_histogram = {str(n): counts[n] for n in range(max(counts, default=0) + 1)}
    pooled.tokens_per_s = pooled.tokens / pooled.seconds if pooled.seconds > 0 else None
    if all(r.nodes_per_pass is not None for r in runs):
        pooled.nodes_per_pass = sum(r.nodes_per_pass for r in runs) / len(runs)
    if all(r.tree_share is not None for r in runs):
        pooled.tree_share = sum(r.tree_share for r in runs) / len(runs)
    if all(r.acceptance_by_depth for r in runs):  # each run's rate, averaged, as deep as every run went
        depths = min(len(r.acceptance_by_depth) for r in runs)
        pooled.acceptance_by_depth = [round(sum(r.acceptance_by_depth[d] for r in runs) / len(runs), 4)
                                      for d in range(depths)]
    if all(r.mean_accepted_length for r in runs):  # tokens / passes, whatever each system counts as a pass
        pooled.mean_accepted_length = pooled.tokens / sum(r.tokens / r.mean_accepted_length for r in runs)
    speculation_rates(pooled)
    pooled.notes.append(f"pooled over {len(runs)} timed runs")
    return pooled


def speculation_rates(result: RunResult) -> None:
    """acceptance_rate, alpha and mean_k from the counts (those the result has)."""
    if result.proposed is not None and result.accepted is not None:
        result.acceptance_rate = result.accepted / result.proposed if result.proposed else None
    if result.tested is not None and result.accepted is not None:
        result.alpha = result.accepted / result.tested if result.tested else None
    if result.k_histogram is not None:
        asked = sum(result.k_histogram.values())
        result.mean_k = sum(int(n) * c for n, c in result.k_histogram.items()) / asked if asked else None
