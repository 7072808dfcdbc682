"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: config.json fields from its metadata,
tensors by Hugging Face name, the tokenizer and the chat template it carries.

Terms. GGUF *metadata* is the file's key/value header (`general.architecture`, `llama.block_count`,
`tokenizer.ggml.tokens`, ...). A *tensor type* is how a tensor's numbers are stored: F32, F16,
BF16 or a block quantization (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...: blocks of 32 or 256 numbers
sharing scales). GGUF lists a tensor's shape innermost first (ggml's ne0, ne1); its rows are a
PyTorch [out, in] matrix's rows, so a dequantized tensor is already in Hugging Face's layout.

Two things differ from a Hugging Face checkpoint beyond names:
- llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`) reorders the rows of q_proj
  and k_proj (weights and biases) of Llama-architecture models, Mistral included, from Hugging
  Face's rotate-half layout to the interleaved pairs ggml's rotation wants: within each head, rows
  [first half | second half] become [h0, h0', h1, h1', ...]. `unpermute_rows` undoes that. Qwen2
  and Qwen3 files are written unpermuted (their ggml rotation is the rotate-half one).
- Llama 3's rope scaling is stored as the per-frequency divisors it implies (a `rope_freqs`
  tensor), not as its settings; the config carries them as rope_scaling "frequency_factors".

Quantized tensors are either kept as codes (`keep_quantized`: specdec.model.quantized, exactly
for Q8_0, Q4_0 and Q4_1) or dequantized by gguf.quants.dequantize to float32, then the compute dtype.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, Keys
from gguf.quants import dequantize

from specdec.model.quantized import FORMAT_OF_GGUF_TYPE, QuantizedMatrix, from_gguf_blocks, quantize

# GGUF architecture -> Hugging Face model_type. llama.cpp writes Mistral models as "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose q/k rows llama.cpp's converter permutes.
PERMUTED_QK = ("llama",)

# GGUF tensor name -> Hugging Face name; a per-layer name has "blk.{i}." / "model.layers.{i}." before it.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}" for g, h in
       (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 rope scaling, read into the config


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for one this runtime does not know (a
    tensor silently skipped would make the output wrong)."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"unexpected tensor {name!r} in the GGUF file (this runtime maps "
                     f"{', '.join(GLOBAL_TENSORS)} and blk.N.{{{', '.join(LAYER_TENSORS)}}})")


def decimal_float32(value: float) -> float:
    """A float32 metadata value as the decimal it was most likely written from: the shortest one
    that rounds to it (1e-06, not 9.99999997e-07), as in the config.json it was converted from."""
    return float(str(np.float32(value)))


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute(w, n_head)`: rows [num_heads * D, ...] (a q/k weight or
    bias) from interleaved rotary pairs back to Hugging Face's two halves per head."""
    shape = rows.shape
    return rows.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class GGUFModelFile:
    """One GGUF file, its metadata parsed once (tensor data is memory-mapped, read on demand)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self.architecture = ""  # `value` formats {arch} with it
        self.architecture = str(self.value(Keys.General.ARCHITECTURE))
        self._tensors = {t.name: t for t in self.reader.tensors}
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {self.architecture!r}: specdec runs "
                             f"{', '.join(ARCHITECTURES)} (Mistral files are 'llama')")

    def value(self, key: str, default=None):
        """A metadata value (key may hold {arch}), or `default` when the file lacks it."""
        field = self.reader.get_field(key.format(arch=self.architecture))
        return default if field is None else field.contents()

    def _required(self, key: str):
        value = self.value(key)
        if value is None:
            raise ValueError(f"{self.path} lacks the metadata key {key.format(arch=self.architecture)!r}")
        if isinstance(value, list):  # a per-layer list: this runtime needs every layer alike
            if len(set(value)) != 1:
                raise ValueError(f"{key.format(arch=self.architecture)} differs between layers ({value}): "
                                 "not supported")
            value = value[0]
        return value

    def config(self) -> dict:
        """The file's hyper-parameters as Hugging Face config.json fields."""
        heads = int(self._required(Keys.Attention.HEAD_COUNT))
        hidden = int(self._required(Keys.LLM.EMBEDDING_LENGTH))
        head_dim = int(self.value(Keys.Attention.KEY_LENGTH) or hidden // heads)
        value_dim = int(self.value(Keys.Attention.VALUE_LENGTH) or head_dim)
        rope_dim = int(self.value(Keys.Rope.DIMENSION_COUNT) or head_dim)
        if value_dim != head_dim or rope_dim != head_dim:
            raise ValueError(f"{self.path}: key length {head_dim}, value length {value_dim} and rotary dimensions "
                             f"{rope_dim} differ: not supported")
        context = int(self._required(Keys.LLM.CONTEXT_LENGTH))
        model_type = ARCHITECTURES[self.architecture]
        config = {
            "model_type": model_type,
            "vocab_size": int(self._tensors["token_embd.weight"].shape[1]),
            "hidden_size": hidden,
            "intermediate_size": int(self._required(Keys.LLM.FEED_FORWARD_LENGTH)),
            "num_hidden_layers": int(self._required(Keys.LLM.BLOCK_COUNT)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.value(Keys.Attention.HEAD_COUNT_KV) or heads),
            "head_dim": head_dim,
            "max_position_embeddings": context,
            "rms_norm_eps": decimal_float32(self._required(Keys.Attention.LAYERNORM_RMS_EPS)),
            "rope_theta": decimal_float32(self.value(Keys.Rope.FREQ_BASE, 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "mlp_bias": "blk.0.ffn_gate.bias" in self._tensors,
            "hidden_act": "silu",
            "bos_token_id": self.value(Keys.Tokenizer.BOS_ID),
            "eos_token_id": self._eos_token_ids(),
        }
        window = self.value(Keys.Attention.SLIDING_WINDOW)
        if window is not None and model_type == "llama":  # Mistral with a sliding window
            config.update(model_type="mistral", sliding_window=int(window))
        return config

    def _rope_scaling(self) -> dict | None:
        kind = self.value(Keys.Rope.SCALING_TYPE)
        if ROPE_FREQS in self._tensors:
            if kind not in (None, "none"):
                raise ValueError(f"{self.path}: rope_freqs together with rope scaling {kind!r} is not supported")
            return {"rope_type": "frequency_factors", "factors": self._numpy(ROPE_FREQS).reshape(-1).tolist()}
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": decimal_float32(self._required(Keys.Rope.SCALING_FACTOR))}
        raise ValueError(f"{self.path}: unsupported rope scaling {kind!r} (supported: none, linear, Llama 3's "
                         "rope_freqs)")

    def _eos_token_ids(self) -> list[int]:
        """End-of-sequence, end-of-turn and end-of-message ids: any of them ends a generation
        (Hugging Face's generation_config lists them all for chat models)."""
        ids = [self.value(key) for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def _numpy(self, name: str) -> np.ndarray:
        """A tensor as float32 in PyTorch's layout (dequantized if need be)."""
        tensor = self._tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return np.array(tensor.data, dtype=np.float32).reshape(shape)  # a copy: the data is memory-mapped
        try:
            return dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: tensor {name} has type {tensor.tensor_type.name}, which the gguf "
                             f"package cannot dequantize") from e

    def _quantized(self, name: str) -> QuantizedMatrix | None:
        """A quantized matrix as codes (module docstring), or None for a float or 1-D tensor."""
        tensor = self._tensors[name]
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16", "BF16", "F64") or len(tensor.shape) != 2:
            return None
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))
        return from_gguf_blocks(tensor.data, kind, shape) or quantize(torch.from_numpy(self._numpy(name)),
                                                                      FORMAT_OF_GGUF_TYPE.get(kind, 8))

    def tensors(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                keep_quantized: bool = False) -> dict[str, torch.Tensor | QuantizedMatrix]:
        """Every weight by Hugging Face name, converted one at a time (so only one float32 copy
        exists at once), q/k rows restored to Hugging Face's order. keep_quantized: quantized
        matrices as codes (on the CPU) instead of dequantized."""
        heads = int(self._required(Keys.Attention.HEAD_COUNT))
        kv_heads = int(self.value(Keys.Attention.HEAD_COUNT_KV) or heads)
        permuted = self.architecture in PERMUTED_QK
        out: dict[str, torch.Tensor | QuantizedMatrix] = {}
        for name in self._tensors:
            if name == ROPE_FREQS:
                continue
            hf_name = hf_tensor_name(name)
            matrix = self._quantized(name) if keep_quantized else None
            tensor = matrix if matrix is not None else torch.from_numpy(self._numpy(name))
            for marker, count in ((".attn_q.", heads), (".attn_k.", kv_heads)):
                if permuted and marker in name:
                    order = unpermute_rows(torch.arange(tensor.shape[0]), count)
                    tensor = tensor.rows(order) if matrix is not None else tensor[order]
            out[hf_name] = tensor if matrix is not None else tensor.to(device=device, dtype=dtype)
        return out

    @property
    def chat_template(self) -> str | None:
        template = self.value(Keys.Tokenizer.CHAT_TEMPLATE)
        return str(template) if template is not None else None

    def tokenizer(self):
        """The tokenizer in the metadata, built by transformers' GGUF support, with the chat
        template set; None when the file has no tokenizer."""
        if self.value(Keys.Tokenizer.MODEL) is None:
            return None
        from transformers import AutoTokenizer  # deferred: heavy (~0.6 s), and only tokenizers need it

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                      local_files_only=True)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"cannot build the tokenizer stored in {self.path}: {e}") from e
        tokenizer.chat_template = self.chat_template
        return tokenizer
