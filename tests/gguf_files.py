"""GGUF files for tests, written by specdec_app.bench.gguf_export (the layout llama.cpp's
convert_hf_to_gguf.py writes: names from the gguf package's map, q/k rows permuted for Llama,
Llama 3 rope scaling as a `rope_freqs` tensor, norms and biases in F32) with every matrix in a
chosen tensor type (F32 where its rows do not fit that type's blocks, as llama.cpp falls back).

Each file comes with its *reference*: a Hugging Face checkpoint holding exactly the weights the
GGUF holds once dequantized, so transformers on the reference is the ground truth for the runtime
on the GGUF. Block quantization works row by row, and the q/k permutation only reorders rows, so
the reference is built in Hugging Face's row order with no inverse permutation of its own.

Q4_K and Q6_K, which the gguf package reads but cannot quantize, are written as random valid blocks
(random bits, with each block's float16 scales set small enough to give weights of a usual size).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM

from specdec_app.bench.gguf_export import export_gguf, llama_cpp_permute  # noqa: F401 (tests import it here)

# Byte offsets of the float16 scales in a block, and the range they are drawn from.
RANDOM_BLOCK_SCALES = {
    GGML.Q4_K: [(0, (1e-4, 3e-4)), (2, (1e-3, 4e-3))],  # d, dmin
    GGML.Q6_K: [(208, (2e-5, 6e-5))],  # d (after ql, qh and the 16 int8 scales)
}


def store(matrix: np.ndarray, qtype: GGML, rng: np.random.Generator) -> tuple[np.ndarray, GGML | None, np.ndarray]:
    """(what to write, its raw type or None for a plain float array, the float32 weights it holds)
    for an [out, in] float32 matrix stored as `qtype`."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == GGML.F32 or matrix.shape[1] % block_size:
        return matrix, None, matrix
    if qtype == GGML.F16:
        half = matrix.astype(np.float16)
        return half, None, half.astype(np.float32)
    if qtype in RANDOM_BLOCK_SCALES:
        blocks = rng.integers(0, 256, size=(matrix.shape[0] * matrix.shape[1] // block_size, block_bytes),
                              dtype=np.uint8)
        for offset, (low, high) in RANDOM_BLOCK_SCALES[qtype]:
            scales = rng.uniform(low, high, size=blocks.shape[0]).astype(np.float16)
            blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
        data = blocks.reshape(matrix.shape[0], -1)
    else:
        data = quantize(matrix, qtype)
    return data, qtype, dequantize(data, qtype).reshape(matrix.shape).astype(np.float32)


def write_gguf(hf_dir: Path, gguf_path: Path, reference_dir: Path, tensor_type: str = "F32", tokenizer=None,
               chat_template: str | None = None, seed: int = 0) -> Path:
    """Write the checkpoint at hf_dir as gguf_path, its matrices as `tensor_type`, and the reference
    checkpoint to reference_dir; returns gguf_path."""
    qtype = GGML[tensor_type]
    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    reference = {name: tensor.float() for name, tensor in model.state_dict().items() if tensor.dim() == 1}

    def store_and_record(name: str, matrix: np.ndarray):
        data, raw_type, held = store(matrix, qtype, rng)
        reference[name] = torch.from_numpy(held.copy())
        return data, raw_type

    export_gguf(model, gguf_path, store_and_record, tokenizer, chat_template)
    model.load_state_dict(reference, strict=False)  # a tied head follows the embedding
    model.save_pretrained(reference_dir)
    return gguf_path
