"""The NCCL engine's fused weighted-average kernel against numpy.

The numeric tests need a GPU and skip elsewhere with the reason. The
NVRTC test compiles every generated kernel source without a GPU, wherever
CuPy can load NVRTC (a GPU machine, or a CuPy install with the
nvidia-cuda-nvrtc wheel); it catches CUDA C mistakes before a GPU sees them.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from bfexp.comm import nccl_kernels as K
from bfexp.comm.nccl import nccl_available

GPU_OK, GPU_REASON = nccl_available(1)
needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs a GPU with CuPy and NCCL: {GPU_REASON}")


def _nvrtc():
    if importlib.util.find_spec("cupy") is None:
        return None, "CuPy is not installed (extras cuda12/cuda13)"
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy without a loadable NVRTC
        return None, f"CuPy cannot load NVRTC: {str(exc).splitlines()[0]}"
    return nvrtc, ""


def test_kernel_sources_compile_with_nvrtc():
    nvrtc, reason = _nvrtc()
    if nvrtc is None:
        pytest.skip(reason)
    for k, kind, vector in K.forms((1, 2, 3, 5, 9)):
        src = K.kernel_source(k, kind, vector)
        prog = nvrtc.createProgram(src, "weighted_sum.cu", [], [])
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_75", "-std=c++17"])
        except Exception as exc:
            pytest.fail(f"{kind} k={k} vector={vector}: {exc}\n{nvrtc.getProgramLog(prog)}\n{src}")
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        assert f".entry {K.kernel_name(k, kind, vector)}" in ptx
        if vector:  # one 16-byte load per input per iteration
            assert "ld.global.v" in ptx


def test_kernel_source_refuses_bad_shapes():
    with pytest.raises(ValueError, match="at least one input"):
        K.kernel_source(0, "float32", False)
    with pytest.raises(ValueError, match="no vector form"):
        K.kernel_source(2, "float16", True)


# ------------------------------------------------------------------ on a GPU
TOLERANCES = {"float32": (1e-6, 1e-5), "float64": (1e-13, 1e-13), "float16": (1e-3, 3e-3)}


@needs_gpu
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_weighted_sum_matches_numpy(dtype):
    import cupy

    rng = np.random.default_rng(7)
    rtol, atol = TOLERANCES[dtype]
    for k in (1, 2, 3, 5, 9):
        for n in (0, 1, 7, 4099, 1 << 20):  # sizes off the vector width exercise the tail
            xs = [rng.standard_normal(n + 1).astype(dtype) for _ in range(k)]
            ws = rng.uniform(-1.0, 1.0, k)
            for offset in (0, 1):  # offset 1: misaligned views take the scalar path
                host = [x[offset : offset + n] for x in xs]
                ref = sum(w * x.astype(np.float64) for w, x in zip(ws, host))
                device = [cupy.asarray(x)[offset : offset + n] for x in xs]  # views of one allocation each
                got = K.weighted_sum(device, list(ws))
                np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float64), ref, rtol=rtol, atol=atol,
                                           err_msg=f"{dtype} k={k} n={n} offset={offset}")


@needs_gpu
def test_weighted_sum_in_place_and_bfloat16():
    import cupy

    rng = np.random.default_rng(3)
    n = 100_003
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    ws = [0.4, 0.3, 0.2, 0.1]
    ref = sum(w * x.astype(np.float64) for w, x in zip(ws, xs))
    arrays = [cupy.asarray(x) for x in xs]
    out = K.weighted_sum(arrays, ws, out=arrays[0])  # the self buffer becomes the result
    assert out.data.ptr == arrays[0].data.ptr
    np.testing.assert_allclose(cupy.asnumpy(arrays[0]), ref, rtol=1e-6, atol=1e-6)

    bf = [torch.from_numpy(x).to(torch.bfloat16) for x in xs]
    ref_bf = sum(w * b.double() for w, b in zip(ws, bf))
    words = [cupy.asarray(b.view(torch.int16).numpy()) for b in bf]
    got = K.weighted_sum(words, ws, kind="bfloat16")
    got_t = torch.from_numpy(cupy.asnumpy(got)).view(torch.bfloat16).double()
    # One rounding to bfloat16 at the end: within half a bfloat16 ulp of the float64 sum (plus float32 slack).
    np.testing.assert_allclose(got_t.numpy(), ref_bf.to(torch.bfloat16).double().numpy(), rtol=8e-3, atol=1e-2)


@needs_gpu
def test_torch_cuda_tensors_reach_cupy_without_copies():
    from bfexp.comm.nccl import as_cupy

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        t = torch.arange(10, dtype=dtype, device="cuda")
        assert as_cupy(t).data.ptr == t.data_ptr(), dtype


_CONVERT = r"""
extern "C" __global__ void widen(const unsigned short* w, float* from_f16, float* from_bf16, const long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { from_f16[i] = h2f(w[i]); from_bf16[i] = b2f(w[i]); }
}
extern "C" __global__ void narrow(const float* f, unsigned short* to_f16, unsigned short* to_bf16, const long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { to_f16[i] = f2h(f[i]); to_bf16[i] = f2b(f[i]); }
}
"""


@needs_gpu
def test_kernel_conversions_on_the_gpu_match_numpy_and_torch():
    """The kernels' own 16-bit conversions (the PTX cvt of float16, the bit shifts of bfloat16), run
    on the GPU through NVRTC as the engine runs them: every 16-bit pattern widened, and the float32
    spread of test_kernel_compile narrowed, bit for bit against numpy (float16) and torch (bfloat16)."""
    import cupy

    from tests.comm.test_kernel_compile import float32_spread

    module = cupy.RawModule(code=K.F16_CONVERSIONS + K.BF16_CONVERSIONS + _CONVERT)

    def launch(name: str, x: np.ndarray, out_dtype) -> tuple[np.ndarray, np.ndarray]:
        n = x.size
        a, b = cupy.empty(n, dtype=out_dtype), cupy.empty(n, dtype=out_dtype)
        module.get_function(name)((-(-n // 256),), (256,), (cupy.asarray(x), a, b, np.int64(n)))
        return cupy.asnumpy(a), cupy.asnumpy(b)

    def same(got: np.ndarray, want: np.ndarray, nan: np.ndarray, is_nan, what: str) -> None:
        """Bit for bit where the input is a number; a NaN where it is NaN (payloads may differ)."""
        assert np.array_equal(got[~nan], want[~nan]), f"{what}: {np.flatnonzero(got[~nan] != want[~nan])[:5]}"
        assert np.all(is_nan(got[nan])), f"{what}: a NaN came out as a number"

    words = np.arange(1 << 16, dtype=np.uint16)  # NaNs, infinities, subnormals, both zeros
    f16, bf16 = launch("widen", words, np.float32)
    half = words.view(np.float16)
    f32_nan = lambda bits: np.isnan(bits.view(np.float32))  # noqa: E731
    same(f16.view(np.uint32), half.astype(np.float32).view(np.uint32), np.isnan(half), f32_nan, "h2f")
    want_bf = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(bf16.view(np.uint32), want_bf.view(np.uint32)), "b2f"  # payloads kept too

    values = float32_spread()
    to_f16, to_bf16 = launch("narrow", values, np.uint16)
    nan = np.isnan(values)
    same(to_f16, values.astype(np.float16).view(np.uint16), nan, lambda w: np.isnan(w.view(np.float16)),
         "f2h (round to nearest even, subnormals, overflow to infinity)")
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    same(to_bf16, want, nan, _bf16_is_nan, "f2b")


def _bf16_is_nan(words: np.ndarray) -> np.ndarray:
    return ((words >> 7) & 0xFF == 0xFF) & (words & 0x7F != 0)
