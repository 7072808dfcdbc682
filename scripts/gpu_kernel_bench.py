#!/usr/bin/env python
"""The pieces of a GPU decode step, timed alone (issue 24's diagnosis; scripts/gpu_check.py times
whole passes). Needs only torch and Triton; run from the checkout on a CUDA machine:

    PYTHONPATH=. python scripts/gpu_kernel_bench.py --out /tmp/gpu

- products: y = x @ W for the projections of the Llama-3.2-1B/3B shapes at 1 and 8 rows, in GB/s
  of weight streamed, through cuBLAS with W held [in, out] (what specdec keeps) or [out, in]
  (F.linear); weights rotate over copies larger than the L2 cache, so each call streams from
  memory;
- attention: model.triton_attention at batch 1, 1 and 6 new tokens, contexts 512 to 32k, keys in
  one split or in the splits the kernel chooses;
- a graph of 300 tiny kernels: what each kernel costs inside a CUDA graph however small;
- quantized (`--only quantized`): the same projections multiplied by q8 and q4 codes
  (model.triton_quantized) at one row, against cuBLAS's bfloat16 product, for each launch
  configuration in QUANTIZED_CONFIGS, and whether a row's bits are the same alone and in a batch;
  then each launch's products summed as a step runs them (gpu_quantized_summary.json), least
  first for the 3B target: what model.triton_quantized.LAUNCH is chosen from.
Each time is the median of CUDA-event timings of CUDA graphs of the calls (no host launch gaps);
a table is printed and written as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.model.triton_attention import triton_paged_attention  # noqa: E402

PRODUCTS = {"3B": {"qkv": (3072, 5120), "o_proj": (3072, 3072), "gate_up": (3072, 16384), "down": (8192, 3072),
                   "lm_head": (3072, 128256)},
            "1B": {"qkv": (2048, 3072), "o_proj": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}}
LAYERS = {"3B": 28, "1B": 16}  # each projection but the LM head runs once a layer in a step
L2_BYTES = 64 << 20


def graph_ms(calls: list, repeats: int = 20) -> float:
    """Milliseconds per call of `calls` captured in one CUDA graph (no launch gaps from Python)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_ms(graph.replay, repeats) / len(calls)


def median_ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def products(device: torch.device) -> list[dict]:
    """Each projection at 1 and 8 rows through cuBLAS, the weight held [in, out] (as specdec holds
    it) and [out, in] (F.linear), timed inside CUDA graphs over weight copies that do not fit the
    L2 cache together: GB/s of weight streamed."""
    rows = []
    for shape, projections in PRODUCTS.items():
        for name, (fan_in, fan_out) in projections.items():
            nbytes = fan_in * fan_out * 2
            copies = max(2, -(-4 * L2_BYTES // nbytes))
            in_out = [torch.randn(fan_in, fan_out, device=device, dtype=torch.bfloat16) for _ in range(copies)]
            out_in = [w.t().contiguous() for w in in_out]
            for m in (1, 8):
                x = torch.randn(m, fan_in, device=device, dtype=torch.bfloat16)
                row = {"shape": shape, "product": name, "rows": m, "mb": nbytes / 1e6}
                for label, op, weights in (("in_out", torch.matmul, in_out), ("out_in", F.linear, out_in)):
                    ms = graph_ms([partial(op, x, weights[i % copies]) for i in range(2 * copies)])
                    row[f"gbps_{label}"] = round(nbytes / ms / 1e6)
                rows.append(row)
            del in_out, out_in
    return rows


# (block_n, step_groups, num_warps, num_stages) of the product's Launch, swept for both formats
QUANTIZED_CONFIGS = [(128, 1, 4, 3), (64, 4, 4, 3), (64, 8, 4, 3), (128, 2, 4, 3), (128, 4, 4, 3), (128, 4, 8, 3),
                     (128, 4, 4, 4), (128, 8, 4, 2), (256, 2, 4, 3), (256, 2, 8, 3), (256, 4, 8, 3), (256, 4, 4, 2)]


def random_codes(bits: int, fan_in: int, fan_out: int, device: torch.device):
    """A QuantizedMatrix [out, in] of random codes, scales and minimums on the device."""
    from specdec.model.quantized import GROUP, QuantizedMatrix

    codes = torch.randint(-127 if bits == 8 else 0, 128 if bits == 8 else 16, (fan_out, fan_in), device=device,
                          dtype=torch.int8)
    scales = (torch.rand(fan_out, fan_in // GROUP, device=device) * 1e-3).half().float()
    mins = None if bits == 8 else (-8 * scales).contiguous()
    return QuantizedMatrix(bits, codes, scales, mins)


def quantized(device: torch.device, out: Path) -> list[dict]:
    """Each projection: cuBLAS bfloat16 [in, out] against q8 and q4 codes through
    model.triton_quantized, per launch configuration, over copies that do not fit the L2 cache;
    microseconds at one row (a decode step; up to SMALL_ROWS rows take the same tiles), the
    bfloat16 product's time over the codes', and whether a row's bits are the same alone and in a
    batch of 8. Rows are written as they come."""
    from specdec.model import triton_quantized as tq

    rows, defaults = [], dict(tq.LAUNCH)
    try:
        _sweep_quantized(tq, device, out, rows)
    finally:  # (the module's own configuration again, whatever stopped the sweep)
        tq.LAUNCH.update(defaults)
    summary = step_products_us(rows)
    print(json.dumps(summary, indent=1), flush=True)
    (out / "gpu_quantized_summary.json").write_text(json.dumps(summary, indent=1))
    return rows


def step_products_us(rows: list[dict]) -> list[dict]:
    """Per format and launch, the products' microseconds in one step of each model (a layer's
    projections times its layers, plus the LM head), least first for the 3B target: how
    model.triton_quantized's LAUNCH is chosen. cuBLAS's bfloat16 products as a row of their own."""
    steps: dict[tuple, dict] = {}
    for row in rows:
        times = {tuple(row["config"]): row.get("us", float("inf"))}  # (a failed launch: never chosen)
        if tuple(row["config"]) == QUANTIZED_CONFIGS[0]:  # (cuBLAS's time is on every row: once)
            times["cublas_bf16"] = row["cublas_bf16_us"]
        runs = 1 if row["product"] == "lm_head" else LAYERS[row["shape"]]
        for launch, us in times.items():
            step = steps.setdefault((row["bits"], launch), {"bits": row["bits"], "launch": launch})
            step[row["shape"]] = step.get(row["shape"], 0.0) + us * runs
    return sorted(steps.values(), key=lambda step: (step["bits"], step.get("3B", 0.0)))


def _sweep_quantized(tq, device: torch.device, out: Path, rows: list[dict]) -> None:
    for shape, projections in PRODUCTS.items():
        for name, (fan_in, fan_out) in projections.items():
            copies = max(2, -(-4 * L2_BYTES // (fan_in * fan_out)))
            floats = [torch.randn(fan_in, fan_out, device=device, dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(1, fan_in, device=device, dtype=torch.bfloat16)
            batch = torch.randn(8, fan_in, device=device, dtype=torch.bfloat16)
            cublas_us = graph_ms([partial(torch.matmul, x, floats[i % copies]) for i in range(2 * copies)]) * 1e3
            for bits in (8, 4):
                matrices = [random_codes(bits, fan_in, fan_out, device) for _ in range(copies)]
                want = batch.double() @ matrices[0].dequantize().double().t()
                for config in QUANTIZED_CONFIGS:
                    tq.LAUNCH[bits] = tq.Launch(*config)
                    row = {"shape": shape, "product": name, "bits": bits, "config": config,
                           "cublas_bf16_us": round(cublas_us, 1)}
                    try:
                        held = [tq.DeviceCodes.build(q, None, device, torch.bfloat16) for q in matrices]
                        us = graph_ms([partial(tq.quantized_product, x, held[i % copies])
                                       for i in range(2 * copies)]) * 1e3
                        row.update(us=round(us, 1), speedup=round(cublas_us / us, 2), splits=held[0].splits[0],
                                   gbps=round(held[0].nbytes() / us / 1e3))
                        alone = torch.cat([tq.quantized_product(batch[i:i + 1], held[0]) for i in range(8)])
                        row["row_alone_equals_in_batch"] = torch.equal(alone, tq.quantized_product(batch, held[0]))
                        row["max_rel_error"] = float((alone.double() - want).abs().max() / want.abs().max())
                        del held
                    except Exception as error:  # recorded; the next configuration runs
                        row["error"] = repr(error)[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    (out / "gpu_quantized_bench.json").write_text(json.dumps(rows, indent=1))
                del matrices
            del floats


def attention(device: torch.device) -> list[dict]:
    rows = []
    heads, kv_heads, dim, block = 24, 8, 128, 16
    for context in (512, 4096, 32768):
        blocks = context // block + 8
        k_cache = torch.randn(blocks, block, kv_heads, dim, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks, device=device)[None, :]
        for new in (1, 6):
            q = torch.randn(new, heads, dim, device=device, dtype=torch.bfloat16)
            seq_lens = torch.tensor([context], device=device)
            starts = torch.tensor([0, new], device=device)
            positions = torch.arange(context - new, context, device=device)
            for splits in (1, None):
                args = (q, k_cache, v_cache, table, seq_lens, starts, positions, new, dim ** -0.5, splits)
                ms = graph_ms([lambda args=args: triton_paged_attention(*args)] * 10)
                rows.append({"context": context, "new_tokens": new, "splits": splits or "auto", "us": ms * 1000})
    return rows


def graph_kernel_cost(device: torch.device) -> dict:
    x = torch.zeros(16, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(300):
            x.add_(1)
    return {"us_per_tiny_kernel_in_a_graph": median_ms(graph.replay) * 1000 / 300}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_kernel_bench_out")
    parser.add_argument("--only", choices=["quantized"], help="run only this part")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.only == "quantized":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        quantized(device, Path(args.out))
        return 0
    report = {"device": torch.cuda.get_device_name(device), **graph_kernel_cost(device),
              "attention": attention(device), "products": products(device)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_kernel_bench.json").write_text(json.dumps(report, indent=1))
    print(f"{report['device']}: {report['us_per_tiny_kernel_in_a_graph']:.2f} us per tiny kernel in a graph")
    for row in report["attention"]:
        print(f"attention ctx {row['context']:>6} new {row['new_tokens']} splits {row['splits']!s:>4}: "
              f"{row['us']:.1f} us")
    for row in report["products"]:
        print(f"{row['shape']} {row['product']:<8} rows {row['rows']}: [in,out] {row['gbps_in_out']:5d} GB/s  "
              f"[out,in] {row['gbps_out_in']:5d} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
