"""Write a Hugging Face checkpoint as a llama.cpp GGUF file, the way llama.cpp's convert_hf_to_gguf.py
writes it, so that specdec and llama.cpp can be measured on the same file (`specdec bench-peer`).

What the converter does and this repeats: tensor names from the gguf package's name map; q/k rows
of Llama-architecture models permuted to the interleaved rotary pairs ggml's rotation wants
(`llama_cpp_permute`); norms and biases in F32, every matrix in the chosen tensor type (F32 where
its rows do not fit that type's blocks, as llama.cpp falls back); a byte-level BPE tokenizer as
`_set_vocab_gpt2` writes it, padded with unused tokens up to the embedding's rows; Llama 3 rope
scaling as the `rope_freqs` tensor of per-frequency divisors.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
             "qwen3": gguf.MODEL_ARCH.QWEN3}


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


def tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer, pre: str = "default", vocab_size: int | None = None) -> None:
    """A byte-level BPE tokenizer (a transformers fast tokenizer) as llama.cpp's `_set_vocab_gpt2`
    writes it: tokens in id order (then unused ones up to vocab_size), added special tokens marked
    CONTROL, the merges, bos/eos."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in state["added_tokens"] if t["special"]}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    padding = max(0, (vocab_size or 0) - len(tokens))
    tokens += [f"[unused{i}]" for i in range(padding)]
    types += [gguf.TokenType.UNUSED] * padding
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)


def export_gguf(model, path: Path, store, tokenizer=None, chat_template: str | None = None,
                pre: str | None = None) -> Path:
    """Write `model` (a transformers causal LM) to `path`; `store(name, [out, in] float32 array)`
    returns (data, raw GGML type or None for a float array) for each matrix. pre: the tokenizer's
    pre-tokenizer name (default: the model type)."""
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"specdec-{config.model_type}")
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
        tokenizer_metadata(writer, tokenizer, pre=pre or config.model_type, vocab_size=config.vocab_size)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for hf_name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        array = tensor.float().numpy()
        data, raw_type = store(hf_name, array) if array.ndim == 2 else (array, None)
        if arch == gguf.MODEL_ARCH.LLAMA and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, kv_heads)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name!r}")
        writer.add_tensor(gguf_name, np.ascontiguousarray(data), raw_shape=data.shape if raw_type else None,
                          raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantizing_store(tensor_type: str):
    """The `store` of export_gguf for one GGUF tensor type the gguf package can write (F32, F16,
    Q8_0, Q4_0, Q4_1, ...)."""
    qtype = gguf.GGMLQuantizationType[tensor_type]

    def store(name: str, matrix: np.ndarray):
        block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
        if qtype == gguf.GGMLQuantizationType.F32 or matrix.shape[1] % block_size:
            return matrix, None
        if qtype == gguf.GGMLQuantizationType.F16:
            return matrix.astype(np.float16), None
        return gguf.quants.quantize(matrix, qtype), qtype

    return store
