"""Turn a checkpoint's tensors (Hugging Face names, whatever the source) into fused, inference-ready
tensors.

Projection matrices are stored [in, out] (`x @ w`): on CPU a skinny product (one to a few dozen
rows, as in decoding and verifying) runs about a third faster against a contiguous [in, out]
matrix than against the checkpoint's [out, in] one (`F.linear`); on GPU it makes no difference.
A tied LM head is a transposed view of the embedding on GPU (no second copy); on CPU it gets a
contiguous copy, since the one-row product against the view runs up to twice as slow.
With `packed` (CPU only) every projection, the LM head included, also keeps a oneDNN-packed copy
for products of several rows (specdec.model.linear). With `kernels` (specdec's C kernels, a float32
CPU model) every projection keeps the C kernels' panels instead, which every pass then uses.
With a quantized weight format (q8, q4, or auto with a quantized GGUF: model.quantized) the
projections and the embedding are held only as codes: in the C kernels' panels on CPU, for
Triton's product on a GPU (model.triton_quantized); a tied embedding reads its rows from the LM
head's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.model.config import ModelConfig
from specdec.model.linear import Projection, onednn_available
from specdec.model.quantized import CODE_BITS, GROUP, QuantizedMatrix, as_bits, quantize, stack_rows


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Projection  # hidden -> (H + 2 Hkv) * D: one product instead of three
    qk_norm: torch.Tensor | None  # [H + Hkv, D]: q_norm's weight on each q head, then k_norm's (Qwen3)
    o_proj: Projection  # H * D -> hidden
    post_norm: torch.Tensor
    gate_up: Projection  # hidden -> 2 * intermediate
    down: Projection  # intermediate -> hidden

    def projections(self) -> tuple[Projection, ...]:
        return self.qkv, self.o_proj, self.gate_up, self.down


@dataclass
class ModelWeights:
    embed: torch.Tensor | object  # [vocab, hidden], or codes: a QuantizedPanelWeight or DeviceCodes [hidden, vocab]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Projection  # hidden -> vocab; tied on GPU: its weight is a view of embed
    tied: bool  # the LM head is the embedding
    num_parameters: int  # of the checkpoint (a tied head and the stacked q/k norms counted once)

    @property
    def nbytes(self) -> int:
        """Bytes held: every tensor once (a tied embedding shares its LM head's storage)."""
        seen: dict[int, int] = {}

        def add(*tensors) -> None:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                elif isinstance(t, torch.Tensor):  # oneDNN's packed layout has no plain storage
                    seen[id(t)] = t.numel() * t.element_size()
                elif t is not None:  # panels
                    add(*(getattr(t, name, None) for name in ("panels", "codes", "scales", "mins", "bias")))

        for projection in (self.lm_head, *(p for layer in self.layers for p in layer.projections())):
            add(projection.weight, projection.bias, projection.packed, projection.panels, projection.device_codes)
        for layer in self.layers:
            add(layer.input_norm, layer.post_norm, layer.qk_norm)
        add(self.embed, self.final_norm)
        return sum(seen.values())

    def embed_rows(self, token_ids: torch.Tensor, kernels=None) -> torch.Tensor:
        """The embeddings of token_ids [T]: [T, hidden] (a fresh tensor). A quantized embedding's
        rows are decoded in `kernels` (model.cpu_kernels) where given, else by torch's ops."""
        if isinstance(self.embed, torch.Tensor):
            return self.embed.index_select(0, token_ids)
        return self.embed.columns(token_ids) if kernels is None else kernels.columns(self.embed, token_ids)


def build_weights(config: ModelConfig, raw: dict[str, torch.Tensor | QuantizedMatrix], device: torch.device | str,
                  dtype: torch.dtype, packed: bool = True, kernels=None, weight_format: str = "fp") -> ModelWeights:
    """raw: tensors by Hugging Face name (with or without the `model.` prefix), [out, in] matrices,
    quantized ones as QuantizedMatrix. packed: also keep oneDNN-packed copies for multi-row
    products where oneDNN can (CPU, float32). kernels: model.cpu_kernels.CpuKernels; every
    projection then keeps its panels (and no oneDNN copy: the kernel pass never uses one).
    weight_format: fp, q8, q4 or auto (model.quantized); codes go to the kernels' panels where
    kernels are given, else to Triton's layout (a GPU's: model.triton_quantized)."""
    counted = 0
    packed = packed and kernels is None and onednn_available(torch.device(device), dtype)

    def take(name: str, matrix: bool = False) -> torch.Tensor | QuantizedMatrix:
        """A tensor as `dtype` on `device`; a matrix may stay quantized."""
        nonlocal counted
        for key in (name, f"model.{name}"):
            if key in raw:
                counted += raw[key].numel()
                value = raw[key]
                if isinstance(value, QuantizedMatrix):
                    return value if matrix else value.dequantize().to(device=device, dtype=dtype)
                return value.to(device=device, dtype=dtype)
        raise KeyError(f"checkpoint is missing tensor {name!r}")

    def quantized_form(parts: list[torch.Tensor | QuantizedMatrix]) -> QuantizedMatrix | None:
        """The parts stacked as codes in the weight format, or None where they stay floats."""
        bits = CODE_BITS.get(weight_format)
        if weight_format == "fp" or any(p.shape[1] % GROUP for p in parts):
            return None  # (an input size no group divides keeps floats: no GGUF file has one)
        if weight_format == "auto":
            if all(isinstance(p, torch.Tensor) for p in parts):
                return None
            return stack_rows([p if isinstance(p, QuantizedMatrix) else quantize(p, 8) for p in parts])
        return stack_rows([as_bits(p, bits) if isinstance(p, QuantizedMatrix) else quantize(p, bits)
                           for p in parts])

    def hold_codes(codes: QuantizedMatrix, bias: torch.Tensor | None = None):
        """`codes` where this model multiplies by them: the C kernels' panels or the GPU's layout."""
        if kernels is not None:
            return kernels.pack_quantized(codes, bias)
        from specdec.model.triton_quantized import DeviceCodes  # (Triton only where it runs)
        return DeviceCodes.build(codes, bias, device, dtype)

    def product(parts: list[torch.Tensor | QuantizedMatrix], bias: torch.Tensor | None) -> Projection:
        """The checkpoint's [out, in] matrices `parts`, stacked on out (one product for all)."""
        codes = quantized_form(parts)
        if codes is not None:
            if kernels is not None:
                return Projection(None, bias, panels=hold_codes(codes, bias))
            return Projection(None, bias, device_codes=hold_codes(codes, bias))
        weight = torch.cat([p.dequantize().to(device=device, dtype=dtype) if isinstance(p, QuantizedMatrix) else p
                            for p in parts]).t().contiguous()
        return Projection(weight, bias, packed, kernels.pack(weight, bias) if kernels is not None else None)

    def biases(*names: str) -> torch.Tensor:
        return torch.cat([take(n) for n in names])

    def projection(weights: list[str], bias_names: list[str] | None) -> Projection:
        return product([take(n, matrix=True) for n in weights], biases(*bias_names) if bias_names else None)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        qk_norm = None
        if config.qk_norm:
            # One multiply after one weightless RMSNorm over all heads needs the weight per head.
            q_norm, k_norm = take(f"{attn}.q_norm.weight"), take(f"{attn}.k_norm.weight")
            qk_norm = torch.cat([q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)]).contiguous()
        layers.append(LayerWeights(
            input_norm=take(f"{p}.input_layernorm.weight"),
            qkv=projection([f"{attn}.{n}_proj.weight" for n in "qkv"],
                           [f"{attn}.{n}_proj.bias" for n in "qkv"] if config.qkv_bias else None),
            qk_norm=qk_norm,
            o_proj=projection([f"{attn}.o_proj.weight"], [f"{attn}.o_proj.bias"] if config.o_bias else None),
            post_norm=take(f"{p}.post_attention_layernorm.weight"),
            gate_up=projection([f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
                               [f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"] if config.mlp_bias else None),
            down=projection([f"{mlp}.down_proj.weight"], [f"{mlp}.down_proj.bias"] if config.mlp_bias else None),
        ))
    embed = take("embed_tokens.weight", matrix=True)
    tied = config.tie_word_embeddings or not any(k in raw for k in ("lm_head.weight", "model.lm_head.weight"))
    embed_codes = quantized_form([embed])
    if embed_codes is not None:  # rows read from the panels (ModelWeights.embed_rows)
        lm_head = projection(["lm_head.weight"], None) if not tied else product([embed_codes], None)
        embed = lm_head.held_codes if tied else hold_codes(embed_codes)
    else:
        if isinstance(embed, QuantizedMatrix):
            embed = embed.dequantize().to(device=device, dtype=dtype)
        if not tied:
            lm_head = projection(["lm_head.weight"], None)
        else:
            lm_head = product([embed], None) if torch.device(device).type == "cpu" else Projection(embed.t())
    final_norm = take("norm.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, tied=tied,
                        num_parameters=counted)
