"""GGUF files written from Hugging Face checkpoints the way llama.cpp's convert_hf_to_gguf.py writes
them, for tests: tensor names from the gguf package's own name map, q/k rows permuted for Llama
(`LlamaModel.permute`), Llama 3 rope scaling as a `rope_freqs` tensor, norms and biases in F32 and
every matrix in a chosen tensor type (F32 where its rows do not fit that type's blocks, as
llama.cpp falls back).

Each file comes with its *reference*: a Hugging Face checkpoint holding exactly the weights the
GGUF holds once dequantized, so transformers on the reference is the ground truth for the runtime
on the GGUF. Block quantization works row by row, and the q/k permutation only reorders rows, so
the reference is built in Hugging Face's row order with no inverse permutation of its own.

Q4_K and Q6_K, which the gguf package reads but cannot quantize, are written as random valid blocks
(random bits, with each block's float16 scales set small enough to give weights of a usual size).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM

GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
             "qwen3": gguf.MODEL_ARCH.QWEN3}
# Byte offsets of the float16 scales in a block, and the range they are drawn from.
RANDOM_BLOCK_SCALES = {
    GGML.Q4_K: [(0, (1e-4, 3e-4)), (2, (1e-3, 4e-3))],  # d, dmin
    GGML.Q6_K: [(208, (2e-5, 6e-5))],  # d (after ql, qh and the 16 int8 scales)
}


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, on any array of rows (floats or quantized bytes)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: the rope_freqs of Llama 3 scaling."""
    scaling = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (scaling["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


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


def tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer, pre: str = "default") -> None:
    """A byte-level BPE tokenizer (a transformers fast tokenizer) as llama.cpp's `_set_vocab_gpt2`
    writes it: tokens in id order, added special tokens marked CONTROL, the merges, bos/eos."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in state["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)


def write_gguf(hf_dir: Path, gguf_path: Path, reference_dir: Path, tensor_type: str = "F32", tokenizer=None,
               chat_template: str | None = None, seed: int = 0) -> Path:
    """Write the checkpoint at hf_dir as gguf_path, its matrices as `tensor_type`, and the reference
    checkpoint to reference_dir; returns gguf_path."""
    qtype = GGML[tensor_type]
    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    config = model.config
    family = config.model_type
    arch = GGUF_ARCH[family]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    writer = gguf.GGUFWriter(str(gguf_path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny-{family}")
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(config))
    if tokenizer is not None:
        tokenizer_metadata(writer, tokenizer, pre=family)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    reference = {}
    tied = config.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        array = tensor.float().numpy()
        if array.ndim == 2:
            data, raw_type, held = store(array, qtype, rng)
        else:
            data, raw_type, held = array, None, array
        reference[hf_name] = torch.from_numpy(held.copy())
        if arch == gguf.MODEL_ARCH.LLAMA and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, kv_heads)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        writer.add_tensor(gguf_name, np.ascontiguousarray(data), raw_shape=data.shape if raw_type else None,
                          raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    model.load_state_dict(reference, strict=False)  # a tied head follows the embedding
    model.save_pretrained(reference_dir)
    return gguf_path
