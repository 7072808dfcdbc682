"""One projection (y = x @ W + b) stored for the products it serves.

Single-row products (a batch-1 decode step) read the whole matrix to produce one row: they are
bandwidth-bound, and MKL's fastest path for them on CPU is a contiguous [in, out] matrix (`x @ w`),
about a third faster than the checkpoint's [out, in] (`F.linear`). Products of several rows (a
batch of decode steps, a verify pass, a prefill) are where MKL's small-M kernels fall behind: on
the 2-core dev CPU a SmolLM2-sized [576 x 3072] product with 8 rows streams 6 GB/s through MKL and
12 GB/s through oneDNN's linear kernel against a weight packed for it, and the [576 x 49152] LM
head 4.5 against 13.7 GB/s. So on CPU a projection may also keep a oneDNN-packed copy (twice the
weight memory; `packed_weights` turns it off), used for products of more than one row, and for
single rows too when torch runs several threads and the matrix is large: oneDNN splits a one-row
product over threads better than MKL does (a SmolLM2-135M-shaped batch-1 step, 2 threads: 36 ms
against 41 ms through MKL; with 1 thread MKL's [in, out] path is the faster, 48 ms against 60 ms),
but spends ~23 us a call before streaming anything (timed on a 16 x 16 product, MKL: 2 us), so for
matrices under ONEDNN_SINGLE_ROW_MIN_BYTES MKL's one-row product takes about half its time (2
threads: 384 x 640, 26 against 51 us; 256 x 256, 13.5 against 46.5 us; from 1.3 MB up oneDNN is
as fast or faster, 576 x 576: 51 against 67 us).
"""
from __future__ import annotations

import torch

ONEDNN_SINGLE_ROW_MIN_BYTES = 1 << 20  # smaller matrices take MKL's product for one row (docstring)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear kernels exist for float32 on x86 CPUs built with MKL-DNN."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _pack(weight_in_out: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed form of a [in, out] weight, or None where this torch cannot pack it (the
    plain product then serves every shape: packing is an optimisation, never a requirement)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight_in_out.t().contiguous(), 8)
        probe = torch.ones(2, weight_in_out.shape[0], dtype=weight_in_out.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError):
        return None


class Projection:
    """y = x @ weight (+ bias): weight [in, out] (contiguous), bias [out] or None, and on CPU an
    optional oneDNN-packed copy of the weight for the products it runs faster (module docstring).
    `panels`: the same weight in the C kernels' layout (model.panels.PanelWeight, or
    QuantizedPanelWeight: then `weight` is None, the codes being the only copy), which the kernel
    pass multiplies by instead (model.kernel_forward); None elsewhere. `device_codes`: on a GPU,
    the weight as codes for Triton's product (model.triton_quantized.DeviceCodes, holding the
    bias too; `weight` is then None)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, packed: bool = False,
                 panels=None, device_codes=None):
        self.weight = weight  # [in, out]
        self.bias = bias
        self.panels = panels
        self.device_codes = device_codes
        self.packed = _pack(weight) if packed else None
        # One row goes through the packed copy only where streaming, not the call, dominates.
        self.single_row_packed = (self.packed is not None
                                  and weight.numel() * weight.element_size() >= ONEDNN_SINGLE_ROW_MIN_BYTES)

    @property
    def in_features(self) -> int:
        return self.weight.shape[0] if self.weight is not None else self.held_codes.in_features

    @property
    def out_features(self) -> int:
        return self.weight.shape[1] if self.weight is not None else self.held_codes.out_features

    @property
    def held_codes(self):
        """Where a weight held only as codes is: the C kernels' panels or the GPU's codes."""
        return self.panels if self.panels is not None else self.device_codes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        if self.device_codes is not None:
            from specdec.model.triton_quantized import quantized_product  # (Triton only where it runs)
            return quantized_product(x, self.device_codes)
        if self.packed is not None and (x.shape[0] > 1 or (self.single_row_packed and torch.get_num_threads() > 1)):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)
