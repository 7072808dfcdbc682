"""How each benchmarked system is driven and timed, on the same token-id prompts.

Every system gets the prompts as token ids (tokenized once, up front), the same max_new_tokens
(EOS never ends a sequence early: `ignore_eos=True` for specdec, `min_new_tokens=max_new_tokens`
for Hugging Face), the same torch threads, and one warm-up call before it is timed.
tokens/s = generated tokens / wall-clock seconds of the timed calls.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from specdec.tokenizer import encode_prompt


class SystemSpec(NamedTuple):
    label: str
    needs_draft: bool  # loads the draft checkpoint
    batch1_only: bool
    drafter: str | None = None  # specdec's drafter: "model", "ngram", or None (plain decoding, and HF)
    adaptive: bool = False  # specdec chooses K per request and round (its default) instead of always K


SYSTEMS = {
    "engine": SystemSpec("specdec plain", False, False),
    "spec-draft": SystemSpec("specdec + draft model", True, False, "model", adaptive=True),
    "spec-draft-fixed": SystemSpec("specdec + draft model (fixed K)", True, False, "model"),
    "spec-ngram": SystemSpec("specdec + n-gram", False, False, "ngram", adaptive=True),
    "spec-ngram-fixed": SystemSpec("specdec + n-gram (fixed K)", False, False, "ngram"),
    "hf": SystemSpec("HF generate", False, False),
    "hf-assisted": SystemSpec("HF assisted (draft)", True, True),
}
SPECDEC_SYSTEMS = ("engine", "spec-draft", "spec-draft-fixed", "spec-ngram", "spec-ngram-fixed")
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
    if all(r.mean_accepted_length for r in runs):  # tokens / passes, whatever each system counts as a pass
        pooled.mean_accepted_length = pooled.tokens / sum(r.tokens / r.mean_accepted_length for r in runs)
    _speculation_rates(pooled)
    pooled.notes.append(f"pooled over {len(runs)} timed runs")
    return pooled


def _speculation_rates(result: RunResult) -> None:
    """acceptance_rate, alpha and mean_k from the counts (those the result has)."""
    if result.proposed is not None and result.accepted is not None:
        result.acceptance_rate = result.accepted / result.proposed if result.proposed else None
    if result.tested is not None and result.accepted is not None:
        result.alpha = result.accepted / result.tested if result.tested else None
    if result.k_histogram is not None:
        asked = sum(result.k_histogram.values())
        result.mean_k = sum(int(n) * c for n, c in result.k_histogram.items()) / asked if asked else None


# -- prompts -------------------------------------------------------------------------------------
def load_prompts(path: str | Path, n: int, tokenizer=None) -> tuple[list[list[int]], list[str]]:
    """n prompts spread evenly over a JSONL file of {"prompt": text} or {"prompt_ids": [ids]}.

    Returns (token-id lists, a short description of each). Text needs the checkpoint's tokenizer
    and is encoded the way LocalEngine encodes it.
    """
    entries = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not entries:
        raise ValueError(f"{path}: no prompts")
    if n > len(entries):
        raise ValueError(f"asked for {n} prompts but {path} has {len(entries)}")
    picks = [entries[(i * len(entries)) // n] for i in range(n)]
    ids, names = [], []
    for i, entry in enumerate(picks):
        if "prompt_ids" in entry:
            ids.append([int(t) for t in entry["prompt_ids"]])
        elif "prompt" in entry:
            ids.append(encode_prompt(tokenizer, entry["prompt"]))
        else:
            raise ValueError(f"{path}: every line needs \"prompt\" or \"prompt_ids\"")
        names.append(str(entry.get("source", f"prompt {i}")))
    if any(not p for p in ids):
        raise ValueError(f"{path}: empty prompt")
    return ids, names


def chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[i:i + size] for i in range(0, len(items), size)]


# -- specdec --------------------------------------------------------------------------------------
class _RoundTally:
    """Adds up the RoundReports of a run: seconds in each worker, per-token acceptance, and the K
    asked of each request in each round that ran.

    A round that proposes k tokens and keeps a tests a + 1 of them when a < k (the first rejected
    one ends the round), a when a == k. accepted / tested is the per-token acceptance probability
    that the speedup formula assumes; accepted / proposed (the engine's acceptance rate) also counts
    the tokens after a rejection that were never tested, so it is lower.
    """

    def __init__(self):
        self.draft_seconds = self.verify_seconds = 0.0
        self.tested = self.accepted = self.rounds_without_draft = 0
        self.k_counts: Counter[int] = Counter()
        self.draft_steps = 0

    def __call__(self, report) -> None:
        self.draft_seconds += report.draft_seconds
        self.verify_seconds += report.verify_seconds
        if report.ran and report.updates:
            asked = [update.num_speculative_tokens for update in report.updates]
            self.k_counts.update(asked)
            self.draft_steps += max(asked)  # a batched drafter steps as often as the longest ask
        for update in report.updates:
            if update.proposed == 0:
                self.rounds_without_draft += int(report.ran)
                continue
            self.accepted += update.accepted
            self.tested += update.accepted + (1 if update.accepted < update.proposed else 0)


class EngineSystem:
    """A LocalEngine (plain, draft model or n-gram; K adaptive or fixed), timed per draft/verify call.

    Sampled requests carry no seed, like typical traffic: a seeded request's K follows a restricted
    rule (its own history only), so seeding them would not measure the adaptive policy that serves.
    """

    def __init__(self, key: str, target: str, draft: str | None, k: int, kv_cache_blocks: int,
                 max_batch_size: int, adaptive: bool = True, cpu_kernels: bool = True):
        from specdec.app.engine import LocalEngine

        self.key = key
        self.label = SYSTEMS[key].label
        self.k = k if draft is not None else None
        self.adaptive = adaptive if draft is not None else None
        self.engine = LocalEngine(target, draft=draft, num_speculative_tokens=k if draft else 0,
                                  adaptive=adaptive, kv_cache_blocks=kv_cache_blocks, max_batch_size=max_batch_size,
                                  cpu_kernels=cpu_kernels)

    def run(self, prompts: list[list[int]], batch: int, mode: Mode, max_new_tokens: int, seed: int,
            k: int | None = None, bar=None, prompt_set: str = "") -> RunResult:
        """`seed` is unused (sampled requests are unseeded, see the class); HFSystem.run takes it."""
        from specdec.params import SamplingParams

        k = self.k if k is None else k
        result = RunResult(system=self.key, label=self.label, batch=batch, mode=mode.name, k=k,
                           prompt_set=prompt_set, adaptive=self.adaptive, prompts=len(prompts))
        tally = self.engine.on_round = _RoundTally()
        proposed = accepted = rounds = draft_passes = generated = 0
        gc.collect()
        start = time.perf_counter()
        for group in chunks(prompts, batch):
            params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=mode.temperature, seed=None,
                                     ignore_eos=True)] * len(group)
            outputs = self.engine.generate(list(group), params, num_speculative_tokens=k if self.k is not None else 0)
            for out in outputs:
                result.outputs.append(list(out.token_ids))
                generated += len(out.token_ids)
                proposed += out.stats.proposed_tokens
                accepted += out.stats.accepted_tokens
                rounds += out.stats.target_forward_passes
                draft_passes += out.stats.draft_forward_passes
            if bar is not None:
                bar.update(sum(len(o.token_ids) for o in outputs))
        result.seconds = time.perf_counter() - start
        self.engine.on_round = None
        result.tokens = generated
        result.tokens_per_s = generated / result.seconds if result.seconds > 0 else None
        result.target_forward_passes = rounds
        result.mean_accepted_length = generated / rounds if rounds else None
        if self.k is not None:
            result.proposed, result.accepted, result.draft_forward_passes = proposed, accepted, draft_passes
            result.tested = tally.tested
            result.rounds_without_draft = tally.rounds_without_draft
            result.k_histogram = {str(n): tally.k_counts.get(n, 0) for n in range(max([k, *tally.k_counts]) + 1)}
            result.draft_steps = tally.draft_steps
            _speculation_rates(result)
        result.draft_seconds = tally.draft_seconds
        result.verify_seconds = tally.verify_seconds
        result.other_seconds = result.seconds - result.draft_seconds - result.verify_seconds
        return result

    def warm_up(self, prompts: list[list[int]], batch: int, mode: Mode, seed: int, k: int | None = None) -> None:
        self.run(prompts[:batch], batch, mode, max_new_tokens=8, seed=seed, k=k)


# -- Hugging Face ---------------------------------------------------------------------------------
class _CallCounter:
    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1


def load_hf(spec: str):
    """Hugging Face's model for a model spec: a checkpoint directory or Hub snapshot as it is; a
    .gguf file as a model built from its config with the weights specdec's loader dequantized
    (transformers' own GGUF loading needs accelerate, and this compares the same weights)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.model.source import resolve_model_source

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    source = resolve_model_source(spec)
    if source.kind != "gguf":
        return AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32,
                                                    local_files_only=True).eval()
    config = dict(source.config)
    if (config.get("rope_scaling") or {}).get("rope_type") == "frequency_factors":
        raise ValueError(f"{spec}: its rope_freqs (Llama 3 scaling) have no Hugging Face config to load them into")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                             dtype=torch.float32)
    missing, unexpected = model.load_state_dict(source.tensors(torch.float32), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set()):
        raise ValueError(f"{spec}: weights do not fit the Hugging Face model (missing {missing}, "
                         f"unexpected {unexpected})")
    return model.eval()


def left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


class HFSystem:
    """`model.generate` on the target, plain or with `assistant_model=draft` (batch 1 only)."""

    def __init__(self, key: str, target: str, draft: str | None, k: int, model=None):
        import transformers

        transformers.utils.logging.set_verbosity_error()
        self.key = key
        self.label = SYSTEMS[key].label
        self.model = model if model is not None else load_hf(target)
        self.counter = _CallCounter(self.model)
        self.assistant = None
        self.k = None
        if draft is not None:
            self.assistant = load_hf(draft)
            # Same draft length as specdec, fixed; HF keeps its own confidence-based early stop.
            self.assistant.generation_config.num_assistant_tokens = k
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
            self.assistant_counter = _CallCounter(self.assistant)
            self.k = k
        config = self.model.generation_config
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
        self.pad_id = int(pad) if pad is not None else 0

    def run(self, prompts: list[list[int]], batch: int, mode: Mode, max_new_tokens: int, seed: int,
            k: int | None = None, bar=None, prompt_set: str = "") -> RunResult:
        result = RunResult(system=self.key, label=self.label, batch=batch, mode=mode.name, k=self.k,
                           prompt_set=prompt_set, prompts=len(prompts))
        if self.assistant is not None and batch != 1:
            result.skipped = "HF assisted generation supports batch size 1 only"
            return result
        kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=self.pad_id)
        if mode.greedy:
            kwargs.update(do_sample=False)
        else:
            # No top-k/top-p: HF's default top_k=50 would make its sampling cheaper and different.
            kwargs.update(do_sample=True, temperature=mode.temperature, top_k=0, top_p=1.0)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
            self.assistant_counter.calls = 0
        self.counter.calls = 0
        generated = 0
        sequence_passes = 0  # target forward passes x sequences in them
        gc.collect()
        start = time.perf_counter()
        with torch.inference_mode():
            for offset, group in zip(range(0, len(prompts), batch), chunks(prompts, batch)):
                ids, mask = left_pad(group, self.pad_id)
                if not mode.greedy:
                    torch.manual_seed(seed + offset)
                calls_before = self.counter.calls
                out = self.model.generate(ids, attention_mask=mask, **kwargs)
                sequence_passes += (self.counter.calls - calls_before) * len(group)
                new = (out.shape[1] - ids.shape[1]) * len(group)
                result.outputs.extend(out[:, ids.shape[1]:].tolist())
                generated += new
                if bar is not None:
                    bar.update(new)
        result.seconds = time.perf_counter() - start
        result.tokens = generated
        result.tokens_per_s = generated / result.seconds if result.seconds > 0 else None
        result.target_forward_passes = self.counter.calls
        if self.assistant is not None:
            rounds = self.counter.calls
            result.mean_accepted_length = generated / rounds if rounds else None
            # HF does not report acceptance; estimate it: each assistant forward proposes one token,
            # each round commits its accepted tokens plus one of the target's.
            result.draft_forward_passes = self.assistant_counter.calls
            result.accepted = generated - rounds
            result.proposed = self.assistant_counter.calls
            result.acceptance_rate = result.accepted / result.proposed if result.proposed else None
            result.notes.append("acceptance estimated from forward-call counts (HF does not report it)")
        else:
            result.mean_accepted_length = generated / sequence_passes if sequence_passes else None
        return result

    def warm_up(self, prompts: list[list[int]], batch: int, mode: Mode, seed: int, k: int | None = None) -> None:
        if self.assistant is not None and batch != 1:
            return
        self.run(prompts[:batch], batch, mode, max_new_tokens=8, seed=seed)


# -- cost ratio c ---------------------------------------------------------------------------------
def _time_steps(runner, contexts: list[list[int]], steps: int, tokens_per_step: int = 1) -> float:
    """(median, min) seconds of one forward pass that feeds `tokens_per_step` tokens to every sequence
    (contexts already prefilled); the cache is rolled back after each pass so the context stays fixed."""
    ids = [f"bench-step-{i}" for i in range(len(contexts))]
    cache = runner.cache
    for seq_id in ids:
        cache.add_sequence(seq_id)
    try:
        runner.run(ids, [list(c) for c in contexts], [1] * len(ids))
        lengths = [cache.length(s) for s in ids]
        feed = [[c[-1]] * tokens_per_step for c in contexts]
        times: list[float] = []
        for step in range(steps + 3):
            t0 = time.perf_counter()
            runner.run(ids, feed, [tokens_per_step] * len(ids))
            elapsed = time.perf_counter() - t0
            for seq_id, length in zip(ids, lengths):
                cache.truncate_to(seq_id, length)
            if step >= 3:  # the first passes warm up allocator and caches
                times.append(elapsed)
        return statistics.median(times), min(times)
    finally:
        for seq_id in ids:
            cache.free_sequence(seq_id)


def measure_step_costs(target: str, draft: str | None, contexts_by_set: dict[str, list[list[int]]],
                       batch_sizes: Sequence[int], k: int, steps: int = 30, kv_cache_blocks: int = 256) -> dict:
    """Per-step seconds of the target and the draft in specdec's runtime, and c = draft / target,
    for each prompt set: {set name: {"steps_timed": ..., "by_batch": {"1": {...}, ...}}}.

    One decode step = one new token per sequence at the benchmark's context lengths (the set's
    prompts). Also the cost of a (K+1)-token verify pass relative to a 1-token step, which the
    formula assumes to be 1.
    """
    from specdec.config import WorkerConfig
    from specdec.model.runner import ModelRunner

    config = WorkerConfig(kv_cache_blocks=kv_cache_blocks)
    target_runner = ModelRunner.load(config, target)
    draft_runner = ModelRunner.load(config, draft) if draft else None
    by_set: dict = {}
    for name, contexts in contexts_by_set.items():
        out: dict = {"steps_timed": steps, "by_batch": {}}
        for b in batch_sizes:
            ctx = [contexts[i % len(contexts)] for i in range(b)]
            t_target, min_target = _time_steps(target_runner, ctx, steps)
            t_verify, min_verify = _time_steps(target_runner, ctx, steps, tokens_per_step=k + 1)
            entry = {"target_step_s": t_target, "target_verify_pass_s": t_verify,
                     "verify_pass_over_step": t_verify / t_target, "verify_tokens": k + 1,
                     "min_target_step_s": min_target, "min_target_verify_pass_s": min_verify}
            if draft_runner is not None:
                t_draft, min_draft = _time_steps(draft_runner, ctx, steps)
                entry.update(draft_step_s=t_draft, c=t_draft / t_target, min_draft_step_s=min_draft,
                             c_from_min=min_draft / min_target)
            out["by_batch"][str(b)] = entry
        by_set[name] = out
    return by_set
