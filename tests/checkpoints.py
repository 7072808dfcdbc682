"""Random checkpoints in Hugging Face layout, of every model family the runtime supports, built on
the fly for tests."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from specdec.sampling.tree import side_branch_depth

# family -> (transformers config class, model class)
FAMILY_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}

# Several Llama shapes the runtime must get exactly right. initializer_range is large so logits are
# peaked: greedy comparisons then do not hinge on float rounding between near-equal logits.
CONFIGS: dict[str, dict] = {
    "gqa_untied": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(vocab_size=280, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=False,
                        rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}

# The other families, each with what sets it apart (family= picks the transformers classes).
FAMILY_CONFIGS: dict[str, dict] = {
    # q/k/v biases (set to non-zero values by build_checkpoint: transformers starts them at zero).
    "qwen2_untied": dict(family="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         rope_theta=1000000.0),
    "qwen2_tied": dict(family="qwen2", vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True),
    # Per-head q/k RMSNorm, head_dim 32 != hidden 64 / 4 heads, tied embeddings.
    "qwen3_tied": dict(family="qwen3", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    # Qwen3 with attention_bias: q/k/v and o_proj biases too.
    "qwen3_bias": dict(family="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=24, tie_word_embeddings=False,
                       attention_bias=True),
    # No sliding window (transformers' default would slide over 4096 of 131072 positions).
    "mistral": dict(family="mistral", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None),
}


def hf_config(family: str = "llama", max_position_embeddings: int = 256, eos_token_id=None,
              initializer_range: float = 0.2, **overrides):
    config_class, _ = FAMILY_CLASSES[family]
    return config_class(max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
                        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None, **overrides)


def build_checkpoint(path: Path, seed: int = 0, family: str = "llama", **settings) -> Path:
    """A random checkpoint of `family`; every bias gets random non-zero values, so a runtime that
    dropped one would disagree."""
    torch.manual_seed(seed)
    _, model_class = FAMILY_CLASSES[family]
    model = model_class(hf_config(family, **settings)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """A draft that agrees with the target often but not always (exercises both paths)."""
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    model.save_pretrained(dst)
    return dst


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class JumpingK:
    """A stand-in speculation policy whose K jumps between 0 and each request's cap from round to
    round (a deterministic function of the request id and its round number): the harshest case
    for exactness, since every round decides its tokens with a different K. Seeded requests get
    the same K sequence wherever they run, as the real policy guarantees. With `branches` > 1 the
    tree's shape jumps too: a chain, or the other root children 1 to side_depth deep (0: K)."""

    def __init__(self, salt: int = 0, branches: int = 1, side_depth: int = 0):
        self.salt, self.branches, self.side_depth = salt, branches, side_depth
        self.rounds: dict[str, int] = {}
        self.chosen: list[int] = []
        self.shapes: dict[str, tuple[int, int]] = {}

    def choose(self, requests) -> list[int]:
        ks = []
        for r in requests:
            n = self.rounds.get(r.req_id, 0)
            self.rounds[r.req_id] = n + 1
            h = (sum(map(ord, r.req_id)) * 7919 + n * 104729 + self.salt) % 1000003
            ks.append(0 if h % 3 == 0 else h % (r.cap + 1))
            side = (h // 7) % (side_branch_depth(ks[-1], self.side_depth) + 1) if self.branches > 1 else 0
            self.shapes[r.req_id] = (self.branches, side) if side else (1, 0)
        self.chosen += ks
        return ks

    def tree_shape(self, req_id: str) -> tuple[int, int]:
        return self.shapes.get(req_id, (1, 0))

    def settled(self, req_ids) -> bool:
        return False  # (every round chooses)

    def observe(self, report, greedy) -> None:
        pass

    def forget(self, req_id: str) -> None:
        self.rounds.pop(req_id, None)


def fixed_cost_policy(coefficients: tuple[float, ...], branches: int = 1, side_depth: int = 0):
    """The real speculation policy on fixed round costs (RoundCosts.coefficients' order: v0, v1, v2,
    d0, d1, d2, d3, overhead; a round with trees costing no more), not learnt from timings: what
    it chooses then depends on the tokens alone, never on how fast the machine running the test
    is (branches, side_depth: the widest tree it may draw)."""
    from coordinator.speculation.round_costs import RoundCosts
    from coordinator.speculation.speculation_policy import SpeculationPolicy

    class FixedCosts(RoundCosts):
        rounds_seen = 1e9

        def coefficients(self, solve: bool = True):
            return (*coefficients, 0.0)

        def observe(self, *args, **kwargs):
            pass

    return SpeculationPolicy(FixedCosts(max_fed=64, max_steps=8), 0.05, branches, side_depth)


def cheap_drafting_policy(branches: int = 1, side_depth: int = 0):
    """Drafting cheap (a verified token 5% of a pass, a draft step 5%), so that the policy does
    speculate with tiny test models (whose draft and target steps cost about the same) and moves
    K with each request's acceptance."""
    return fixed_cost_policy((1.0, 0.05, 0.0, 0.02, 0.05, 0.0, 0.001, 0.0), branches, side_depth)


def self_draft_weights(drafter: str | None) -> dict:
    """LocalEngine settings for `drafter`: the target drafting for itself ("self") keeps its floats
    (a draft's default is q8 on CPU), so it proposes the target's own tokens, always accepted."""
    return {"draft_weights": "fp"} if drafter == "self" else {}


def use_policy(engine, policy: str):
    """"fixed": always the cap; "jumping": JumpingK; "adaptive": the real policy, drafting cheap."""
    config = engine.scheduler.config
    if policy == "jumping":
        engine.scheduler.policy = JumpingK(branches=config.tree_branches, side_depth=config.tree_side_depth)
    elif policy == "adaptive":
        engine.scheduler.policy = cheap_drafting_policy(config.tree_branches, config.tree_side_depth)
    elif policy != "fixed":
        raise ValueError(policy)
    return engine


# A minimal chat template: "role: content" lines, then the assistant's turn opened.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def add_chat_template(path: Path, template: str = CHAT_TEMPLATE) -> Path:
    """Give the tokenizer saved in `path` a chat template (saved beside it, as transformers does)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


class PreDraftAlways:
    """A pre-draft gate that admits every request every round, so tests exercise overlapped
    rounds whatever the hit rate (the real gate turns pre-drafts off where they rarely pay)."""

    def select(self, candidates: list[tuple[str, bool, bool]]) -> set[str]:
        return {req_id for req_id, _, _ in candidates}

    def observe(self, req_id: str, greedy: bool, hit: bool) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass


def predraft_always(scheduler):
    """Every request pre-drafted every round, where the scheduler overlaps drafting at all."""
    if scheduler.predrafting is not None:
        scheduler.predrafting.gate = PreDraftAlways()
    return scheduler


class SlowWorker:
    """A worker client that sleeps a random 0-10 ms before each call (timing must not change
    what a seeded request gets)."""

    def __init__(self, inner, rng, method: str):
        self.inner, self.rng, self.method = inner, rng, method

    def info(self):
        return self.inner.info()

    def __getattr__(self, name):
        call = getattr(self.inner, name)

        def delayed(*args, **kwargs):
            time.sleep(self.rng.uniform(0, 0.01))
            return call(*args, **kwargs)

        return delayed
