"""Time specdec's quantized products (q8, q4) against torch's CPU int8/int4 weight-only products on
SmolLM2-135M's matrix shapes (docs/bench-2026-11-26-quantized.md, "Why specdec's own kernels").

  python scripts/quant_kernels_vs_torch.py [--threads 2]

torch's int4 kernel is timed on random codes of the same shape (its packing takes int32 codes and
groupwise scales and zeros; the values do not change its speed).
"""
from __future__ import annotations

import argparse
import time

import torch

from specdec.model.cpu_kernels import load_cpu_kernels
from specdec.model.quantized import GROUP, quantize

SHAPES = [(576, 3072), (1536, 576), (576, 49152)]  # [K, N]: gate/up, down, LM head


def microseconds(calls: int, fn, *args) -> float:
    """Mean microseconds of fn(*args) over `calls` calls, after one untimed call."""
    fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("specdec's C kernels are unavailable (no C compiler)")
    print("[K x N] rows: specdec q8 / torch int8pack, specdec q4 / torch int4pack (microseconds per product)")
    for k, n in SHAPES:
        weight = torch.randn(n, k) * 0.05
        calls = 20 if n > 10000 else 200
        q8, q4 = kernels.pack_quantized(quantize(weight, 8)), kernels.pack_quantized(quantize(weight, 4))
        scale8 = weight.abs().amax(1) / 127
        codes8 = torch.round(weight / scale8.unsqueeze(1)).to(torch.int8)
        packed4 = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        scales_zeros = torch.rand(k // GROUP, n, 2)
        for rows in (1, 8):
            x, out = torch.randn(rows, k), torch.empty(rows, n)
            slow = max(2, calls // 20)  # torch's are ~20-100x slower here
            ours8 = microseconds(calls, kernels.matmul, x, q8, out)
            ours4 = microseconds(calls, kernels.matmul, x, q4, out)
            theirs8 = microseconds(slow, torch._weight_int8pack_mm, x, codes8, scale8)
            theirs4 = microseconds(slow, torch._weight_int4pack_mm_for_cpu, x, packed4, GROUP, scales_zeros)
            print(f"[{k} x {n}] {rows}: {ours8:.0f} / {theirs8:.0f}, {ours4:.0f} / {theirs4:.0f}")


if __name__ == "__main__":
    main()
