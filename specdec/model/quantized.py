"""Weight matrices kept as integer codes: the formats, how checkpoints reach them, and their math.

Terms. A *weight format* is how a model's projection matrices are held in memory: `fp` (floats of
the compute dtype), `q8` or `q4` (integer codes of 8 or 4 bits with a float scale, and for q4 a
float minimum, per *group* of GROUP consecutive inputs of one output: w = scale * code + min).
`auto` keeps a GGUF file's own format (the nearest of q8/q4 to each tensor's type, module
`FORMAT_OF_GGUF_TYPE`) and a float checkpoint's floats (a draft's as q8: model.decoder.load_model's
auto_float_format). q8 and q4 run in specdec's C kernels
(CPU, float32 activations: cpu_kernels.c, "quantized projections"), which stream the codes and
never widen them to floats in memory.

GGUF's Q8_0, Q4_0 and Q4_1 blocks are exactly these formats (32 numbers, fp16 scale and minimum),
so their codes and scales are taken as stored: the numbers are the file's, bit for bit. Other
quantized types (the K-quants, Q5_*, IQ*) are dequantized and quantized again to the nearest
format, as is a float checkpoint loaded as q8 or q4 (settings `target_weights`, `draft_weights`):
an approximation of the float
model, whose agreement `specdec bench-quant` reports.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # inputs sharing one scale (and minimum); GGUF's block size; cpu_kernels.c's QGROUP
CODE_BITS = {"q8": 8, "q4": 4}  # the weight formats held as codes


@dataclass
class QuantizedMatrix:
    """A [out, in] matrix (a checkpoint's layout) as codes: w = scales * codes + mins, groupwise.
    codes [out, in] int8 (q8: -127..127; q4: 0..15); scales, mins [out, in / GROUP] float32
    holding float16 values; mins None for q8 (no minimum)."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def numel(self) -> int:
        return self.codes.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [out, in] these codes stand for."""
        w = self.codes.float() * self.scales.repeat_interleave(GROUP, dim=1)
        return w if self.mins is None else w + self.mins.repeat_interleave(GROUP, dim=1)

    def rows(self, order: torch.Tensor) -> QuantizedMatrix:
        """The same matrix with its rows (outputs) taken in `order` [out]."""
        return QuantizedMatrix(self.bits, self.codes[order], self.scales[order],
                               None if self.mins is None else self.mins[order])


def quantize(weight: torch.Tensor, bits: int) -> QuantizedMatrix:
    """weight [out, in] (in a multiple of GROUP) -> codes: q8 symmetric (scale = max |w| / 127),
    q4 from each group's minimum to its maximum in 15 steps (as GGUF's Q8_0 and Q4_1), scales and
    minimums rounded to float16 first (as GGUF stores them and the kernels read them)."""
    out, inputs = weight.shape
    if inputs % GROUP:
        raise ValueError(f"a [{out}, {inputs}] matrix cannot be quantized: inputs must be a multiple of {GROUP}")
    groups = weight.float().reshape(out, inputs // GROUP, GROUP)
    if bits == 8:
        scales = (groups.abs().amax(dim=2) / 127).half().float()
        codes = torch.round(groups / scales.clamp_min(1e-30).unsqueeze(2)).clamp(-127, 127)
        return QuantizedMatrix(8, codes.to(torch.int8).reshape(out, inputs), scales.contiguous(), None)
    if bits == 4:
        low = groups.amin(dim=2).half().float()
        scales = ((groups.amax(dim=2) - low) / 15).half().float()
        codes = torch.round((groups - low.unsqueeze(2)) / scales.clamp_min(1e-30).unsqueeze(2)).clamp(0, 15)
        return QuantizedMatrix(4, codes.to(torch.int8).reshape(out, inputs), scales.contiguous(), low.contiguous())
    raise ValueError(f"unsupported code width {bits} (8 or 4)")


def as_bits(matrix: QuantizedMatrix, bits: int) -> QuantizedMatrix:
    """`matrix` in `bits`-bit codes: q4 codes are q8 codes as they are (the minimum kept); q8 codes
    are quantized again to q4 (approximate)."""
    if matrix.bits == bits:
        return matrix
    if bits == 8:
        return QuantizedMatrix(8, matrix.codes, matrix.scales, matrix.mins)
    return quantize(matrix.dequantize(), 4)


def stack_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Several matrices of one input size stacked on out (a fused product), in the widest codes;
    one matrix is returned as it is (no copy)."""
    bits = max(p.bits for p in parts)
    parts = [as_bits(p, bits) for p in parts]
    if len(parts) == 1:
        return parts[0]
    mins = None
    if any(p.mins is not None for p in parts):
        mins = torch.cat([torch.zeros_like(p.scales) if p.mins is None else p.mins for p in parts])
    return QuantizedMatrix(bits, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)


def from_gguf_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedMatrix | None:
    """A GGUF tensor's raw blocks (uint8 [rows, row bytes]) as codes, for the types that are these
    formats exactly (Q8_0, Q4_0, Q4_1); None for any other type."""
    out, inputs = shape
    layout = {"Q8_0": (34, 2), "Q4_0": (18, 2), "Q4_1": (20, 4)}.get(type_name)  # block bytes, header bytes
    if layout is None:
        return None
    block_bytes, header = layout
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(out, inputs // GROUP, block_bytes)
    scales = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32))
    payload = blocks[:, :, header:]
    if type_name == "Q8_0":
        codes = torch.from_numpy(payload.copy().view(np.int8).reshape(out, inputs))
        return QuantizedMatrix(8, codes, scales, None)
    # 4-bit: element i < 16 in the low nibble of byte i, element i + 16 in its high nibble.
    nibbles = np.concatenate([payload & 15, payload >> 4], axis=2).astype(np.int8).reshape(out, inputs)
    if type_name == "Q4_0":  # w = d * (q - 8) = d * q + (-8 d)
        return QuantizedMatrix(4, torch.from_numpy(nibbles), scales, -8 * scales)
    mins = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    return QuantizedMatrix(4, torch.from_numpy(nibbles), scales, mins)


# The nearest format of each quantized GGUF type that is not one exactly: 5 bits and up keep 8-bit
# codes; 4 bits and below take 4.
FORMAT_OF_GGUF_TYPE = {"Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8, "Q8_1": 8, "Q8_K": 8,
                       "Q4_K": 4, "Q3_K": 4, "Q2_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "IQ3_S": 4, "IQ3_XXS": 4,
                       "IQ2_XXS": 4, "IQ2_XS": 4, "IQ2_S": 4, "IQ1_S": 4, "IQ1_M": 4, "TQ1_0": 4, "TQ2_0": 4}
