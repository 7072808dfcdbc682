"""Weights in the C kernels' layout (cpu_kernels.c): column panels of floats, or of codes.

A product streams one panel (PANEL = 64 columns, all K rows) at a time, so a panel's numbers lie
together: floats as [panel][K][64]; codes (model.quantized) as [panel][K / 4][64 columns x 4
consecutive k] bytes, so that one 64-byte load feeds the CPU's 4-way int8 dot products, with
their scales (and minimums) as float16 [panel][K / 32][64]. Columns past N are zeros.
"""
from __future__ import annotations

import torch

from specdec.model.quantized import GROUP


def column_panels(by_column: torch.Tensor, width: int) -> torch.Tensor:
    """by_column [N, X] (one row per output column) -> [ceil(N / width), X, width], zeros past N."""
    n = by_column.shape[0]
    count = -(-n // width)
    padded = torch.nn.functional.pad(by_column, (0, 0, 0, count * width - n))
    return padded.view(count, width, by_column.shape[1]).transpose(1, 2).contiguous()


class PanelWeight:
    """A projection's weight [K, N] in the C kernels' column panels ([ceil(N / P)][K][P], P =
    panel width, zeros past N) with its optional bias [N]."""

    def __init__(self, weight_in_out: torch.Tensor, bias: torch.Tensor | None, width: int):
        k, n = weight_in_out.shape
        self.panels = column_panels(weight_in_out.float().t(), width)  # [count, K, width]
        self.bias = None if bias is None else bias.float().contiguous()
        self.in_features, self.out_features = k, n


class QuantizedPanelWeight:
    """A projection's weight [K, N] as codes (a model.quantized.QuantizedMatrix [N, K], the
    checkpoint's layout) in cpu_kernels.c's order (there, "quantized projections"): codes
    [ceil(N / P), K / 4, P * bits / 2] bytes, 8-bit codes stored + 128; scales and mins
    [ceil(N / P), K / GROUP, P] float16 (zeros past N); its optional bias [N]."""

    def __init__(self, matrix, bias: torch.Tensor | None, width: int):
        n, k = matrix.shape
        count = -(-n // width)
        if width != 64 or k % GROUP:  # cpu_kernels.c's 4-bit layout: four vectors of 16 columns a panel
            raise ValueError(f"quantized panels need width 64 and inputs a multiple of {GROUP}: {width}, {k}")
        # [count, K / 4, width, 4]: each column's 4 consecutive codes side by side
        quads = column_panels(matrix.codes.to(torch.int16), width).view(count, k // 4, 4, width).transpose(2, 3)
        if matrix.bits == 8:
            codes = (quads + 128).to(torch.uint8)
        else:  # columns 16 z .. 16 z + 15 as z = 0..3; z = 1 and 3 in the high nibbles
            z = quads.to(torch.uint8).reshape(count, k // 4, 4, 16 * 4)
            codes = torch.stack([z[:, :, 0] | (z[:, :, 1] << 4), z[:, :, 2] | (z[:, :, 3] << 4)], dim=2)
        self.codes = codes.reshape(count, k // 4, -1).contiguous()
        self.scales = column_panels(_half_exactly(matrix.scales), width)
        self.mins = None if matrix.mins is None else column_panels(_half_exactly(matrix.mins), width)
        self.bits = matrix.bits
        self.bias = None if bias is None else bias.float().contiguous()
        self.in_features, self.out_features = k, n
        self.width = width

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins, self.bias)
                   if t is not None)

    def columns(self, index: torch.Tensor) -> torch.Tensor:
        """Columns index [T] of the weight as float32 rows [T, K] (for a matrix that is also the
        embedding: embedding row t is the LM head's column t)."""
        count, quads = self.codes.shape[:2]
        panel, lane = index // self.width, index % self.width
        if self.bits == 8:
            codes = self.codes.view(count, quads, self.width, 4)[panel, :, lane].to(torch.int16) - 128
        else:
            z = lane // 16
            packed = self.codes.view(count, quads, 2, 16, 4)[panel, :, z // 2, lane % 16]  # [T, K / 4, 4]
            codes = torch.where((z % 2 == 1).view(-1, 1, 1), packed >> 4, packed & 15)
        scales = self.scales[panel, :, lane].float().repeat_interleave(GROUP, dim=1)
        rows = codes.reshape(len(index), -1).float() * scales
        return rows if self.mins is None else rows + self.mins[panel, :, lane].float().repeat_interleave(GROUP, dim=1)


def _half_exactly(values: torch.Tensor) -> torch.Tensor:
    """float16 scales or minimums: they hold float16 values already (model.quantized), so nothing
    is rounded here; anything else is a bug upstream."""
    half = values.half()
    if not torch.equal(half.float(), values.float()):
        raise ValueError("quantized scales or minimums that float16 does not hold exactly")
    return half
