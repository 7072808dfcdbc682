"""llama.cpp (through llama-cpp-python, an optional extra) as a benchmarked system beside specdec.

It gets what specdec gets: the same GGUF file, the same token-id prompts (no tokenizer in between),
greedy decoding of exactly max_new_tokens (EOS never ends a run early), the same threads, the KV
cache cleared before each run (so the prompt is evaluated every time, as specdec evaluates it), and
one warm-up call. `lookup` > 0 runs llama-cpp-python's prompt-lookup drafter proposing that many
tokens (its `LlamaPromptLookupDecoding`). specdec runs as a LocalEngine beside it, timed the same
way. Two rates: request tokens/s (generated tokens / wall-clock seconds of the whole call, prompt
included) and decode tokens/s (tokens after the first / seconds after the first token came: the
rate of decoding itself, which the prompt's evaluation does not touch).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version where it is installed, else None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "unknown")


_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), n_batch=512, verbose=False)
for i, _ in enumerate(llm.generate([1, 2, 3, 4, 5, 6, 7, 8], top_k=1, temp=0.0)):
    if i == 2:
        break
"""


def llama_cpp_failure(gguf_path: str, threads: int, timeout_s: float = 300.0) -> str | None:
    """Why llama.cpp cannot decode gguf_path here (None: it can), found in a child process: a
    llama.cpp built for this CPU may still die on it (seen: its AMX kernels' SIGILL in a VM that
    offers AMX), which would take specdec's measurements down with it."""
    try:
        child = subprocess.run([sys.executable, "-c", _PROBE, gguf_path, str(threads)], capture_output=True,
                               text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"it did not decode 3 tokens in {timeout_s:.0f} s"
    if child.returncode < 0:
        return f"it died of {signal.Signals(-child.returncode).name} decoding 3 tokens"
    if child.returncode:
        last = (child.stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        return f"it failed decoding 3 tokens: {last}"
    return None


@dataclass
class PeerResult:
    """One timed call of a batch of requests (all started together)."""

    tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: float = 0.0  # until every request's first token
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def request_tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.tokens - len(self.outputs)) / (self.seconds - self.first_token_seconds)


class SpecdecSystem:
    """specdec's LocalEngine (plain, or a drafter with adaptive K), timed like LlamaCppSystem."""

    def __init__(self, gguf_path: str, draft: str | None, kv_cache_blocks: int, max_batch_size: int,
                 kv_cache_dtype: str = "auto"):
        from specdec_app.engine import LocalEngine

        self.engine = LocalEngine(gguf_path, draft=draft, kv_cache_blocks=kv_cache_blocks,
                                  max_batch_size=max_batch_size, kv_cache_dtype=kv_cache_dtype)

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> PeerResult:
        from specdec.params import SamplingParams

        result = PeerResult()
        start = time.perf_counter()

        def on_round(report) -> None:  # the batch's prompts share one pass: its end is every first token
            if not result.first_token_seconds and any(u.token_ids for u in report.updates):
                result.first_token_seconds = time.perf_counter() - start

        self.engine.on_round = on_round
        outputs = self.engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        result.seconds = time.perf_counter() - start
        self.engine.on_round = None
        result.outputs = [list(o.token_ids) for o in outputs]
        result.tokens = sum(len(o) for o in result.outputs)
        return result

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.run(prompts, 8)


class LlamaCppSystem:
    """One llama.cpp model at batch 1, plain (lookup 0) or with prompt lookup."""

    def __init__(self, gguf_path: str, threads: int, context: int, lookup: int = 0):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.lookup = lookup
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        self.llm = Llama(model_path=gguf_path, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, draft_model=draft, verbose=False)

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> PeerResult:
        if len(prompts) != 1:
            raise ValueError("llama-cpp-python's Llama decodes one sequence at a time")
        result = PeerResult()
        start = time.perf_counter()
        for prompt in prompts:
            self.llm.reset()  # no prefix reuse between runs: the prompt is evaluated every time
            out: list[int] = []
            for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                out.append(int(token))
                if len(out) == 1:
                    result.first_token_seconds = time.perf_counter() - start
                if len(out) == max_new_tokens:
                    break
            result.outputs.append(out)
            result.tokens += len(out)
        result.seconds = time.perf_counter() - start
        return result

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.run(prompts[:1], 8)
