"""Compressors against numpy: what Q(v) keeps, the packed payload's size, and bad options.

Each compressor's payload is what an engine sends, so its size is the wire
size: checked against the format worked out by hand (values, int32 indices,
packed bits), and against the ratios the issue asks for at the MLP's size.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bfexp.compression import (
    QSGD,
    Cast,
    Compressor,
    Identity,
    RandomK,
    Sign,
    TopK,
    as_compressor,
    pack_bits,
    unpack_bits,
)
from bfexp.config import group_options
from bfexp.errors import ConfigError

D = 4810  # the MLP on digits: 64 x 64 + 64 + 64 x 10 + 10 parameters


def vector(d: int = D, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(size=d)).to(dtype)


def roundtrip(c: Compressor, v: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    payload = c.encode(v, c.generator(seed, v.device))
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == c.payload_bytes(v.numel(), v.dtype)
    return payload, c.decode(payload, v.numel(), v.dtype)


@pytest.mark.parametrize("bits", range(1, 9))
def test_bits_pack_and_unpack(bits):
    codes = torch.from_numpy(np.random.default_rng(bits).integers(0, 2**bits, size=1001)).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == math.ceil(1001 * bits / 8)
    assert torch.equal(unpack_bits(packed, 1001, bits), codes.long())
    # least significant bit first: the first code's bits are the first byte's low bits
    assert int(packed[0]) & (2**bits - 1) == int(codes[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identity_sends_the_raw_bytes(dtype):
    v = vector(dtype=dtype)
    payload, q = roundtrip(Identity(), v)
    assert payload.numel() == D * dtype.itemsize and torch.equal(q, v)


def test_top_k_keeps_the_largest_entries_with_their_positions():
    v = vector()
    payload, q = roundtrip(TopK(0.01), v)
    k = math.ceil(0.01 * D)
    keep = np.argsort(-np.abs(v.numpy()))[:k]
    want = np.zeros(D, np.float32)
    want[keep] = v.numpy()[keep]
    np.testing.assert_array_equal(q.numpy(), want)
    assert payload.numel() == k * (4 + 4)  # float32 values + int32 indices
    assert payload.numel() <= 0.025 * D * 4


def test_random_k_keeps_k_entries_as_they_are_and_differs_by_rank():
    v = vector()
    c = RandomK(0.1, seed=5)
    _, q = roundtrip(c, v, seed=0)
    kept = q != 0
    assert int(kept.sum()) == math.ceil(0.1 * D) and torch.equal(q[kept], v[kept])
    _, again = roundtrip(c, v, seed=0)
    _, other = roundtrip(c, v, seed=1)
    assert torch.equal(q, again) and not torch.equal(q, other)


def test_qsgd_levels_signs_unbiasedness_and_size():
    v = vector(dtype=torch.float64)
    c = QSGD(bits=4)
    s = 7
    payload, q = roundtrip(c, v)
    norm = float(torch.linalg.vector_norm(v))
    levels = q.numpy() * s / norm
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-9)  # on the grid ||v|| l / s
    assert np.all(np.abs(levels) <= s + 1e-9)
    assert np.all(np.sign(levels[levels != 0]) == np.sign(v.numpy()[levels != 0]))
    # each level is one of the two nearest: floor or ceil of s |v_i| / ||v||
    ratio = np.abs(v.numpy()) * s / norm
    assert np.all((np.abs(levels) == np.floor(ratio)) | (np.abs(levels) == np.ceil(ratio)))
    # unbiased: the mean over many draws approaches v
    g = torch.Generator().manual_seed(1)
    mean = sum(c.decode(c.encode(v, g), D, v.dtype) for _ in range(400)) / 400
    assert float((mean - v).abs().max()) < 0.2 * norm / s
    assert float((mean - v).abs().mean()) < 0.02 * norm / s
    assert payload.numel() == 8 + math.ceil(D * 4 / 8)


def test_qsgd_4_bits_is_at_most_a_seventh_of_float32():
    assert QSGD(bits=4).payload_bytes(D, torch.float32) <= D * 4 / 7


def test_qsgd_scaled_divides_by_tau():
    v = vector(dtype=torch.float64, d=100)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    plain = QSGD(bits=3).decode(QSGD(bits=3).encode(v, g1), 100, v.dtype)
    scaled = QSGD(bits=3, scaled=True).decode(QSGD(bits=3, scaled=True).encode(v, g2), 100, v.dtype)
    s = 3
    tau = 1 + min(100 / s**2, math.sqrt(100) / s)
    np.testing.assert_allclose(scaled.numpy(), plain.numpy() / tau, rtol=1e-15)


def test_sign_sends_one_bit_per_entry_and_the_mean_magnitude():
    v = vector()
    v[3] = 0.0
    payload, q = roundtrip(Sign(), v)
    scale = np.abs(v.numpy()).mean()
    np.testing.assert_allclose(q.numpy(), np.where(v.numpy() >= 0, scale, -scale), rtol=1e-6)
    assert payload.numel() == 4 + math.ceil(D / 8)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cast_rounds_to_two_bytes(dtype):
    v = vector()
    payload, q = roundtrip(Cast(dtype), v)
    assert payload.numel() == 2 * D
    assert torch.equal(q, v.to(getattr(torch, dtype)).to(torch.float32))


def test_unaligned_payload_slices_decode():
    """Received payloads are rows of one gathered buffer: decoding must not need aligned storage."""
    v = vector(d=7, dtype=torch.float64)
    c = TopK(0.5)
    payload = c.encode(v)
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])[3:]
    assert torch.equal(c.decode(shifted, 7, v.dtype), c.decode(payload, 7, v.dtype))


# ------------------------------------------------------------------ from config
def test_every_packaged_option_builds_its_class():
    built = {name: as_compressor(name) for name in group_options("algorithm/compressor")}
    assert {name: type(c).__name__ for name, c in built.items()} == {
        "cast": "Cast", "identity": "Identity", "qsgd": "QSGD", "random_k": "RandomK", "sign": "Sign", "top_k": "TopK",
    }
    assert all(type(c).name == name for name, c in built.items())
    assert as_compressor("top_k").ratio == 0.01 and as_compressor("qsgd").bits == 4


@pytest.mark.parametrize("value, words", [
    ("top_kk", "algorithm.compressor=top_kk; allowed: cast, identity, qsgd, random_k, sign, top_k"),
    ({"_target_": "bfexp.compression.TopK", "ratio": 1.5}, "algorithm.compressor.ratio=1.5; allowed: a number in (0, 1]"),
    ({"_target_": "bfexp.compression.TopK", "ratio": 0}, "algorithm.compressor.ratio=0; allowed"),
    ({"_target_": "bfexp.compression.QSGD", "bits": 9}, "algorithm.compressor.bits=9; allowed: an integer in [2, 8]"),
    ({"_target_": "bfexp.compression.Cast", "dtype": "int8"}, "algorithm.compressor.dtype='int8'; allowed"),
    ({"_target_": "bfexp.compression.TopK", "ratoi": 0.1}, "unknown key 'algorithm.compressor.ratoi'"),
    ({"_target_": "bfexp.topology.Ring"}, "algorithm.compressor"),
    (3, "algorithm.compressor=3; allowed"),
])
def test_bad_compressors_are_one_line_config_errors(value, words):
    with pytest.raises(ConfigError) as info:
        as_compressor(value)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_wire_formats_for_the_cost_model():
    from bfexp.costmodel import Traffic

    param_bytes = D * 4.0
    sizes = {
        name: Traffic("neighbor", **as_compressor(name).wire()).message_bytes(param_bytes, 4)
        for name in group_options("algorithm/compressor")
    }
    assert sizes["identity"] == param_bytes
    assert sizes["top_k"] == pytest.approx(0.01 * D * 8)  # values and int32 indices
    assert sizes["random_k"] == pytest.approx(0.01 * D * 8)
    assert sizes["qsgd"] == pytest.approx(D * 4 / 8 + 4)  # 4 bits each + the norm
    assert sizes["sign"] == pytest.approx(D / 8 + 4)
    assert sizes["cast"] == pytest.approx(D * 2)
