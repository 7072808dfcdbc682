"""A lean forward pass over a paged KV cache for the Llama family of architectures (Llama, Mistral,
Qwen2, Qwen3: see specdec.model.config for what sets them apart).

Hugging Face's modules are built for training and generality; per decode step they cost several
milliseconds of Python on a CPU. This runtime keeps only what inference needs: fused QKV and
gate/up products against [in, out] weights, a precomputed rotary table applied to q and k at once,
one attention mask per pass, K/V written straight into cache blocks, and logits computed only for
the positions the caller asks for. Each eager op costs ~10-30 us of framework time on a small CPU,
so op count matters as much as FLOPs for the draft model. On CPU in float32 every pass runs in
specdec's C kernels instead (model.kernel_forward): fewer calls, and a fixed order of arithmetic
that gives a token the same logits in any pass (batch-invariant). On CUDA with Triton a pass runs
in model.gpu_forward (four Triton kernels per layer around the products), or for Qwen3's per-head
norms this torch path with Triton's attention; the torch path with torch's attention serves
other dtypes on the CPU and machines without a C compiler.
"""
from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from specdec.kv_cache import PagedKVCache
from specdec.model.attention import attention_mask, paged_attention, write_kv
from specdec.model.batch import ForwardBatch
from specdec.model.config import ModelConfig
from specdec.model.cpu_kernels import load_cpu_kernels
from specdec.model.kernel_forward import kernel_forward, kernel_forward_fits
from specdec.model.quantized import CODE_BITS, QuantizedMatrix
from specdec.model.rope import RotaryTable
from specdec.model.source import resolve_model_source
from specdec.model.weights import ModelWeights, build_weights
from specdec.role_configs import KV_CACHE_DTYPES, WEIGHT_FORMATS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tests only: "1" lets bfloat16/float16 models run on the CPU (torch's ops), so that the half
# precision code a GPU runs is executed somewhere in CI.
CPU_HALF_PRECISION_ENV = "SPECDEC_TEST_CPU_HALF_PRECISION"
# Which attention a torch-path model runs: "triton" (model.triton_attention; the default on CUDA
# where Triton is installed) or "torch" (model.attention; the default elsewhere). Tests set
# "triton" on the CPU under TRITON_INTERPRET=1 to run the GPU's kernel here.
ATTENTION_ENV = "SPECDEC_ATTENTION"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def attention_backend(device: torch.device) -> str:
    chosen = os.environ.get(ATTENTION_ENV) or ("triton" if device.type == "cuda" and triton_available() else "torch")
    if chosen not in ("triton", "torch"):
        raise ValueError(f"{ATTENTION_ENV}={chosen!r}: choose triton or torch")
    if chosen == "triton" and not triton_available():
        raise ValueError(f"{ATTENTION_ENV}=triton but Triton is not installed")
    return chosen


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), normalised in float32 like the reference whatever the storage dtype
    (F.rms_norm gives bit-identical float32 results in one op instead of five)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def head_norm(qk: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's q_norm and k_norm at once: qk [T, H + Hkv, D], weight [H + Hkv, D] (each head's
    norm weight); normalised over D in float32 like the reference, then scaled (two ops for all
    heads instead of two norms)."""
    if qk.dtype == torch.float32:
        return F.rms_norm(qk, weight.shape[-1:], None, eps) * weight
    return weight * F.rms_norm(qk.float(), weight.shape[-1:], None, eps).to(qk.dtype)


class Model:
    """A loaded checkpoint: its config, its fused weights and the rotary table, on one device;
    `kernels`: specdec's C kernels (model.cpu_kernels) for a float32 CPU model, or None;
    `kv_dtype`: what its KV caches hold (default: `dtype`)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, kernels=None, kv_dtype: torch.dtype | None = None):
        self.config = config
        self.kernels = kernels
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.rotary = RotaryTable(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                  config.rope_scaling, self.device, dtype)
        self.scale = config.head_dim ** -0.5
        # the C kernels' table of the layers' weights (model.kernel_forward), built once
        self.layer_table = kernels.layer_table(weights.layers) if kernels is not None else None
        self._q_size = config.num_attention_heads * config.head_dim
        self._kv_size = config.num_key_value_heads * config.head_dim
        self.attention = attention_backend(self.device)
        # Whole passes in model.gpu_forward's kernels: with Triton's attention, for layers without
        # per-head q/k norms (Qwen3's run this module's torch path with Triton's attention).
        self.fused_ops = False
        if self.attention == "triton" and weights.layers[0].qk_norm is None:
            from specdec.model import triton_ops  # (Triton is imported only by a model that runs it)
            self.fused_ops = triton_ops.fused_ops_fit(config.head_dim)

    @property
    def num_parameters(self) -> int:
        return self.weights.num_parameters

    @property
    def quantized(self) -> bool:
        """Whether any projection is held only as codes (model.quantized)."""
        return any(p.weight is None for p in (self.weights.lm_head, *self.weights.layers[0].projections()))

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        c = self.config
        return PagedKVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads,
                            c.head_dim, self.device, self.kv_dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run the new tokens of `batch` (already given slots in `cache`); return float32 logits
        [M, vocab] for batch.logits_indices."""
        if self.kernels is not None and kernel_forward_fits(batch, self.rotary.cos.shape[0]):
            return kernel_forward(self, batch, cache)
        if batch.context_len > self.rotary.cos.shape[0]:  # (a GPU would fault on the lookup, not raise)
            raise ValueError(f"positions beyond the model's {self.rotary.cos.shape[0]}")
        if self.quantized and self.weights.lm_head.device_codes is None:  # the C kernels' codes
            raise ValueError("weights held as codes in the C kernels' panels run in those kernels only")
        # Token trees attend through per-node rows of keys, which Triton's kernels do not read.
        if self.fused_ops and not batch.has_tree:
            from specdec.model.gpu_forward import gpu_forward
            return gpu_forward(self, batch, cache)
        c = self.config
        x = self.weights.embed_rows(batch.input_ids)
        num_tokens = x.shape[0]
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        cos, sin = self.rotary.lookup(batch.positions)
        paged = self.attention == "triton" and not batch.has_tree
        mask = None if paged else attention_mask(batch)  # the same for every layer
        for index, layer in enumerate(self.weights.layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qkv = layer.qkv(h)  # [T, (H + 2 Hkv) * D]
            # q and k sit side by side in qkv: one norm (Qwen3) and one rotation serve both.
            qk = qkv[:, :self._q_size + self._kv_size].view(num_tokens, heads + kv_heads, c.head_dim)  # [T, H+Hkv, D]
            if layer.qk_norm is not None:
                qk = head_norm(qk, layer.qk_norm, c.rms_norm_eps)
            qk = self.rotary.apply(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, self._q_size + self._kv_size:].view(num_tokens, kv_heads, c.head_dim)
            write_kv(cache.k[index], cache.v[index], k, v, batch.slots)
            if paged:
                from specdec.model.triton_attention import triton_paged_attention
                attn = triton_paged_attention(q, cache.k[index], cache.v[index], batch.block_tables, batch.seq_lens,
                                              batch.query_start, batch.positions, batch.max_query_len, self.scale)
            else:
                attn = paged_attention(q, cache.k[index], cache.v[index], batch, mask, self.scale)
            x = x + layer.o_proj(attn.reshape(num_tokens, -1))
            h = rms_norm(x, layer.post_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if not batch.all_logits:
            x = x.index_select(0, batch.logits_indices)
        x = rms_norm(x, self.weights.final_norm, c.rms_norm_eps)
        return self.weights.lm_head(x).float()


def load_model(spec: str, device: str = "cpu", dtype: str | torch.dtype = "float32",
               packed_weights: bool = True, cpu_kernels: bool = True, weights: str = "auto",
               kv_cache_dtype: str = "auto", auto_float_format: str = "fp") -> Model:
    """The model a spec names (checkpoint directory, .gguf file or Hub id: specdec.model.source) on
    `device` in `dtype`.
    packed_weights: on CPU also keep oneDNN-packed weights for multi-row products (model.linear).
    cpu_kernels: on CPU in float32 run every pass in specdec's C kernels (model.cpu_kernels) where
    they can be built. Half precision is for GPUs; CPU_HALF_PRECISION_ENV lets tests run it on the
    CPU through torch's ops, as a GPU would.
    weights: fp, q8, q4 or auto (model.quantized): codes are multiplied in the C kernels (CPU) or
    in Triton's kernel (a GPU: model.triton_quantized), nowhere else; auto keeps a GGUF's
    quantization where either runs, and dequantizes it to `dtype` elsewhere.
    auto_float_format: what auto makes of a float checkpoint where the C kernels run: fp (keep its
    floats: a target's output is then the float model's) or q8 (a draft: role_configs.DraftConfig).
    On a GPU auto keeps a float checkpoint's floats.
    kv_cache_dtype: auto (`dtype`), float32 or float16; on CPU a float32 model may keep a float16
    cache (half the memory, and the bytes attention reads; rounded to nearest on the way in)."""
    torch_dtype = resolve_dtype(dtype)
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and torch_dtype != torch.float32 and os.environ.get(CPU_HALF_PRECISION_ENV) != "1":
        raise ValueError("on CPU specdec runs float32 only; use bfloat16/float16 on a GPU")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unsupported weights {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if auto_float_format not in ("fp", *CODE_BITS):
        raise ValueError(f"unsupported auto_float_format {auto_float_format!r}; choose fp, q8 or q4")
    source = resolve_model_source(str(spec))
    config = ModelConfig.from_dict(source.config)
    kernels = load_cpu_kernels() if cpu_kernels and on_cpu and torch_dtype == torch.float32 else None
    # Without the C kernels codes are multiplied where Triton's kernels run (a GPU; tests: the
    # interpreter, ATTENTION_ENV=triton).
    triton_codes = kernels is None and attention_backend(torch.device(device)) == "triton"
    if kernels is None and not triton_codes and weights in CODE_BITS:
        raise ValueError(f"weights={weights} runs in specdec's C kernels (device cpu, dtype float32, cpu_kernels on "
                         "and a C compiler) or in Triton's kernels (a CUDA GPU), neither of which this model can "
                         "use; use weights fp or auto")
    kv_dtype = kv_cache_dtype_for(kv_cache_dtype, torch_dtype, on_cpu)
    weight_format = weights if kernels is not None or triton_codes else "fp"
    raw = source.tensors(torch_dtype, device, keep_quantized=weight_format != "fp")
    if weight_format == "auto" and not any(isinstance(t, QuantizedMatrix) for t in raw.values()):
        weight_format = auto_float_format if kernels is not None else "fp"
    built = build_weights(config, raw, device, torch_dtype, packed_weights, kernels, weight_format)
    return Model(config, built, device, torch_dtype, kernels, kv_dtype)


def kv_cache_dtype_for(name: str, model_dtype: torch.dtype, on_cpu: bool) -> torch.dtype:
    """The KV cache's dtype for the setting `name` (role_configs.KV_CACHE_DTYPES) of a model in
    `model_dtype`. Another dtype than the model's is the CPU's only: the GPU kernels read the
    model's (specdec.model.triton_attention)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    chosen = model_dtype if name == "auto" else DTYPES[name]
    if chosen != model_dtype and not on_cpu:
        raise ValueError(f"kv_cache_dtype {name} on a {str(model_dtype).removeprefix('torch.')} model: a GPU's cache "
                         "holds the model's dtype (kv_cache_dtype auto); another dtype is for the CPU")
    return chosen
