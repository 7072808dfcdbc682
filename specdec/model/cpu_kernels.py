"""specdec's C kernels (cpu_kernels.c) for a float32 forward pass on CPU, behind typed functions.

The library is compiled on first use with the system's C compiler ($CC, else cc) for this CPU
(-march=native) and loaded with ctypes: the C file needs only libc, libm and OpenMP (the libgomp
that torch already loaded, so both share one thread pool) and compiles in about a second, where a
torch C++ extension would take a minute of header parsing on every fresh machine. It is kept in
specdec's cache ($SPECDEC_CACHE_DIR/kernels, default ~/.cache/specdec/kernels) under a name that
hashes the source, the flags, the compiler's version and the CPU's model and feature flags, so a
cache shared between machines never loads code built for another CPU; it is written to a
temporary file and renamed, so workers compiling at once never load a half-written library.
Without a compiler, or when the build fails, load_cpu_kernels() returns None after one warning and
models run torch's ops instead (the same results to float32 rounding, but not batch-invariant).

C checks nothing, so `CpuKernels` does, before each call: every tensor is float32 (int64 for
indices; the KV cache float32 or float16), contiguous and on the CPU, and the sizes C is told come
from the tensors' own shapes.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import subprocess
import tempfile
from array import array
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.config import cache_dir
from specdec.model.panels import PanelWeight, QuantizedPanelWeight
from specdec.model.quantized import GROUP

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -fno-trapping-math: no floating-point exception is ever unmasked here, so gcc may compute both
# arms of a select; without it SiLU's and softmax's exponentials stayed scalar (a branch per number).
# It changes no result: every operation is still the same IEEE operation, in the same order.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fno-trapping-math"]
_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {  # (argument types, result type) of each C function, in cpu_kernels.c's order
    "add_rms_norm": ([_P, _P, _P, _P, _I, _I, _F], None),
    "silu_mul": ([_P, _P, _I, _I], None),
    "rope_store_kv": ([_P, _I, _I, _I, _I, _P, _P, _P, _P, _F, _P, _P, _P, _B], None),
    "attend": ([_P, _I, _I, _I, _I, _P, _P, _P, _I, _P, _P, _F, _P, _B], ctypes.c_int),
    "argmax_rows": ([_P, _I, _I, _P], None),
    "sample_top": ([_P, _I, _I, _F, ctypes.c_double, _P, _P], _I),
    "verify_sampled_chain": ([_P, _I, _I, _F, _P, _P, _P, _I, _P, _P, _P, _P], _I),
    "verify_sampled_tree": ([_P, _I, _I, _F, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P], _I),
    "panel_width": ([], _I),
    "matmul": ([_P, _I, _I, _P, _I, _P, _P], None),
    "quant_group": ([], _I),
    "quant_dot_simd": ([], _I),
    "matmul_quantized": ([_P, _I, _I, _I, _P, _P, _P, _I, _P, _P], ctypes.c_int),
    "quantized_columns": ([_P, _P, _P, _I, _I, _P, _I, _P], None),
    "decoder_layers": ([_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _F, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I,
                        _B], ctypes.c_int),
    "distinct_children": ([_P, _P, _I, _I, _I, _P, _I, _P, _P], _I),
    "draft_chain": ([_P, _I, _P, _P, _P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _I, _P, _P, _I,
                     _I, _I, _I, _I, _F, _F, _P, _P, _P, _P, _I, _B], ctypes.c_int),
}


class _Projection(ctypes.Structure):  # cpu_kernels.c's Projection
    _fields_ = [("bits", _I), ("weights", _P), ("scales", _P), ("mins", _P), ("bias", _P), ("n", _I)]


class _DecoderLayer(ctypes.Structure):  # cpu_kernels.c's DecoderLayer
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("head_norm", _P), ("qkv", _Projection),
                ("o_proj", _Projection), ("gate_up", _Projection), ("down", _Projection)]


class KernelArgumentError(ValueError):
    """A tensor that C would read or write out of bounds, or in the wrong format."""


def _ptr(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> int:
    if t.dtype != dtype or not t.is_contiguous() or not t.is_cpu:
        raise KernelArgumentError(f"expected a contiguous CPU {dtype} tensor, got {t.dtype} {tuple(t.shape)} "
                                  f"(contiguous: {t.is_contiguous()}, device: {t.device})")
    return t.data_ptr()


_CACHE_DTYPES = (torch.float32, torch.float16)  # what the C attention reads (float16: half the bytes)


def _cache_pointers(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(k, v, f16): the caches' data and whether they hold float16 (both the same format)."""
    _expect(k_cache.dtype in _CACHE_DTYPES and v_cache.dtype == k_cache.dtype,
            lambda: f"KV cache of {k_cache.dtype} / {v_cache.dtype}: expected float32 or float16, both alike")
    return _ptr(k_cache, k_cache.dtype), _ptr(v_cache, k_cache.dtype), int(k_cache.dtype == torch.float16)


def _projection(panels: PanelWeight | QuantizedPanelWeight) -> _Projection:
    """cpu_kernels.c's Projection of a weight's panels (it holds pointers: the weight must outlive it)."""
    bias = None if panels.bias is None else _ptr(panels.bias)
    if isinstance(panels, QuantizedPanelWeight):
        return _Projection(panels.bits, _ptr(panels.codes, torch.uint8), _ptr(panels.scales, torch.float16),
                           None if panels.mins is None else _ptr(panels.mins, torch.float16), bias,
                           panels.out_features)
    return _Projection(32, _ptr(panels.panels), None, None, bias, panels.out_features)


def _expect(condition: bool, what: Callable[[], str]) -> None:
    """Raise KernelArgumentError(what()) unless condition: the message is made only then (the
    checks run on every pass, their messages format shapes)."""
    if not condition:
        raise KernelArgumentError(what())


class CpuKernels:
    """The C functions, each taking tensors (shapes in each docstring)."""

    def __init__(self, library: ctypes.CDLL):
        self._lib = library
        self.panel_width = int(library.panel_width())
        assert int(library.quant_group()) == GROUP, "cpu_kernels.c's QGROUP differs from model.quantized.GROUP"

    def pack(self, weight_in_out: torch.Tensor, bias: torch.Tensor | None = None) -> PanelWeight:
        """weight [K, N] (bias [N]) -> the panels `matmul` reads."""
        return PanelWeight(weight_in_out, bias, self.panel_width)

    def pack_quantized(self, matrix, bias: torch.Tensor | None = None) -> QuantizedPanelWeight:
        """matrix: a QuantizedMatrix [N, K] (the checkpoint's [out, in]), bias [N] -> the panels
        `matmul` reads for the product x @ matrix^T."""
        return QuantizedPanelWeight(matrix, bias, self.panel_width)

    def matmul(self, x: torch.Tensor, weight: PanelWeight | QuantizedPanelWeight, out: torch.Tensor) -> torch.Tensor:
        """out [M, N] = x [M, K] @ weight (+ its bias); returns out."""
        m, k = x.shape
        _expect(k == weight.in_features and tuple(out.shape) == (m, weight.out_features),
                lambda: f"matmul: x {tuple(x.shape)} @ [{weight.in_features}, {weight.out_features}] -> "
                f"out {tuple(out.shape)}")
        bias = None if weight.bias is None else weight.bias.data_ptr()
        if isinstance(weight, QuantizedPanelWeight):
            mins = None if weight.mins is None else _ptr(weight.mins, torch.float16)
            if self._lib.matmul_quantized(_ptr(x), m, k, weight.bits, _ptr(weight.codes, torch.uint8),
                                          _ptr(weight.scales, torch.float16), mins, weight.out_features, bias,
                                          _ptr(out)):
                raise MemoryError("matmul: no memory for the quantized input rows")
        else:
            self._lib.matmul(_ptr(x), m, k, weight.panels.data_ptr(), weight.out_features, bias, _ptr(out))
        return out

    def columns(self, weight: QuantizedPanelWeight, index: torch.Tensor) -> torch.Tensor:
        """[T, K]: the columns index [T] of weight (its [K, N]) as floats, the same bits as
        weight.columns (the embedding rows of a model whose LM head is its embedding)."""
        _expect(index.dim() == 1 and (index.numel() == 0 or (0 <= int(index.min())
                                                              and int(index.max()) < weight.out_features)),
                lambda: f"columns: index {tuple(index.shape)} outside 0..{weight.out_features - 1}")
        rows = torch.empty(len(index), weight.in_features)
        mins = None if weight.mins is None else _ptr(weight.mins, torch.float16)
        self._lib.quantized_columns(_ptr(weight.codes, torch.uint8), _ptr(weight.scales, torch.float16), mins,
                                    weight.bits, weight.in_features, _ptr(index.contiguous(), torch.int64),
                                    len(index), _ptr(rows))
        return rows

    def layer_table(self, layers) -> ctypes.Array:
        """The C table of model.weights.LayerWeights `layers` that `decoder_layers` reads (it holds
        pointers: the weights must outlive it). Every tensor is checked here, once."""

        table = (_DecoderLayer * len(layers))()
        for row, layer in zip(table, layers):
            row.input_norm, row.post_norm = _ptr(layer.input_norm), _ptr(layer.post_norm)
            row.head_norm = None if layer.qk_norm is None else _ptr(layer.qk_norm)
            row.qkv, row.o_proj = _projection(layer.qkv.panels), _projection(layer.o_proj.panels)
            row.gate_up, row.down = _projection(layer.gate_up.panels), _projection(layer.down.panels)
        return table

    def decoder_layers(self, table: ctypes.Array, final_norm: torch.Tensor, x: torch.Tensor, heads: int,
                       kv_heads: int, inter: int, eps: float, scale: float, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, token_seqs: torch.Tensor,
                       kv_slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Every layer of `table` over x [T, hidden] (the embeddings, updated in place); returns
        final_norm [hidden](x) [T, hidden]. inter: the MLP's width; k_cache, v_cache [layers,
        blocks, block size, Hkv, D] (float32 or float16); the rest as rope_store_kv and attend
        take them. The layers' scratch is cpu_kernels.c's own."""
        tokens, hidden = x.shape
        dim = k_cache.shape[-1]
        _expect(tuple(final_norm.shape) == (hidden,) and k_cache.dim() == 5 and k_cache.shape == v_cache.shape
                and k_cache.shape[0] == len(table) and k_cache.shape[3:] == (kv_heads, dim)
                and cos.shape[1] == dim and sin.shape == cos.shape and tuple(positions.shape) == (tokens,)
                and tuple(slots.shape) == (tokens,) and tuple(token_seqs.shape) == (tokens,)
                and kv_slots.dim() == 2 and heads % kv_heads == 0
                and all((p.qkv.n, p.o_proj.n, p.gate_up.n, p.down.n)
                        == ((heads + 2 * kv_heads) * dim, hidden, 2 * inter, hidden)
                        for p in table[:1]),  # (the table's layers are alike: `layer_table`)
                lambda: f"decoder_layers: x {tuple(x.shape)}, {heads}/{kv_heads} heads, cache "
                f"{tuple(k_cache.shape)}, positions {tuple(positions.shape)}, slots {tuple(slots.shape)}, "
                f"token_seqs {tuple(token_seqs.shape)}, kv_slots {tuple(kv_slots.shape)}")
        h = torch.empty_like(x)
        k_data, v_data, f16 = _cache_pointers(k_cache, v_cache)
        status = self._lib.decoder_layers(
            table, len(table), _ptr(final_norm), _ptr(x), _ptr(h), tokens, hidden, heads, kv_heads, dim,
            inter, eps, scale, _ptr(positions, torch.int64), _ptr(cos), _ptr(sin), _ptr(slots, torch.int64),
            _ptr(token_seqs, torch.int64), _ptr(kv_slots, torch.int64), kv_slots.shape[1], k_data, v_data,
            k_cache.stride(0), f16)
        if status != 0:
            raise MemoryError("decoder_layers: no memory for the attention scores or the quantized rows")
        return h

    def draft_chain(self, table: ctypes.Array, final_norm: torch.Tensor, lm_head: PanelWeight | QuantizedPanelWeight,
                    embed: torch.Tensor | QuantizedPanelWeight, feeds: list[list[int]], steps_of: list[int],
                    first_position: list[int], slots: list[int], kv_slots: list[int], temperatures: list[float],
                    keys: list[int], widths: list[int], heads: int, kv_heads: int, inter: int, eps: float, scale: float,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                    ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor] | None:
        """A draft's passes, each request's pick fed to its next pass (cpu_kernels.c's draft_chain:
        decoder_layers, the LM head on each request's last token, the pick). Request i takes
        steps_of[i] passes from position first_position[i], the first feeding feeds[i]; slots: the
        cache slots of what it feeds (feeds[i], then its picks but the last), one request's after
        another's; kv_slots: each request's slots by position, S rows of equal length, flat;
        widths[i] (its q's size; 0: the argmax; -b: the argmax, and the first pass's b largest
        logits' ids in ids[i, 0, :b], a greedy tree's root children), temperatures[i] and keys[i]
        (its DRAFT stream key) choose its picks. Lists in, since each tensor checked between passes
        costs microseconds: -> (each request's picks, ids [S, steps, n], q [S, steps, n]: a sampled pick's top tokens
        and their q), or None where a sampled row's logits held a NaN (the passes' K/V then in the
        cache)."""
        seqs, vocab, hidden = len(feeds), lm_head.out_features, final_norm.shape[0]
        steps, feed = max(steps_of, default=0), [t for fed in feeds for t in fed]
        span = len(kv_slots) // max(seqs, 1)
        _expect(seqs > 0 and len(steps_of) == len(first_position) == len(temperatures) == len(keys) == len(widths)
                == seqs and min(steps_of) > 0 and min(map(len, feeds)) > 0 and 0 <= min(feed) and max(feed) < vocab
                and max(map(abs, widths)) <= vocab and len(slots) == len(feed) + sum(steps_of) - seqs
                and len(kv_slots) == span * seqs and lm_head.in_features == hidden
                and all(0 <= p and p + len(fed) + n - 1 <= span
                        for p, fed, n in zip(first_position, feeds, steps_of))
                and (isinstance(embed, QuantizedPanelWeight) or tuple(embed.shape) == (vocab, hidden)),
                lambda: f"draft_chain: feeds of {list(map(len, feeds))} tokens, steps {steps_of}, positions "
                f"{first_position}, {len(slots)} slots, {len(kv_slots)} kv slots, widths {widths}, vocab {vocab}")
        keys = [k - (1 << 64) if k >= 1 << 63 else k for k in keys]  # (uint64 bits)
        # The indices in one buffer, split into views
        host = torch.frombuffer(array("q", [*kv_slots, *slots, *first_position, *steps_of, *widths, *keys,
                                            *map(len, feeds), *feed, *[0] * (seqs * steps)]), dtype=torch.int64)
        picks = host[len(host) - seqs * steps:]
        width = max(map(abs, widths))
        ids = torch.empty(seqs, steps, width, dtype=torch.int64)  # (past a row's width: unread)
        q = torch.empty(seqs, steps, width)
        head = _projection(lm_head)
        codes = _projection(embed) if isinstance(embed, QuantizedPanelWeight) else None
        k_data, v_data, f16 = _cache_pointers(k_cache, v_cache)
        counts = [len(kv_slots), len(slots), seqs, seqs, seqs, seqs, seqs]  # (the parts before `feed`)
        kv_at, slots_at, first_at, steps_at, widths_at, keys_at, lengths_at, feed_at = (
            host.data_ptr() + 8 * offset for offset in itertools.accumulate(counts, initial=0))
        temperature = torch.frombuffer(array("f", temperatures), dtype=torch.float32)
        status = self._lib.draft_chain(
            table, len(table), _ptr(final_norm), ctypes.byref(head), None if codes else _ptr(embed),
            ctypes.byref(codes) if codes else None, vocab, seqs, steps, steps_at, feed_at, lengths_at,
            picks.data_ptr(), first_at, slots_at, kv_at, span, _ptr(temperature), keys_at, widths_at, ids.shape[2],
            _ptr(ids, torch.int64), _ptr(q), hidden, heads, kv_heads, k_cache.shape[-1], inter, eps, scale, _ptr(cos),
            _ptr(sin), k_data, v_data, k_cache.stride(0), f16)
        if status == -1:
            raise MemoryError("draft_chain: no memory for the passes' scratch")
        if status:
            return None
        chosen = picks.tolist()
        return [chosen[i * steps:i * steps + n] for i, n in enumerate(steps_of)], ids, q

    def distinct_children(self, ids: torch.Tensor, q: torch.Tensor, first: int, count: int, keys: list[int],
                          position: int) -> tuple[list[int], torch.Tensor]:
        """Up to `count` children of one node drawn from q without replacement (cpu_kernels.c's
        distinct_children): `first` (drawn already), then child j from q less the children before
        it with the uniform of DRAFT stream keys[j] at `position`. ids [n] int64, q [n] float32 ->
        (the children, rows [count, n]: row j child j's distribution; row 0 unwritten)."""
        width = ids.shape[0]
        _expect(ids.dim() == 1 and q.shape == ids.shape and width > 0 and len(keys) == count >= 1 and position >= 0,
                lambda: f"distinct_children: ids {tuple(ids.shape)}, q {tuple(q.shape)}, count {count}, "
                        f"{len(keys)} keys, position {position}")
        host = torch.frombuffer(array("q", [k - (1 << 64) if k >= 1 << 63 else k for k in keys] + [0] * count),
                                dtype=torch.int64)  # keys (uint64 bits), then the children
        rows = torch.empty(count, width)
        made = self._lib.distinct_children(_ptr(q), _ptr(ids, torch.int64), width, first, count, host.data_ptr(),
                                           position, host.data_ptr() + 8 * count, _ptr(rows))
        return host[count:count + made].tolist(), rows

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                     eps: float) -> None:
        """x [T, H] += delta [T, H] (None: nothing to add), then out [T, H] = RMSNorm(x) * weight [H]."""
        rows, dim = x.shape
        _expect(tuple(weight.shape) == (dim,) and out.shape == x.shape and (delta is None or delta.shape == x.shape),
                lambda: f"add_rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}")
        self._lib.add_rms_norm(_ptr(x), None if delta is None else _ptr(delta), _ptr(weight), _ptr(out), rows, dim,
                               eps)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, I] = silu(gate) * up, gate_up [T, 2 I] (gate first)."""
        rows, inter = out.shape
        _expect(tuple(gate_up.shape) == (rows, 2 * inter),
                lambda: f"silu_mul: {tuple(gate_up.shape)} -> {tuple(out.shape)}")
        self._lib.silu_mul(_ptr(gate_up), _ptr(out), rows, inter)

    def rope_store_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, head_norm: torch.Tensor | None, eps: float,
                      slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Rotate q and k of qkv [T, (H + 2 Hkv) D] in place by positions [T] (cos, sin [P, D]), after
        head_norm [H + Hkv, D] (Qwen3; None: none); write k and v to the cache rows slots [T] of
        k_cache, v_cache [blocks, block size, Hkv, D] (float32, or float16: rounded to nearest)."""
        tokens, dim = qkv.shape[0], cos.shape[1]
        _expect(qkv.shape[1] == (heads + 2 * kv_heads) * dim and tuple(positions.shape) == (tokens,)
                and tuple(slots.shape) == (tokens,) and sin.shape == cos.shape
                and k_cache.shape[2:] == (kv_heads, dim) and v_cache.shape == k_cache.shape
                and (head_norm is None or tuple(head_norm.shape) == (heads + kv_heads, dim)),
                lambda: f"rope_store_kv: qkv {tuple(qkv.shape)}, {heads}/{kv_heads} heads of {dim}, "
                f"cache {tuple(k_cache.shape)}")
        self._lib.rope_store_kv(_ptr(qkv), tokens, heads, kv_heads, dim, _ptr(positions, torch.int64), _ptr(cos),
                                _ptr(sin), None if head_norm is None else _ptr(head_norm), eps,
                                _ptr(slots, torch.int64), *_cache_pointers(k_cache, v_cache))

    def attend(self, qkv: torch.Tensor, heads: int, kv_heads: int, token_seqs: torch.Tensor,
               positions: torch.Tensor, kv_slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, out: torch.Tensor) -> None:
        """out [T, H D] = causal attention of the rotated q in qkv [T, (H + 2 Hkv) D] over the cache rows
        kv_slots [B, L] of each token's sequence token_seqs [T], keys 0..positions[t] (k_cache,
        v_cache: float32 or float16)."""
        tokens, dim = qkv.shape[0], k_cache.shape[-1]
        _expect(qkv.shape[1] == (heads + 2 * kv_heads) * dim and tuple(out.shape) == (tokens, heads * dim)
                and tuple(token_seqs.shape) == (tokens,) and tuple(positions.shape) == (tokens,)
                and kv_slots.dim() == 2 and k_cache.shape == v_cache.shape and heads % kv_heads == 0,
                lambda: f"attend: qkv {tuple(qkv.shape)}, out {tuple(out.shape)}, kv_slots {tuple(kv_slots.shape)}")
        k_data, v_data, f16 = _cache_pointers(k_cache, v_cache)
        status = self._lib.attend(_ptr(qkv), tokens, heads, kv_heads, dim, _ptr(token_seqs, torch.int64),
                                  _ptr(positions, torch.int64), _ptr(kv_slots, torch.int64), kv_slots.shape[1],
                                  k_data, v_data, scale, _ptr(out), f16)
        if status != 0:
            raise MemoryError("attend: no memory for the attention scores")

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[M] int64: torch.argmax(x [M, N], dim=-1) (the first of equal values; a row's first NaN)."""
        rows, cols = x.shape
        _expect(cols > 0, lambda: f"argmax: x {tuple(x.shape)} has no columns")
        out = torch.empty(rows, dtype=torch.int64)
        self._lib.argmax_rows(_ptr(x), rows, cols, _ptr(out, torch.int64))
        return out

    def sample_top(self, x: torch.Tensor, rows: list[int], widths: list[int], temperatures: list[float],
                   u: list[float], ids: torch.Tensor, q: torch.Tensor) -> list[int]:
        """A sampled token from each of the logits' rows x[rows[i]] (x [N, V]): ids[i, :widths[i]] =
        its widths[i] largest logits' indices, largest first; q[i, :widths[i]] = their softmax at
        temperatures[i]; -> the index into ids[i] of the token the uniform u[i] draws from q[i] by
        inverse CDF, -1 for a row holding a NaN (ids [S, n] int64, q [S, n]). One check for all
        rows, then a call a row: each row's address worked out, no tensor made per row."""
        count, vocab = len(rows), x.shape[-1]
        _expect(x.dim() == 2 and all(0 <= r < x.shape[0] for r in rows) and len(widths) == len(temperatures)
                == len(u) == count and ids.shape == q.shape == (count, ids.shape[1])
                and all(0 < w <= min(vocab, ids.shape[1]) for w in widths),
                lambda: f"sample_top: x {tuple(x.shape)}, rows {rows}, widths {widths}, ids {tuple(ids.shape)}")
        x_at, ids_at, q_at, n = _ptr(x), _ptr(ids, torch.int64), _ptr(q), ids.shape[1]
        return [self._lib.sample_top(x_at + 4 * row * vocab, vocab, width, temperature, draw, ids_at + 8 * i * n,
                                     q_at + 4 * i * n)
                for i, (row, width, temperature, draw) in enumerate(zip(rows, widths, temperatures, u))]

    def verify_sampled_chains(self, logits: list[torch.Tensor], temperatures: list[float], drafts: list[list[int]],
                              q_ids: list[torch.Tensor], q_probs: list[torch.Tensor], u_accept: torch.Tensor,
                              u_target: torch.Tensor) -> list[tuple[int, int] | None]:
        """(accepted count, next token) of each temperature-only request's chain b: logits[b]
        [K_b + 1, V], drafts[b] (K_b tokens), its q as q_ids[b] / q_probs[b] [K_b, n_b], uniforms
        u_accept [B, K_max] and u_target [B, K_max + 1] (float64); None for a request whose walk
        reads a NaN. One check of all, then a call a request, its uniforms' addresses worked out."""
        count, width = len(logits), u_target.shape[-1]
        vocab = logits[0].shape[-1] if logits else 0
        _expect(len(temperatures) == len(drafts) == len(q_ids) == len(q_probs) == count
                and tuple(u_target.shape) == (count, width) and tuple(u_accept.shape) == (count, width - 1)
                and all(x.dim() == 2 and x.shape == (len(d) + 1, vocab) and len(d) < width and i.dim() == 2
                        and i.shape[0] == len(d) and p.shape == i.shape and all(0 <= t < vocab for t in d)
                        for x, d, i, p in zip(logits, drafts, q_ids, q_probs)),
                lambda: f"verify_sampled_chains: logits {[tuple(x.shape) for x in logits]}, drafts {drafts}, "
                        f"q {[tuple(i.shape) for i in q_ids]}, u {tuple(u_accept.shape)} / {tuple(u_target.shape)}")
        tokens = torch.tensor([d + [0] * (width - 1 - len(d)) for d in drafts], dtype=torch.int64)  # [B, K_max]
        out, scratch = torch.zeros(count, dtype=torch.int64), torch.empty(vocab)
        tokens_at, accept_at, target_at = _ptr(tokens, torch.int64), _ptr(u_accept, torch.float64), _ptr(
            u_target, torch.float64)
        out_at, scratch_at = _ptr(out, torch.int64), _ptr(scratch)
        accepted = [self._lib.verify_sampled_chain(
            _ptr(x), len(d), vocab, t, tokens_at + 8 * b * (width - 1), _ptr(i, torch.int64), _ptr(p), i.shape[1],
            accept_at + 8 * b * (width - 1), target_at + 8 * b * width, scratch_at, out_at + 8 * b)
            for b, (x, t, d, i, p) in enumerate(zip(logits, temperatures, drafts, q_ids, q_probs))]
        return [None if a < 0 else (a, n) for a, n in zip(accepted, out.tolist())]

    def verify_sampled_tree(self, logits: torch.Tensor, temperature: float, tokens: list[int], parents: list[int],
                            q_ids: torch.Tensor, q_probs: torch.Tensor, u_accept: torch.Tensor, u_next: torch.Tensor
                            ) -> tuple[list[int], int] | None:
        """(accepted nodes from the root down, next token) of one temperature-only request's tree
        (specdec.sampling.tree.tree_verify's walk): logits [1 + N, V], tokens and parents [N]
        (depth-first), q of each node q_ids / q_probs [N, n], uniforms u_accept [N] and u_next
        [depth + 1] (float64); None where the walk reads a NaN."""
        nodes, vocab = len(tokens), logits.shape[-1]
        depths: list[int] = []
        for i, parent in enumerate(parents):
            depths.append(1 if parent < 0 else depths[parent] + 1 if 0 <= parent < i else nodes + 1)
        deepest = max(depths, default=0)
        _expect(logits.dim() == 2 and logits.shape[0] == nodes + 1 and len(parents) == nodes
                and all(0 <= t < vocab for t in tokens) and deepest <= nodes and q_ids.dim() == 2
                and q_ids.shape[0] == nodes and q_ids.shape[1] <= vocab and q_probs.shape == q_ids.shape
                and tuple(u_accept.shape) == (nodes,) and u_next.dim() == 1 and u_next.shape[0] > deepest,
                lambda: f"verify_sampled_tree: logits {tuple(logits.shape)}, tokens {tokens}, parents {parents}, "
                        f"q {tuple(q_ids.shape)}, u {tuple(u_accept.shape)} / {tuple(u_next.shape)}")
        ints = torch.tensor([*tokens, *parents, *[0] * (nodes + 1)], dtype=torch.int64)  # tokens, parents, path, next
        scratch = torch.empty(2 * vocab)
        at = _ptr(ints, torch.int64)
        depth = self._lib.verify_sampled_tree(
            _ptr(logits), nodes, vocab, temperature, at, at + 8 * nodes, _ptr(q_ids, torch.int64), _ptr(q_probs),
            q_ids.shape[1], _ptr(u_accept, torch.float64), _ptr(u_next, torch.float64), _ptr(scratch),
            at + 16 * nodes, at + 24 * nodes)
        if depth < 0:
            return None
        out = ints[2 * nodes:].tolist()
        return out[:depth], out[-1]


def row_argmax(x: torch.Tensor, kernels: CpuKernels | None) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [..., N]: in `kernels` (a model's, None: torch) for a float32
    CPU tensor, ~20x faster than torch's CPU argmax over a vocabulary; the same indices."""
    if kernels is None or x.device.type != "cpu" or x.dtype != torch.float32 or not x.numel():
        return x.argmax(dim=-1)
    return kernels.argmax(x.reshape(-1, x.shape[-1]).contiguous()).view(x.shape[:-1])


def _cpu_identity() -> str:
    """The CPU's model name and feature flags: what -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library for this source, compiler and CPU: from the cache, else built now.
    extra_flags: for tests (e.g. -mno-avx512vnni builds the portable integer products)."""
    flags = [*FLAGS, *extra_flags]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(flags), version,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    library = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, library)
    return library


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The kernels, or None where they cannot be built (after one warning)."""
    compiler = os.environ.get("CC", "cc")
    try:
        return open_kernels(_build(compiler))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("specdec's CPU kernels are unavailable (%s); running torch's ops instead, which is "
                    "slower for small models and not batch-invariant", error)
        return None


def open_kernels(path: Path) -> CpuKernels:
    """A built library, its functions typed."""
    library = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    return CpuKernels(library)
