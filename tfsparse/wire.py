"""The typed wire: how gradient values travel between ranks.

Every aggregator sends its values through one :class:`Wire` (``wire_dtype``), and every
message is a contiguous ``uint8`` buffer, so byte accounting is simply its length:

============  ==============================================  =======================  ======
name          encoding of ``m`` float32 values                 bytes                    lossy
============  ==============================================  =======================  ======
``float32``   as is                                            ``4m``                   no
``float16``   IEEE binary16, round to nearest even             ``2m`` (``2m + 1``)      yes
              (GradientFlow's fp16 communication,
              gradientflow-sun2019 §2.3 "Mixed-Precision")
``bfloat16``  16-bit truncation: the high 16 bits of each      ``2m``                   yes
              float32 (pipe-sgd-li2018 §3.2, "drops the less
              significant mantissa bits")
``int8``      max-scaled quantization per chunk of             ``m + 4 ceil(m/4096)``   yes
              ``INT8_CHUNK`` values (pipe-sgd-li2018 §3.2:
              "a quantization range determined by the maximal
              element"); the float32 scale of each chunk is
              sent with it
============  ==============================================  =======================  ======

**float16 overflow** (|x| > 65504 would become Inf): the message is *scaled*, never sent as
Inf.  When a finite value of a message does not fit, every value of that message is divided by
``2**e`` (the smallest ``e`` that makes the largest one fit) and ``e`` travels as one extra
byte at the end; an odd length tells the receiver.  Messages that fit cost exactly ``2m``
bytes, so a dense float16 exchange sends exactly half the bytes of float32.  Scaling by a
power of two adds no rounding of its own; the values that then underflow are part of the
wire's loss like any other rounding.

**What the wire loses** is kept: an encoder records ``value - decode(encode(value))`` in a
:class:`WireLoss`, and the memory adds it to the residual (error feedback), for the values
that reach the global result.  Decoding is deterministic, and every rank decodes the same
bytes, so all ranks get bit-identical results.

Non-finite values: ``float16``/``bfloat16`` carry ±Inf and NaN (a NaN stays a NaN: the
truncation keeps a quiet-NaN bit).  ``int8`` cannot: a chunk holding a non-finite value gets
a non-finite scale and decodes to NaN (:func:`tfsparse.ops.quantize_int8`'s rule), so the
receivers see the bad gradient instead of a silently clipped one.

Sparse messages (:func:`pack_sparse`) are ``[indices | encoded values]``; the indices are
int32 when the gradient has fewer than ``2**31`` elements (the papers' ``2k``-element COO
volume), else int64.
"""
from __future__ import annotations

import numpy as np

INT8_CHUNK = 4096
_F16_MAX = np.float32(65504.0)
_WIRES: dict = {}


def register_wire(cls):
    """Class decorator: makes ``cls`` available as ``wire_dtype=cls.name``."""
    if cls.name in _WIRES:
        raise ValueError(f"wire {cls.name!r} is registered twice")
    _WIRES[cls.name] = cls()
    return cls


def available_wires() -> tuple[str, ...]:
    return tuple(_WIRES)


def get_wire(name) -> "Wire":
    """The wire registered as ``name``; ValueError naming the accepted values otherwise."""
    if isinstance(name, Wire):
        return name
    if not isinstance(name, str) or name not in _WIRES:
        raise ValueError(f"wire_dtype={name!r} is not supported; accepted: "
                         f"{', '.join(repr(w) for w in _WIRES)}")
    return _WIRES[name]


def _f32(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1)


class Wire:
    """One value encoding.  Subclasses implement :meth:`encode`, :meth:`decode` and
    :meth:`entries`; ``value_bytes`` is the nominal size of one value on the wire."""

    name = "base"
    value_bytes = 4
    lossy = True

    def encode(self, values) -> np.ndarray:
        """float32 values -> one ``uint8`` buffer."""
        raise TypeError(f"{type(self).__name__} does not define encode()")

    def decode(self, buf: np.ndarray, count: int) -> np.ndarray:
        """The ``count`` float32 values held by ``buf`` (a whole encoded block)."""
        raise TypeError(f"{type(self).__name__} does not define decode()")

    def entries(self, nbytes: int, index_bytes: int = 0) -> int:
        """How many entries a message of ``nbytes`` holds, each an ``index_bytes`` index plus
        one encoded value (``index_bytes=0``: a block of values).  Raises on a corrupt length."""
        raise TypeError(f"{type(self).__name__} does not define entries()")

    def nbytes(self, count: int) -> int:
        """Bytes of ``count`` encoded values (without the rare float16 scale byte)."""
        return int(count) * self.value_bytes

    def roundtrip(self, values) -> tuple[np.ndarray, np.ndarray]:
        """``(encode(values), decode(encode(values)))``."""
        buf = self.encode(values)
        return buf, self.decode(buf, np.size(values))

    def __repr__(self):
        return self.name


def _corrupt(wire, nbytes, index_bytes):
    return RuntimeError(f"corrupt {wire} message of {nbytes} bytes ({index_bytes}-byte indices)")


@register_wire
class Float32(Wire):
    name = "float32"
    value_bytes = 4
    lossy = False

    def encode(self, values):
        return _f32(values).view(np.uint8)

    def decode(self, buf, count):
        return np.ascontiguousarray(buf, dtype=np.uint8)[:4 * count].view(np.float32)

    def entries(self, nbytes, index_bytes=0):
        m, rem = divmod(int(nbytes), index_bytes + 4)
        if rem:
            raise _corrupt(self, nbytes, index_bytes)
        return m

    def roundtrip(self, values):
        values = _f32(values)
        return values.view(np.uint8), values


@register_wire
class Float16(Wire):
    name = "float16"
    value_bytes = 2

    def encode(self, values):
        values = _f32(values)
        with np.errstate(over="ignore"):
            half = values.astype(np.float16)
        if not np.isinf(half).any():
            return half.view(np.uint8)
        finite = np.isfinite(values)
        if not np.isinf(half[finite]).any():  # only genuine infinities: nothing to scale
            return half.view(np.uint8)
        amax = float(np.abs(values[finite]).max())
        e = 1
        while np.float32(amax) / np.float32(2.0 ** e) > _F16_MAX:
            e += 1
        half = (values / np.float32(2.0 ** e)).astype(np.float16)
        return np.concatenate([half.view(np.uint8), np.array([e], np.uint8)])

    def decode(self, buf, count):
        buf = np.ascontiguousarray(buf, dtype=np.uint8)
        out = buf[:2 * count].view(np.float16).astype(np.float32)
        if buf.size == 2 * count + 1:
            out *= np.float32(2.0 ** int(buf[-1]))
        return out

    def entries(self, nbytes, index_bytes=0):
        m, rem = divmod(int(nbytes) - (int(nbytes) & 1), index_bytes + 2)
        if rem:
            raise _corrupt(self, nbytes, index_bytes)
        return m


@register_wire
class BFloat16(Wire):
    name = "bfloat16"
    value_bytes = 2

    def encode(self, values):
        bits = _f32(values).view(np.uint32)
        hi = (bits >> np.uint32(16)).astype(np.uint16)
        nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        if nan.any():  # a NaN whose payload sits in the low bits would truncate to Inf
            hi[nan] |= np.uint16(0x0040)
        return hi.view(np.uint8)

    def decode(self, buf, count):
        hi = np.ascontiguousarray(buf, dtype=np.uint8)[:2 * count].view(np.uint16)
        return (hi.astype(np.uint32) << np.uint32(16)).view(np.float32)

    def entries(self, nbytes, index_bytes=0):
        m, rem = divmod(int(nbytes), index_bytes + 2)
        if rem:
            raise _corrupt(self, nbytes, index_bytes)
        return m


@register_wire
class Int8(Wire):
    """``q = rint(x * 127 / max|x|)`` per chunk of ``INT8_CHUNK`` values (round half to even),
    the chunk's scale ``max|x| / 127`` as float32 after the codes."""

    name = "int8"
    value_bytes = 1

    def nbytes(self, count):
        return int(count) + 4 * (-(-int(count) // INT8_CHUNK))

    def encode(self, values):
        x = _f32(values)
        m = x.size
        chunks = -(-m // INT8_CHUNK)
        pad = np.zeros(chunks * INT8_CHUNK, np.float32)
        pad[:m] = x
        blocks = pad.reshape(chunks, INT8_CHUNK)
        amax = np.max(np.abs(blocks), axis=1) if chunks else np.zeros(0, np.float32)
        scale = (amax / np.float32(127.0)).astype(np.float32)
        ok = np.isfinite(amax) & (amax > 0)
        inv = np.zeros(chunks, np.float32)
        inv[ok] = np.float32(127.0) / amax[ok]
        with np.errstate(invalid="ignore"):
            q = np.clip(np.rint(blocks * inv[:, None]), -127, 127)
        q[~ok] = 0
        return np.concatenate([q.astype(np.int8).reshape(-1)[:m].view(np.uint8), scale.view(np.uint8)])

    def decode(self, buf, count):
        buf = np.ascontiguousarray(buf, dtype=np.uint8)
        chunks = -(-count // INT8_CHUNK)
        q = buf[:count].view(np.int8).astype(np.float32)
        scale = buf[count:count + 4 * chunks].copy().view(np.float32)
        with np.errstate(invalid="ignore"):
            return q * np.repeat(scale, INT8_CHUNK)[:count]

    def entries(self, nbytes, index_bytes=0):
        # nbytes = m * (index_bytes + 1) + 4 * q with q = ceil(m / C) chunks: try the few q near
        # nbytes / ((index_bytes + 1) * C + 4) and keep the consistent one
        nbytes, per = int(nbytes), index_bytes + 1
        q0 = nbytes // (per * INT8_CHUNK + 4)
        for q in (q0, q0 + 1, q0 + 2):
            rem = nbytes - 4 * q
            if rem >= 0 and rem % per == 0 and -(-(rem // per) // INT8_CHUNK) == q:
                return rem // per
        raise _corrupt(self, nbytes, index_bytes)


FLOAT32 = get_wire("float32")


# -- sparse messages -------------------------------------------------------------------------

def index_dtype(n: int):
    """Indices travel as int32 when they fit (the papers' 2k-element COO volume), else int64."""
    return np.int32 if n < 2**31 else np.int64


def pack_sparse(idx, val, itype, wire: Wire = FLOAT32) -> tuple[np.ndarray, np.ndarray]:
    """One message ``[indices as itype | values encoded by wire]``; returns ``(buffer, decoded)``
    where ``decoded`` is what every receiver will read (``val`` itself for float32)."""
    enc, decoded = wire.roundtrip(val)
    idx = np.ascontiguousarray(idx, dtype=itype).reshape(-1)
    return np.concatenate([idx.view(np.uint8), enc]), decoded


def unpack_sparse(buf, itype, wire: Wire = FLOAT32) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_sparse`: ``(int64 indices, float32 values)``."""
    buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    isz = np.dtype(itype).itemsize
    m = wire.entries(buf.size, isz)
    idx = buf[:m * isz].copy().view(itype).astype(np.int64)
    return idx, wire.decode(buf[m * isz:], m)


def entry_bytes(itype, wire: Wire = FLOAT32) -> int:
    """Nominal bytes of one sparse entry (index + value)."""
    return np.dtype(itype).itemsize + wire.value_bytes


# -- what the wire lost ----------------------------------------------------------------------

class WireLoss:
    """This rank's record of ``value - decode(encode(value))`` for the values it encoded.

    ``where`` is an int64 index array or a ``slice`` of the exchanged vector.  Aggregators
    record every encoding they perform (:meth:`add`) and keep, at the end of the exchange, the
    losses of the values that reached the global result (:meth:`restrict`); the memory adds
    them to the residual.  Nothing is recorded for a lossless wire.
    """

    def __init__(self):
        self.parts: list = []

    def add(self, where, values, decoded) -> None:
        if decoded is values:
            return
        loss = np.asarray(values, np.float32) - decoded
        if loss.any():
            self.parts.append((where, loss))

    def restrict(self, g_idx) -> "WireLoss":
        """Keeps only the entries whose index is in ``g_idx`` (ascending, unique; ``None``: all)."""
        if g_idx is None:  # a dense result: everything reached it
            return self
        out = WireLoss()
        g_idx = np.asarray(g_idx)
        if g_idx.size == 0:
            return out
        for where, loss in self.parts:
            if isinstance(where, slice):
                where = np.arange(where.start, where.stop, dtype=np.int64)
            pos = np.minimum(np.searchsorted(g_idx, where), g_idx.size - 1)
            hit = g_idx[pos] == where
            if hit.any():
                out.parts.append((where[hit], loss[hit]))
        return out

    def apply_to(self, residual: np.ndarray) -> None:
        """``residual[where] += loss`` for every record (indices are unique within a record)."""
        for where, loss in self.parts:
            residual[where] += loss

    def __bool__(self):
        return bool(self.parts)
