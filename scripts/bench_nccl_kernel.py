"""Bandwidth of the NCCL engine's fused weighted-average kernel vs a device-to-device copy.

    python scripts/bench_nccl_kernel.py                 # 3 and 5 inputs of 64M float32
    python scripts/bench_nccl_kernel.py --dtype float32 bfloat16 --json kernel.json
    python scripts/bench_nccl_kernel.py --inputs 2 3 5 9 --elements 16777216 --dtype float16

The kernel reads k inputs and writes one output, so its effective bandwidth
is (k+1)*bytes/time; a cudaMemcpy device-to-device copy of one input moves
2*bytes/time. Both are measured in the same run on the same GPU with CUDA
events (median of --repeats), and the ratio is what the target (>= 70%)
is about. The unfused column is what torch-style code does without the
kernel: ``out = w0*x0`` then ``out += w_j*x_j`` per input (k passes plus
temporaries), for comparison (not for bfloat16, which CuPy cannot compute
in: it travels as 16-bit words, as in the engine). Every measured result is
checked against a float64 sum on its first 1M elements. Exits 1 when a ratio
falls below --min-ratio or a result is wrong, 2 when there is no GPU to run on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

# Largest |kernel - float64 sum| accepted on standard-normal inputs averaged with weights 1/k:
# a few units in the last place of the stored type (one rounding of values up to ~5).
TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "float16": 1e-2, "bfloat16": 5e-2}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", type=int, nargs="+", default=[3, 5], help="numbers of inputs k (self + received)")
    p.add_argument("--elements", type=int, default=64 * 2**20, help="elements per input (default 64M)")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=list(TOLERANCE), help="one or more dtypes")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per measurement; the median is reported")
    p.add_argument("--min-ratio", type=float, default=0.70, help="target: kernel bandwidth / copy bandwidth")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p.parse_args(argv)


def time_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() on the current stream, timed with CUDA events after a warm-up."""
    import cupy

    fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def measure(dtype: str, n: int, inputs: list[int], repeats: int, rng) -> list[dict]:
    """Kernel, copy and unfused times for each input count of one dtype (bfloat16 as 16-bit words)."""
    import cupy

    from bfexp.comm.nccl_kernels import weighted_sum

    words = dtype == "bfloat16"  # CuPy has no bfloat16: its upper 16 bits of float32, as uint16

    def sample():
        x = rng.standard_normal(n, dtype=cupy.float32)
        return (x.view(cupy.uint32) >> 16).astype(cupy.uint16) if words else x.astype(dtype)

    def as_float64(x):
        return (x[: 1 << 20].astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64) if words \
            else x[: 1 << 20].astype(cupy.float64)

    src = sample()
    nbytes = n * src.itemsize
    dst = cupy.empty_like(src)

    def copy() -> None:
        dst.data.copy_from_device_async(src.data, nbytes)

    copy_ms = time_ms(copy, repeats)
    copy_gbps = 2 * nbytes / copy_ms / 1e6
    rows = []
    for k in inputs:
        xs = [src] + [sample() for _ in range(k - 1)]
        ws = [1.0 / k] * k
        out = cupy.empty_like(src)
        kind = "bfloat16" if words else None
        kernel_ms = time_ms(lambda: weighted_sum(xs, ws, out=out, kind=kind), repeats)

        def unfused() -> None:
            acc = xs[0] * ws[0]
            for x, w in zip(xs[1:], ws[1:]):
                acc += x * w

        unfused_ms = None if words else time_ms(unfused, max(3, repeats // 4))
        # The measured kernel must be right: compare with a float64 reference on a slice.
        ref = sum(w * as_float64(x) for x, w in zip(xs, ws))
        err = float(cupy.max(cupy.abs(as_float64(out) - ref)))
        kernel_gbps = (k + 1) * nbytes / kernel_ms / 1e6
        rows.append({
            "inputs": k,
            "elements": n,
            "dtype": dtype,
            "kernel_time_ms": kernel_ms,
            "kernel_bandwidth_gb_per_s": kernel_gbps,
            "copy_time_ms": copy_ms,
            "copy_bandwidth_gb_per_s": copy_gbps,
            "ratio": kernel_gbps / copy_gbps,
            "unfused_time_ms": unfused_ms,
            "max_abs_error": err,
        })
        xs = out = None  # free before the next size
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bfexp.comm.nccl import nccl_available

    ok, reason = nccl_available(1)
    if not ok:
        print(f"bench_nccl_kernel: cannot run here: {reason}", file=sys.stderr)
        return 2
    import cupy

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    n = args.elements
    rng = cupy.random.default_rng(0)
    rows = []
    for dtype in args.dtype:
        rows += measure(dtype, n, args.inputs, args.repeats, rng)
    print(f"GPU: {gpu} (CuPy {cupy.__version__}); {n} elements per input; median of {args.repeats}")
    print("| dtype | inputs | kernel ms | kernel GB/s | copy GB/s | ratio | unfused ms | max abs error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        unfused = "-" if r["unfused_time_ms"] is None else f"{r['unfused_time_ms']:.3f}"
        print(
            f"| {r['dtype']} | {r['inputs']} | {r['kernel_time_ms']:.3f} | {r['kernel_bandwidth_gb_per_s']:.0f} | "
            f"{r['copy_bandwidth_gb_per_s']:.0f} | {r['ratio']:.1%} | {unfused} | {r['max_abs_error']:.2e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "cupy": cupy.__version__, "rows": rows}, f, indent=2)
    wrong = [f"{r['dtype']} k={r['inputs']}" for r in rows if not r["max_abs_error"] <= TOLERANCE[r["dtype"]]]
    if wrong:
        print(f"wrong results (max abs error above the dtype's tolerance) for {', '.join(wrong)}", file=sys.stderr)
        return 1
    below = [f"{r['dtype']} k={r['inputs']}" for r in rows if r["ratio"] < args.min_ratio]
    if below:
        print(f"below the target ratio {args.min_ratio:.0%} for {', '.join(below)}", file=sys.stderr)
        return 1
    print(f"every ratio meets the target ({args.min_ratio:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
