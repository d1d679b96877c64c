"""Compressors: what a rank sends instead of a vector, packed the way it travels.

A compressor Q turns a flat vector v (d elements) into a *payload*: one uint8
tensor whose size depends only on (d, dtype), so every rank knows the size of
every peer's payload, and payloads go through the engines as ordinary tensors
(``neighbor_allgather``, ``allgather``). What the engine counts as sent is the
packed payload, never a decompressed vector. ``decode`` rebuilds the dense
Q(v); a sender keeps decode(encode(v)) as its own copy of what it sent, so it
holds bit for bit what its receivers reconstruct.

==========  =====================================================  ==============================
option      Q(v)                                                   payload
==========  =====================================================  ==============================
identity    v                                                      d elements
top_k       the k = ceil(ratio d) entries of largest |v_i|, 0      k elements + k int32 indices
            elsewhere (Stich, Cordonnier, Jaggi 2018)
random_k    k = ceil(ratio d) entries drawn uniformly without      k elements + k int32 indices
            replacement, 0 elsewhere
qsgd        ||v||_2 sign(v_i) l_i / s with l_i = s |v_i| / ||v||   the norm + ``bits`` bits per
            rounded up with probability its fractional part,       element (1 sign, bits-1 level)
            s = 2^(bits-1) - 1 (Alistarh et al. 2017); unbiased
sign        (||v||_1 / d) sign(v), zeros counted positive          the scale + 1 bit per element
            (Karimireddy et al. 2019)
cast        v rounded to bfloat16 or float16                       d two-byte elements
==========  =====================================================  ==============================

CHOCO-SGD (Koloskova, Stich, Jaggi 2019) needs a compression operator with
E||Q(v) - v||^2 <= (1 - delta) ||v||^2: every option above is one except
unbiased QSGD, whose ``scaled=true`` form divides by
tau = 1 + min(d / s^2, sqrt(d) / s) as in that paper. Each class is a
``conf/algorithm/compressor/<name>.yaml`` option (its constructor is the
schema, checking its options: ConfigError, one line) and states its wire format
for the cost model (``wire``). A user's own compressor subclasses ``Compressor``
and plugs in the same way (``+algorithm/compressor=NAME`` with its YAML in the
user's config dir, or a node with its ``_target_``).
"""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar, Literal, Mapping

import torch

from bfexp.errors import ConfigError, number_in

__all__ = [
    "Cast",
    "Compressor",
    "Identity",
    "QSGD",
    "RandomK",
    "Sign",
    "TopK",
    "as_compressor",
    "pack_bits",
    "unpack_bits",
]

KEY = "algorithm.compressor"  # where a compressor's options live in the config
GROUP = "algorithm/compressor"  # its config group (conf/algorithm/compressor/)


# ---------------------------------------------------------------- bytes and bits


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (a view when it already is contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes read as ``dtype`` elements (copied first when they do not start on an element boundary)."""
    b = b.contiguous()
    if b.storage_offset() % dtype.itemsize:
        b = b.clone()
    return b.view(dtype)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes in [0, 2^bits) packed ``bits`` apiece, least significant bit first: ceil(n bits / 8) bytes."""
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    flat = ((codes.to(torch.uint8).unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.arange(8, dtype=torch.uint8, device=codes.device)
    return (flat.view(-1, 8) << weights).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The n codes ``pack_bits`` packed (int64)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    flat = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[: n * bits].view(n, bits).long()
    return (flat << torch.arange(bits, device=packed.device)).sum(1)


def packed_size(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


# ---------------------------------------------------------------- the contract


class Compressor(abc.ABC):
    """Q(v) for flat vectors: ``encode`` to a packed uint8 payload of ``payload_bytes(d, dtype)``
    bytes, ``decode`` back to the dense Q(v)."""

    name: ClassVar[str] = "compressor"

    @abc.abstractmethod
    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Size of the payload of any vector of ``numel`` elements of ``dtype``."""

    @abc.abstractmethod
    def encode(self, v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The packed payload of a flat vector (a new tensor: the caller may change v afterwards)."""

    @abc.abstractmethod
    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The dense Q(v) a payload stands for."""

    def wire(self) -> dict[str, Any]:
        """Its wire format as ``costmodel.Traffic`` fields (density, value_bits, index_bits, scalars); a
        receiver decodes every payload into a dense vector before it adds it (``decoded``)."""
        return {"decoded": True}

    def generator(self, rank: int, device: torch.device) -> torch.Generator | None:
        """A random stream for this rank (None: the compressor is deterministic)."""
        return None

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({options})"


class _Seeded(Compressor):
    """A stochastic compressor: rank r draws from a stream seeded by (seed, r)."""

    def __init__(self, seed: int) -> None:
        self.seed = number_in(f"{KEY}.seed", seed, low=0, integer=True)

    def generator(self, rank: int, device: torch.device) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.seed * 1_000_003 + rank)
        return g


class Identity(Compressor):
    """Q(v) = v: the uncompressed baseline, sent as its raw bytes."""

    name: ClassVar[str] = "identity"

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def encode(self, v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return as_bytes(v).clone()

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return from_bytes(payload, dtype).clone()


def _ratio(ratio: Any) -> float:
    return float(number_in(f"{KEY}.ratio", ratio, low=0, high=1, low_open=True))


class _Sparse(Compressor):
    """k = ceil(ratio d) chosen entries: their values, then their positions as int32."""

    def __init__(self, ratio: float) -> None:
        self.ratio = _ratio(ratio)

    def count(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return self.count(numel) * (dtype.itemsize + 4)

    @abc.abstractmethod
    def chosen(self, v: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        """The k positions sent."""

    def encode(self, v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if v.numel() >= 2**31:
            raise ValueError(f"{self.name} sends int32 positions; a vector of {v.numel()} elements has more")
        index = self.chosen(v, self.count(v.numel()), generator)
        return torch.cat([as_bytes(v[index]), as_bytes(index.to(torch.int32))])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        cut = self.count(numel) * dtype.itemsize
        out = torch.zeros(numel, dtype=dtype, device=payload.device)
        out[from_bytes(payload[cut:], torch.int32).long()] = from_bytes(payload[:cut], dtype)
        return out

    def wire(self) -> dict[str, Any]:
        return {**super().wire(), "density": self.ratio, "index_bits": 32}


class TopK(_Sparse):
    """The k entries of largest magnitude (Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", 2018)."""

    name: ClassVar[str] = "top_k"

    def __init__(self, ratio: float = 0.01) -> None:
        """``ratio``: the share of entries sent, k = ceil(ratio d)."""
        super().__init__(ratio)

    def chosen(self, v: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        return torch.topk(v.abs(), k, sorted=False).indices


class RandomK(_Sparse, _Seeded):
    """k entries drawn uniformly without replacement, unscaled (a contraction with delta = k / d)."""

    name: ClassVar[str] = "random_k"

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        """``ratio``: the share of entries sent; ``seed``: rank r draws from the stream (seed, r)."""
        _Sparse.__init__(self, ratio)
        _Seeded.__init__(self, seed)

    def chosen(self, v: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        return torch.randperm(v.numel(), generator=generator, device=v.device)[:k]


class QSGD(_Seeded):
    """Stochastic quantization to s = 2^(bits-1) - 1 levels of |v_i| / ||v||_2, with the sign
    (Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD", NeurIPS 2017). Unbiased;
    ``scaled=true`` divides by tau = 1 + min(d/s^2, sqrt(d)/s), the contraction CHOCO-SGD uses."""

    name: ClassVar[str] = "qsgd"

    def __init__(self, bits: int = 4, scaled: bool = False, seed: int = 0) -> None:
        """``bits`` per element (2..8: one sign bit, the rest the level); ``seed``: rank r draws from (seed, r)."""
        number_in(f"{KEY}.bits", bits, low=2, high=8, integer=True)
        super().__init__(seed)
        self.bits = bits
        self.scaled = scaled

    @property
    def levels(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return dtype.itemsize + packed_size(numel, self.bits)

    def encode(self, v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        s = self.levels
        norm = torch.linalg.vector_norm(v)
        ratio = v.abs() / norm * s if float(norm) > 0 else torch.zeros_like(v)
        low = torch.floor(ratio)
        up = torch.rand(v.shape, generator=generator, dtype=v.dtype, device=v.device) < (ratio - low)
        level = (low + up.to(v.dtype)).clamp_(max=s).to(torch.uint8)
        codes = level | ((v < 0).to(torch.uint8) << (self.bits - 1))
        return torch.cat([as_bytes(norm.reshape(1)), pack_bits(codes, self.bits)])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        s, cut = self.levels, dtype.itemsize
        norm = from_bytes(payload[:cut], dtype)[0]
        codes = unpack_bits(payload[cut:], numel, self.bits)
        level = (codes & s).to(dtype)
        sign = 1 - 2 * (codes >> (self.bits - 1)).to(dtype)
        out = norm * sign * level / s
        if self.scaled:
            out /= 1 + min(numel / s**2, math.sqrt(numel) / s)
        return out

    def wire(self) -> dict[str, Any]:
        return {**super().wire(), "value_bits": self.bits, "scalars": 1}


class Sign(Compressor):
    """(||v||_1 / d) sign(v): one bit per element and one scale (Karimireddy, Rebjock, Stich, Jaggi,
    "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019)."""

    name: ClassVar[str] = "sign"

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return dtype.itemsize + packed_size(numel, 1)

    def encode(self, v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        scale = v.abs().mean().reshape(1)
        return torch.cat([as_bytes(scale), pack_bits((v >= 0).to(torch.uint8), 1)])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        cut = dtype.itemsize
        scale = from_bytes(payload[:cut], dtype)[0]
        positive = unpack_bits(payload[cut:], numel, 1).to(dtype)
        return scale * (2 * positive - 1)

    def wire(self) -> dict[str, Any]:
        return {**super().wire(), "value_bits": 1, "scalars": 1}


class Cast(Compressor):
    """v rounded to a two-byte floating type: half the bytes of float32, every entry kept."""

    name: ClassVar[str] = "cast"

    def __init__(self, dtype: Literal["bfloat16", "float16"] = "bfloat16") -> None:
        """``dtype``: what travels, bfloat16 (float32's range) or float16 (more mantissa, less range)."""
        if dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"{KEY}.dtype={dtype!r}; allowed: bfloat16, float16")
        self.dtype = dtype

    @property
    def wire_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * 2

    def encode(self, v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return as_bytes(v.to(self.wire_dtype))

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return from_bytes(payload, self.wire_dtype).to(dtype)

    def wire(self) -> dict[str, Any]:
        return {**super().wire(), "value_bits": 16}


# ---------------------------------------------------------------- from config


def as_compressor(value: Compressor | str | Mapping[str, Any]) -> Compressor:
    """A Compressor from what an algorithm was given: one, a shipped option's name (its YAML, as Hydra
    composes it, with its defaults), or a config node (``_target_`` and options), built as every component
    is (bfexp.components.build: keys and types against the constructor, which checks the values). Bad input:
    ConfigError, one line."""
    if isinstance(value, Compressor):
        return value
    from bfexp.components import build, group_options, option_node, target_of

    if isinstance(value, str):
        value = option_node(GROUP, value, hint="(pick one with algorithm/compressor=NAME, set its keys with "
                                               "algorithm.compressor.KEY=VALUE)")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{KEY}={value!r}; allowed: a compressor option ({', '.join(group_options(GROUP))})")
    target = target_of(value, KEY)
    if not (isinstance(target, type) and issubclass(target, Compressor)):
        raise ConfigError(f"{KEY}._target_={value.get('_target_')}; allowed: a bfexp.compression.Compressor class")
    return build(value, KEY)
