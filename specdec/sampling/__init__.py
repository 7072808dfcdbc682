"""Pure, batched sampling math: logits transforms, per-request randomness, speculative verify."""
from specdec.sampling.random import ACCEPT, DRAFT, TARGET, random_seed, stream_key, uniforms
from specdec.sampling.speculative import (
    sample_from_probs,
    speculative_step_distribution,
    speculative_verify,
)
from specdec.sampling.transforms import (
    BatchSamplingParams,
    apply_repetition_penalty,
    presence_for_positions,
    presence_mask,
    probs_from_logits,
    top_entries,
)

__all__ = [
    "ACCEPT",
    "DRAFT",
    "TARGET",
    "BatchSamplingParams",
    "apply_repetition_penalty",
    "presence_for_positions",
    "presence_mask",
    "probs_from_logits",
    "random_seed",
    "sample_from_probs",
    "speculative_step_distribution",
    "speculative_verify",
    "stream_key",
    "top_entries",
    "uniforms",
]
