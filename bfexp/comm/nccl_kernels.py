"""The fused weighted-average kernel of the NCCL engine, written with CuPy.

A neighbor allreduce ends with ``out = w_0 x_0 + w_1 x_1 + ... + w_k x_k``
(the self value and every received buffer). Done with torch ops that is
k+1 passes over memory, each re-reading the partial sum; this kernel reads
each input once and writes the output once, so it is bounded by memory
bandwidth like a device-to-device copy (scripts/bench_nccl_kernel.py
compares the two).

One CUDA source is generated per (number of inputs, dtype) and compiled
once by NVRTC through ``cupy.RawKernel``; weights are kernel arguments, so
new weights every call (dynamic topologies) never recompile. Sums run in
float32 for 16-bit inputs and in the input type otherwise, rounding once
at the end. float16 and bfloat16 are moved as raw 16-bit words and
converted with PTX ``cvt`` (float16) and bit shifts with round-to-nearest-
even (bfloat16), so no CUDA header is needed at compile time. float32 and
float64 use 16-byte vector loads when every pointer is 16-byte aligned.

CuPy is imported lazily: this module imports on a machine without it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

# dtype name -> (C storage type, C accumulator type, numpy scalar type of a weight)
KINDS = {
    "float32": ("float", "float", "float32"),
    "float64": ("double", "double", "float64"),
    "float16": ("unsigned short", "float", "float32"),
    "bfloat16": ("unsigned short", "float", "float32"),
}
# 16-byte vector type per dtype that has one, with its lane count.
VECTORS = {"float32": ("float4", 4), "float64": ("double2", 2)}
BLOCK = 256

# 16-bit <-> float32 conversions, the prelude of a 16-bit kernel. float16 uses the GPU's own
# conversion instructions (PTX cvt: device only); bfloat16 is bit shifts, written for host and
# device alike, so tests/comm/test_kernel_compile.py checks this very text in a host build against
# torch over every 16-bit pattern. Unions rather than __uint_as_float: no header needed either side.
F16_CONVERSIONS = r"""
__device__ __forceinline__ float h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
"""
BF16_CONVERSIONS = r"""
__host__ __device__ __forceinline__ float b2f(unsigned short b) {
    union { unsigned int u; float f; } v;
    v.u = ((unsigned int)b) << 16;
    return v.f;
}
__host__ __device__ __forceinline__ unsigned short f2b(float f) {
    union { float f; unsigned int u; } v;
    v.f = f;
    unsigned int u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (unsigned short)(u >> 16);
}
"""
PRELUDES = {"float32": "", "float64": "", "float16": F16_CONVERSIONS, "bfloat16": BF16_CONVERSIONS}

_LOAD = {"float32": "{}", "float64": "{}", "float16": "h2f({})", "bfloat16": "b2f({})"}
_STORE = {"float32": "{}", "float64": "{}", "float16": "f2h({})", "bfloat16": "f2b({})"}


def kernel_name(k: int, kind: str, vector: bool) -> str:
    return f"weighted_sum_{kind}_{k}{'_vec' if vector else ''}"


def forms(inputs: Sequence[int] = range(1, 9)) -> list[tuple[int, str, bool]]:
    """Every ``(k, kind, vector)`` that ``weighted_sum`` may compile, for these input counts: each
    kind in scalar form, and in vector form where it has one (taken when every pointer is aligned)."""
    return [(k, kind, vector) for kind in KINDS for vector in (False, True)[: 1 + (kind in VECTORS)] for k in inputs]


def kernel_source(k: int, kind: str, vector: bool) -> str:
    """CUDA C for ``out[i] = sum_j w_j * x_j[i]`` over ``k`` inputs (grid-stride loop)."""
    if k < 1:
        raise ValueError(f"k={k}; allowed: at least one input")
    storage, acc, _ = KINDS[kind]
    if vector and kind not in VECTORS:
        raise ValueError(f"no vector form for {kind}; allowed: {', '.join(VECTORS)}")
    params = [f"const {storage}* x{j}" for j in range(k)]
    params += [f"const {acc} w{j}" for j in range(k)]
    params += [f"{storage}* out", "const long long n"]
    load = _LOAD[kind]
    scalar_sum = " + ".join(f"w{j} * {load.format(f'x{j}[i]')}" for j in range(k))
    scalar_loop = (
        "    for (; i < n; i += stride) {\n"
        f"        const {acc} s = {scalar_sum};\n"
        f"        out[i] = {_STORE[kind].format('s')};\n"
        "    }\n"
    )
    body = "    const long long stride = (long long)gridDim.x * blockDim.x;\n"
    body += "    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
    if vector:
        vtype, lanes = VECTORS[kind]
        fields = "xyzw"[:lanes]
        loads = "".join(f"        const {vtype} a{j} = reinterpret_cast<const {vtype}*>(x{j})[i];\n" for j in range(k))
        lanes_code = "".join(
            f"        r.{f} = " + " + ".join(f"w{j} * a{j}.{f}" for j in range(k)) + ";\n" for f in fields
        )
        body += (
            f"    const long long nv = n / {lanes};\n"
            "    for (; i < nv; i += stride) {\n"
            f"{loads}"
            f"        {vtype} r;\n"
            f"{lanes_code}"
            f"        reinterpret_cast<{vtype}*>(out)[i] = r;\n"
            "    }\n"
            # The tail (< lanes elements) in scalar form, continuing the same index pattern.
            f"    i = nv * {lanes} + (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
        )
    body += scalar_loop
    name = kernel_name(k, kind, vector)
    return f'{PRELUDES[kind]}extern "C" __global__ void {name}({", ".join(params)}) {{\n{body}}}\n'


@lru_cache(maxsize=None)
def _kernel(k: int, kind: str, vector: bool) -> Any:
    import cupy

    return cupy.RawKernel(kernel_source(k, kind, vector), kernel_name(k, kind, vector))


@lru_cache(maxsize=None)
def _max_blocks(device_id: int) -> int:
    """Enough resident blocks to fill every SM; the grid-stride loop covers the rest."""
    import cupy

    sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    return sms * (2048 // BLOCK) * 2


def kind_of(array: Any, kind: str | None = None) -> str:
    """The kernel kind of a CuPy array; bfloat16 travels as 16-bit words and must be named."""
    if kind is not None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}; allowed: {', '.join(KINDS)}")
        return kind
    name = str(array.dtype)
    if name not in KINDS or name == "bfloat16":
        raise TypeError(f"weighted_sum needs float32, float64 or float16 arrays (bfloat16 as kind=...), got {name}")
    return name


def weighted_sum(
    inputs: Sequence[Any],
    weights: Sequence[float],
    out: Any | None = None,
    kind: str | None = None,
) -> Any:
    """``sum_j weights[j] * inputs[j]`` in one pass, on CuPy's current stream.

    ``inputs`` are contiguous CuPy arrays of one dtype and size (bfloat16
    data as uint16/int16 arrays with ``kind='bfloat16'``). ``out`` may be
    one of the inputs (each element is read before it is written).
    """
    import cupy
    import numpy

    if len(inputs) != len(weights) or not inputs:
        raise ValueError(f"{len(inputs)} inputs and {len(weights)} weights; allowed: the same number, at least one")
    kind = kind_of(inputs[0], kind)
    first = inputs[0]
    for x in inputs:
        if x.dtype != first.dtype or x.size != first.size:
            raise ValueError(f"inputs differ: {x.dtype}[{x.size}] vs {first.dtype}[{first.size}]")
        if not x.flags.c_contiguous:
            raise ValueError("weighted_sum needs contiguous inputs")
    if out is None:
        out = cupy.empty_like(first)
    elif out.dtype != first.dtype or out.size != first.size or not out.flags.c_contiguous:
        raise ValueError("out must be contiguous and match the inputs' dtype and size")
    n = first.size
    if n == 0:
        return out
    to_weight = getattr(numpy, KINDS[kind][2])
    vector = kind in VECTORS and all(a.data.ptr % 16 == 0 for a in (*inputs, out))
    lanes = VECTORS[kind][1] if vector else 1
    work = -(-n // lanes)
    blocks = max(1, min(-(-work // BLOCK), _max_blocks(first.device.id)))
    args = (*inputs, *(to_weight(w) for w in weights), out, numpy.int64(n))
    _kernel(len(inputs), kind, vector)((blocks,), (BLOCK,), args)
    return out
