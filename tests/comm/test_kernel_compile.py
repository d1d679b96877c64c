"""Every CUDA source the NCCL engine can ask for, compiled by nvcc here, with no GPU.

The engine compiles its fused weighted-average kernel at run time with NVRTC
(bfexp/comm/nccl_kernels.py), so a mistake in the generated CUDA C, or in its
inline PTX, would first show itself on a user's GPU. nvcc compiles the same
sources on any machine with the CUDA toolkit: every form (each dtype, scalar
and vector, 1 to 8 inputs and wider ones) in one translation unit per
architecture, each form in a namespace of its own, to cubin for sm_80 and
sm_90 with warnings as errors (register spills included). A failure names the
form nvcc or ptxas complains about. The bfloat16 conversions, written for
host and device alike, are also built for the host and checked against
torch's conversions over every 16-bit pattern and a spread of float32 values.
Skipped, with the reason, where nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from bfexp.comm import nccl_kernels as K


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.access(Path(home, "bin", "nvcc"), os.X_OK):
            return str(Path(home, "bin", "nvcc"))
    return None


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (on PATH, $CUDA_HOME/bin or /usr/local/cuda/bin)")

ARCHES = ("sm_80", "sm_90")  # A100 and H100/H200: the GPUs the engine is meant for
INPUTS = [*range(1, 9), 16, 64]  # a neighbor exchange of k-1 peers asks for k inputs
# NVRTC's language level; every nvcc warning, and every ptxas one (spills included), is an error.
FLAGS = ["-std=c++17", "-Werror", "all-warnings", "-Xptxas", "--warning-as-error,--warn-on-spills"]


def label(k: int, kind: str, vector: bool) -> str:
    return f"{kind} k={k} {'vector' if vector else 'scalar'}"


def every_form() -> list[tuple[str, str]]:
    """(label, source) of each form the engine may compile."""
    return [(label(*form), K.kernel_source(*form)) for form in K.forms(INPUTS)]


def translation_unit(sources: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int, str]]]:
    """One .cu of many sources, each inside its own namespace (the conversion helpers repeat), with
    the 1-based line span of each source so a compiler message can be traced to its form."""
    lines: list[str] = []
    spans = []
    for i, (name, source) in enumerate(sources):
        lines.append(f"namespace form{i} {{  // {name}")
        first = len(lines) + 1
        lines.extend(source.splitlines())
        spans.append((first, len(lines), name))
        lines.append("}")
    return "\n".join(lines) + "\n", spans


class CompileFailed(AssertionError):
    """nvcc refused a source; the message names the forms it blames."""


def compile_cubin(sources: list[tuple[str, str]], arch: str, workdir: Path) -> bytes:
    """Compile the sources as one unit to a cubin for ``arch``; CompileFailed names the failing forms."""
    workdir.mkdir(parents=True, exist_ok=True)
    text, spans = translation_unit(sources)
    cu = workdir / "kernels.cu"
    cu.write_text(text)
    cubin = workdir / f"kernels.{arch}.cubin"
    keep = workdir / f"keep.{arch}"
    keep.mkdir(exist_ok=True)
    proc = subprocess.run([NVCC, "-cubin", f"-arch={arch}", *FLAGS, "-keep", f"-keep-dir={keep}", "-o", str(cubin), str(cu)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or proc.stderr.strip():
        raise CompileFailed(f"nvcc -arch={arch} failed for: {', '.join(blamed(proc.stderr, spans, keep)) or 'no form named'}\n"
                            f"{proc.stderr.strip()}")
    return cubin.read_bytes()


def blamed(stderr: str, spans: list[tuple[int, int, str]], keep: Path) -> list[str]:
    """Forms named by nvcc's messages: front-end messages by source line, ptxas ones by the kernel
    (PTX ``.entry``) whose body holds the PTX line it names."""
    names = []
    for line in re.findall(r"kernels\.cu\((\d+)\)", stderr):
        names += [name for first, last, name in spans if first <= int(line) <= last]
    for ptx_name, line in re.findall(r"ptxas[^,\n]*?([\w.]+\.ptx), line (\d+)", stderr):
        ptx = next(keep.glob(Path(ptx_name).name), None) or next(keep.glob("*.ptx"), None)
        if ptx is None:
            continue
        text = ptx.read_text()
        entries = [m for m in re.finditer(r"\.entry (\w+)", text) if text.count("\n", 0, m.start()) < int(line)]
        if entries:
            kernel = entries[-1].group(1)
            names += [label(*form) for form in K.forms(INPUTS) if K.kernel_name(*form) == kernel]
    return list(dict.fromkeys(names))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[bytes, str]]:
    """Per architecture: the cubin of every form and the PTX nvcc made on the way."""
    out = {}
    for arch in ARCHES:
        work = tmp_path_factory.mktemp(arch)
        cubin = compile_cubin(every_form(), arch, work)
        out[arch] = (cubin, "\n".join(p.read_text() for p in (work / f"keep.{arch}").glob("*.ptx")))
    return out


@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_form_compiles_to_cubin(built, arch):
    cubin, _ = built[arch]
    assert cubin[:4] == b"\x7fELF"
    missing = [label(*f) for f in K.forms(INPUTS) if f"{K.kernel_name(*f)}\0".encode() not in cubin]
    assert not missing, f"kernels absent from the {arch} cubin: {missing}"
    assert len(K.forms(INPUTS)) == 6 * len(INPUTS)  # 4 dtypes scalar + float32/float64 vector


def test_vector_forms_load_16_bytes_per_input(built):
    """A vector form's loop reads each input with 16-byte loads (what makes it copy-speed; nvcc may
    unroll the loop, so at least one per input), a scalar form never."""
    _, ptx = built["sm_90"]
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n}\n", ptx, flags=re.S))
    for k, kind, vector in K.forms(INPUTS):
        body = bodies[K.kernel_name(k, kind, vector)]
        wide = len(re.findall(r"ld\.global(?:\.nc)?\.v(?:4\.f32|2\.f64)", body))
        assert (wide >= k) if vector else (wide == 0), (label(k, kind, vector), wide)


@pytest.mark.parametrize("breakage", ["ptx", "c"])
def test_a_broken_source_fails_naming_its_form(tmp_path, breakage):
    """The check can fail: a wrong PTX conversion (ptxas) or a C type error (front end) in one form
    fails the build, and the message names that form and not its neighbors."""
    before = (label(2, "float32", True), K.kernel_source(2, "float32", True))
    after = (label(1, "bfloat16", False), K.kernel_source(1, "bfloat16", False))
    broken = K.kernel_source(3, "float16", False)
    if breakage == "ptx":
        broken = broken.replace("cvt.rn.f16.f32", "cvt.rn.f16.f33")
    else:
        broken = broken.replace("out[i] = f2h(s);", "out[i] = &s;")
    sources = [before, (label(3, "float16", False), broken), after]
    with pytest.raises(CompileFailed) as failed:
        compile_cubin(sources, "sm_80", tmp_path)
    head = str(failed.value).splitlines()[0]
    assert head == "nvcc -arch=sm_80 failed for: float16 k=3 scalar", str(failed.value)


# ------------------------------------------------------------------ the conversions, on the host
HARNESS = r"""
#include <cstdio>
#include <cstring>
#include <vector>
%s
// conv b2f|f2b IN OUT: every 16-bit word of IN as float32, or every float32 of IN as bfloat16 words.
int main(int argc, char** argv) {
    if (argc != 4) return 2;
    FILE* in = std::fopen(argv[2], "rb");
    if (!in) return 3;
    std::vector<unsigned char> bytes;
    unsigned char buf[65536];
    size_t got;
    while ((got = std::fread(buf, 1, sizeof buf, in)) > 0) bytes.insert(bytes.end(), buf, buf + got);
    std::fclose(in);
    FILE* out = std::fopen(argv[3], "wb");
    if (!out) return 3;
    if (std::strcmp(argv[1], "b2f") == 0) {
        for (size_t i = 0; i + 2 <= bytes.size(); i += 2) {
            unsigned short b; std::memcpy(&b, &bytes[i], 2);
            float f = b2f(b); std::fwrite(&f, 4, 1, out);
        }
    } else {
        for (size_t i = 0; i + 4 <= bytes.size(); i += 4) {
            float f; std::memcpy(&f, &bytes[i], 4);
            unsigned short b = f2b(f); std::fwrite(&b, 2, 1, out);
        }
    }
    return std::fclose(out) == 0 ? 0 : 3;
}
"""


@pytest.fixture(scope="module")
def host_conversions(tmp_path_factory):
    """Run the kernels' own bfloat16 conversion text, compiled by nvcc for the host."""
    work = tmp_path_factory.mktemp("host")
    cu = work / "conv.cu"
    cu.write_text(HARNESS % K.BF16_CONVERSIONS)
    exe = work / "conv"
    proc = subprocess.run([NVCC, "-std=c++17", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror", "-o", str(exe), str(cu)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    def run(mode: str, values: np.ndarray) -> np.ndarray:
        src, dst = work / f"{mode}.in", work / f"{mode}.out"
        values.tofile(src)
        subprocess.run([str(exe), mode, str(src), str(dst)], check=True, timeout=60)
        return np.fromfile(dst, dtype=np.float32 if mode == "b2f" else np.uint16)

    return run


def torch_bf16(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def test_bfloat16_to_float32_is_exact_for_every_pattern(host_conversions):
    words = np.arange(1 << 16, dtype=np.uint16)  # NaNs, infinities, subnormals and both zeros included
    got = host_conversions("b2f", words)
    want = torch_bf16(words).float().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit, NaN payloads too


def float32_spread() -> np.ndarray:
    """Every bfloat16 value widened, each one's halfway points to its neighbors (ties: even wins)
    and one ulp either side of them, the extremes, and a million random bit patterns."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    ties = high | 0x8000
    rng = np.random.default_rng(0)
    extremes = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x80000001, 0x007FFFFF,
                         0x00008000, 0x00018000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF], dtype=np.uint32)
    bits = np.concatenate([high, ties, ties - 1, ties + 1, extremes, rng.integers(0, 1 << 32, 1_000_000, dtype=np.uint64).astype(np.uint32)])
    return bits.view(np.float32)


def test_float32_to_bfloat16_rounds_to_nearest_even_like_torch(host_conversions):
    values = float32_spread()
    got = host_conversions("f2b", values)
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(got[~nan], want[~nan]), values[~nan][got[~nan] != want[~nan]][:5]
    # NaN stays NaN with its sign (torch makes every NaN one pattern; the kernel keeps the payload's top).
    exponent, mantissa, sign = (got[nan] >> 7) & 0xFF, got[nan] & 0x7F, got[nan] >> 15
    assert nan.sum() > 1000 and np.all(exponent == 0xFF) and np.all(mantissa != 0)
    assert np.array_equal(sign, (values[nan].view(np.uint32) >> 31).astype(np.uint16))
