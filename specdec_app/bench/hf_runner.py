"""Hugging Face `generate` as a benchmarked system (plain, or assisted by the draft at batch 1),
timed on the same token-id prompts as specdec, with its forward calls counted.

transformers is imported where a Hugging Face model is loaded, not with the module: the specdec
systems and `specdec bench --help` do without it.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import torch

from specdec.model.source import resolve_model_source
from specdec_app.bench.prompts import chunks
from specdec_app.bench.results import SYSTEMS, Mode, RunResult


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
    import transformers  # (see the module's docstring)
    from transformers import AutoConfig, AutoModelForCausalLM

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
        import transformers  # (see the module's docstring)

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
