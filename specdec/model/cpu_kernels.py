"""specdec's C kernels (cpu_kernels.c) for the small ops of a float32 forward pass on CPU.

The library is compiled on first use with the system's C compiler ($CC, else cc) for this CPU
(-march=native) and loaded with ctypes: the C file needs only libc and libm and compiles in well
under a second, where a torch C++ extension would take a minute of header parsing on every fresh
machine. It is kept in specdec's cache ($SPECDEC_CACHE_DIR/kernels, default ~/.cache/specdec/kernels)
under a name that hashes
the source, the flags, the compiler's version and the CPU's model and feature flags, so a cache
shared between machines never loads code built for another CPU; it is written to a temporary
file and renamed, so workers compiling at once never load a half-written library. Without a
compiler, or when the build fails, load_cpu_kernels() returns None after one warning and models
run torch's ops instead (the same results to float32 rounding).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

from specdec.config import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c11"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # argument types of each C function, in cpu_kernels.c's order
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "silu_mul": [_P, _P, _I, _I],
    "rope_store_kv": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _F, _P, _P, _P],
    "attend": [_P, _I, _I, _I, _I, _P, _P, _P, _I, _P, _P, _F, _P, _P],
}


def _cpu_identity() -> str:
    """The CPU's model name and feature flags: what -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _build(compiler: str) -> Path:
    """The compiled library for this source, compiler and CPU: from the cache, else built now."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    library = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, library)
    return library


@functools.cache
def load_cpu_kernels() -> ctypes.CDLL | None:
    """The loaded library (each function's argument types set), or None where it cannot be built."""
    compiler = os.environ.get("CC", "cc")
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("specdec's CPU kernels are unavailable (%s); running torch's ops instead, "
                    "which is slower for small models", error)
        return None
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, None
    return library
