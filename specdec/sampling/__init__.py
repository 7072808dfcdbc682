"""Pure, batched sampling math: logits transforms, per-request randomness, speculative verify."""
from specdec.sampling.random import draw_uniforms, make_generator
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
    sparsify_probs,
)

__all__ = [
    "BatchSamplingParams",
    "apply_repetition_penalty",
    "draw_uniforms",
    "make_generator",
    "presence_for_positions",
    "presence_mask",
    "probs_from_logits",
    "sample_from_probs",
    "sparsify_probs",
    "speculative_step_distribution",
    "speculative_verify",
]
