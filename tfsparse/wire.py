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

**float16 overflow** (a finite value of magnitude 65520 or more would round to Inf): the
message is *scaled*, never sent as Inf.  When a finite value of a message does not fit, every
value of that message is divided by ``2**e`` (the smallest ``e`` that brings the largest to at
most 65504) and ``e`` travels as one extra byte at the end; an odd length tells the receiver.  Messages that fit cost exactly ``2m``
bytes, so a dense float16 exchange sends exactly half the bytes of float32.  Scaling by a
power of two adds no rounding of its own; the values that then underflow are part of the
wire's loss like any other rounding.

**What the wire loses** is kept: an encoder records ``value - decode(encode(value))`` in a
:class:`WireLoss`, and the memory adds it to the residual (error feedback), for the values
that reach the global result.  Decoding is deterministic, and every rank decodes the same
bytes, so all ranks get bit-identical results.

Encoding and decoding run as Numba CPU kernels (:mod:`tfsparse.ops.cpu`: one pass each,
decoding straight into the receiver's accumulator); they give exactly numpy's
``astype(float16)`` and the definitions above (tests/test_wire.py).  Messages are host
buffers: the payload is on the host when it goes to MPI.

Non-finite values: ``float16``/``bfloat16`` carry ±Inf and NaN (a NaN stays a NaN: the
truncation keeps a quiet-NaN bit).  ``int8`` cannot: a chunk holding a non-finite value gets
a non-finite scale and decodes to NaN (:func:`tfsparse.ops.quantize_int8`'s rule), so the
receivers see the bad gradient instead of a silently clipped one.

Sparse messages (:func:`pack_sparse`) are ``[indices | encoded values]`` -- the papers' ``2k``-element
COO pairs.  How the indices travel is an index codec (:func:`index_codec`, the same on every rank
for a vector of ``n`` elements and messages of about ``k`` entries):

* :class:`BlockedIndices` where the indices ascend (every selection but a custom compressor's
  returns them so) and it is smaller: for each block of 65,536 elements the count of indices in
  it (uint32), then each index's low 16 bits (uint16) -- ``4⌈n/65536⌉ + 2k`` bytes (padded to
  4) instead of ``4k``, lossless.  A 17.1M-element gradient at density 0.01 sends 1.03 MB per
  message instead of 1.37 (float32 values), a quarter less on every allgather, tree hop and
  split; at density ``1e-6`` the 1 KB of counts would outweigh the indices, and they go as
  int32;
* :class:`PlainIndices` otherwise: int32 below ``2**31`` elements, else int64.
"""
from __future__ import annotations

import math

import numpy as np

from . import traffic
from ._registry import Registry
from .space import HOST

INT8_CHUNK = 4096
#: values decoded between two calls of :meth:`Wire.decode_into`'s ``progress`` (64 int8 chunks,
#: 1 MiB of float32 output).  Measured, the dense int8 exchange of 25.2M values at P = 4 over
#: ``tfsparse-run --net 1gbit``: 545 ms in one piece, 460 ms in pieces of 256Ki values, 485 ms
#: in pieces of 64Ki (each call has its overhead)
DECODE_PIECE = 64 * INT8_CHUNK
_F16_MAX = np.float32(65504.0)
#: the wires by name, one instance each, in the order registered
WIRES = Registry("wire", "wire_dtype", ordered=True, make=lambda cls: cls())
register_wire = WIRES.register  # class decorator: makes ``cls`` available as ``wire_dtype=cls.name``


def available_wires() -> tuple[str, ...]:
    """The names ``wire_dtype=`` accepts (:func:`get_wire`), in the order the wires were registered.

    Returns:
      A tuple of names: ``("float32", "float16", "bfloat16", "int8")`` unless more wires are registered.
    """
    return WIRES.names()


def get_wire(name) -> "Wire":
    """The wire registered as ``name``; ValueError naming the accepted values otherwise."""
    if isinstance(name, Wire):
        return name
    return WIRES.get(name)


def _f32(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1)


def _kernels():
    """The Numba CPU codec kernels (imported on first use: numba is not needed for float32)."""
    from .ops import cpu

    return cpu


class Wire:
    """One value encoding.  Subclasses implement :meth:`encode`, :meth:`_decode_range` (which
    :meth:`decode_into` runs) and :meth:`entries`; a wire with :attr:`fuses_compensation`,
    :meth:`compensate_encode` too; ``value_bytes`` is the nominal size of one value on the wire."""

    name = "base"
    value_bytes = 4
    lossy = True
    #: whether :meth:`compensate_encode` fuses the error feedback's sum into the encoding
    fuses_compensation = False

    def encode(self, values, loss=None, buffers=None) -> np.ndarray:
        """float32 ``values`` -> one ``uint8`` message.

        Args:
          values: the float32 values (a vector).
          loss: None, or a contiguous float32 vector of their size to write what the encoding
            lost into, ``values - decode(message)``, in the same pass: 0 where a value is NaN/Inf
            (it travels as it is, or poisons its int8 chunk), and 0 everywhere on a lossless wire.
            ``values`` itself is allowed -- where a dense exchange builds the new residual in
            place -- and the values must then be finite.
          buffers: a :class:`tfsparse.buffers.Reusable` to take the message from (a scaled
            float16 message is a new one); None: a new array.

        Returns:
          The message: what :meth:`decode` reads back.
        """
        raise TypeError(f"{type(self).__name__} does not define encode()")

    def compensate_encode(self, pieces, acc, buffers=None, stream=False) -> tuple[np.ndarray, bool]:
        """:meth:`encode` of ``acc`` with its loss written over it where ``acc`` is first
        the error feedback's sum: ``pieces`` are ``(g, r, at)``, float32 vectors whose sum
        ``g + r`` belongs at ``acc[at:at + g.size]``, covering ``acc`` in order (``g`` and ``r``
        do not overlap ``acc``: a wire may read them again).  Returns ``(message, finite)``:
        whether every sum is finite -- if not, the message and ``acc`` are undefined.  The same
        message and loss as summing first and :meth:`encode` with ``loss=acc`` after, in one pass; only a
        wire with :attr:`fuses_compensation` offers it (the others are summed by the memory and
        encoded by the aggregator).  ``stream``: ``acc`` leaves the cache anyway
        (non-temporal stores where the wire uses them)."""
        raise TypeError(f"the {self.name} wire does not encode as it sums (fuses_compensation is False)")

    def decode(self, buf: np.ndarray, count: int) -> np.ndarray:
        """The ``count`` float32 values held by ``buf`` (a whole encoded block)."""
        return self.decode_into(buf, count, np.empty(int(count), np.float32))

    def entries(self, nbytes: int, index_bytes: int = 0) -> int:
        """How many entries a message of ``nbytes`` holds, each an ``index_bytes`` index plus
        one encoded value (``index_bytes=0``: a block of values).  Raises on a corrupt length.
        This one is for fixed-size values (``value_bytes`` each) after :meth:`_marker` bytes."""
        m, rem = divmod(int(nbytes) - self._marker(int(nbytes)), index_bytes + self.value_bytes)
        if rem:
            raise _corrupt(self, nbytes, index_bytes)
        return m

    def _marker(self, nbytes: int) -> int:
        """Bytes of a message that are neither indices nor values (float16's scale byte)."""
        return 0

    def nbytes(self, count: int) -> int:
        """Bytes of ``count`` encoded values (without the rare float16 scale byte)."""
        return int(count) * self.value_bytes

    def max_nbytes(self, count: int) -> int:
        """The most bytes a block of ``count`` encoded values can take (a receive buffer's size)."""
        return self.nbytes(count)

    def decode_into(self, buf: np.ndarray, count: int, out: np.ndarray, accumulate: bool = False,
                    progress=None) -> np.ndarray:
        """``out[:] = decode(buf)`` or, with ``accumulate``, ``out += decode(buf)``, in one pass.

        ``progress``: a callable run between pieces of :data:`DECODE_PIECE` values (the
        communicator's :meth:`~tfsparse.collectives.communicator.Communicator.progress`).  A
        transport without a progress thread of its own -- Open MPI over TCP -- moves the
        messages still in flight only inside its calls, so a long decode that is meant to
        overlap them would otherwise hold them still.  The values written are the same."""
        count = int(count)
        buf = self._block(buf, count)
        if progress is None or count <= DECODE_PIECE:
            self._decode_range(buf, count, 0, count, out, accumulate)
            return out
        for lo in range(0, count, DECODE_PIECE):
            hi = min(count, lo + DECODE_PIECE)
            self._decode_range(buf, count, lo, hi, out[lo:hi], accumulate)
            if hi < count:
                progress()
        return out

    def _decode_range(self, buf: np.ndarray, count: int, lo: int, hi: int, out: np.ndarray,
                      accumulate: bool) -> None:
        """Values ``lo:hi`` of the block of ``count`` that ``buf`` (checked by :meth:`_block`)
        holds, decoded into ``out`` (their ``hi - lo`` elements) or added to it; ``lo`` is 0 or
        a multiple of :data:`DECODE_PIECE`."""
        raise TypeError(f"{type(self).__name__} does not define _decode_range()")

    def _block(self, buf, count: int) -> np.ndarray:
        """``buf`` as flat bytes, checked to hold ``count`` encoded values."""
        buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
        if buf.size < self.nbytes(count):
            raise _corrupt(self, buf.size, 0)
        return buf

    def roundtrip(self, values) -> tuple[np.ndarray, np.ndarray]:
        """``(encode(values), decode(encode(values)))``: what a receiver reads."""
        buf = self.encode(values)
        return buf, self.decode(buf, np.size(values))

    def __repr__(self):
        return self.name


def _store(out, value, accumulate: bool):
    """``out += value`` or ``out[:] = value``; returns ``out``."""
    if accumulate:
        out += value
    else:
        out[:] = value
    return out


def _corrupt(wire, nbytes, index_bytes):
    return RuntimeError(f"corrupt {wire} message of {nbytes} bytes ({index_bytes}-byte indices)")


@register_wire
class Float32(Wire):
    """Values as they are: 4 bytes of float32 each, lossless."""

    name = "float32"
    value_bytes = 4
    lossy = False

    def encode(self, values, loss=None, buffers=None):
        """The values' own float32 bytes (no copy where ``values`` is a contiguous float32 vector
        already, unless ``loss`` is over them); ``loss`` filled with zeros: nothing is lost."""
        buf = _f32(values).view(np.uint8)
        if loss is not None:
            if np.shares_memory(buf, loss):  # the values travel as they are: keep them before the zeros
                buf = buf.copy()
            loss.fill(0.0)
        return buf

    def decode(self, buf, count):
        """The first ``4 * count`` bytes of ``buf`` viewed as float32 (no copy where ``buf`` is contiguous uint8
        already); RuntimeError when ``buf`` is shorter."""
        return self._block(buf, count)[:4 * count].view(np.float32)

    def _decode_range(self, buf, count, lo, hi, out, accumulate):
        traffic.count("decode", read=4 * (hi - lo) * (2 if accumulate else 1), written=4 * (hi - lo))
        _store(out, buf[4 * lo:4 * hi].view(np.float32), accumulate)


@register_wire
class Float16(Wire):
    """IEEE binary16, round to nearest even (GradientFlow's fp16 communication, gradientflow-sun2019 §2.3):
    ``2m`` bytes, plus one scale byte in a message that would overflow (the module docstring's float16
    overflow)."""

    name = "float16"
    value_bytes = 2

    def encode(self, values, loss=None, buffers=None):
        """Rounds to float16 (:func:`tfsparse.ops.cpu.half_encode`), the codes in a buffer taken
        from ``buffers`` when given; where a finite value would round to Inf, the whole message
        is encoded scaled instead (a new one): every value divided by ``2**e``, ``e`` appended as
        one byte.  Where the message must be scaled and ``loss`` is ``values`` itself, the values
        are first recovered exactly from the codes and the loss."""
        values = _f32(values)
        out = None if buffers is None else buffers.take(values.size, np.uint16)
        codes, _, overflowed = _kernels().half_encode(values, loss=loss, out=out)
        if not overflowed:
            return codes.view(np.uint8)
        if loss is not None and np.shares_memory(values, loss):  # the values are the loss now: take them back
            decoded = _kernels().HALF_TABLE[codes]
            with np.errstate(invalid="ignore"):
                values = np.where(np.isinf(decoded) & (loss != 0), loss,  # overflowed: the kernel kept x
                                  np.where(loss == 0, decoded, decoded + loss)).astype(np.float32)
        buf, lost = self._scaled(values)
        if loss is not None:
            loss[:] = lost
        return buf

    fuses_compensation = True

    def compensate_encode(self, pieces, acc, buffers=None, stream=False):
        """Each piece summed, encoded and its loss written in one pass
        (:func:`tfsparse.ops.cpu.add_encode16`).  Where a sum overflows float16, the sums are
        made again and :meth:`encode` scales them (rare: gradients beyond 65504)."""
        return _compensate_encode16(self, pieces, acc, buffers, stream, half=True)

    def _scaled(self, values):
        """A message of finite values of which some overflow float16: all divided by ``2**e``."""
        finite = np.isfinite(values)
        amax = float(np.abs(values[finite]).max())
        e = 1
        while np.float32(amax) / np.float32(2.0 ** e) > _F16_MAX:
            e += 1
        codes, _, _ = _kernels().half_encode(values / np.float32(2.0 ** e))
        buf = np.concatenate([codes.view(np.uint8), np.array([e], np.uint8)])
        with np.errstate(invalid="ignore"):
            loss = np.where(finite, values - self.decode(buf, values.size), np.float32(0.0))
        return buf, loss.astype(np.float32, copy=False)

    def _decode_range(self, buf, count, lo, hi, out, accumulate):
        k = _kernels()
        codes = buf[2 * lo:2 * hi].view(np.uint16)
        if buf.size == 2 * count + 1:  # scaled: decode, then multiply by 2**e
            value = k.decode16_into(codes, k.HALF_TABLE, np.empty(hi - lo, np.float32))
            value *= np.float32(2.0 ** int(buf[-1]))
            _store(out, value, accumulate)
        else:
            k.decode16_into(codes, k.HALF_TABLE, out, accumulate)

    def _marker(self, nbytes):
        return nbytes & 1  # an odd length: the scale byte at the end

    def max_nbytes(self, count):
        """``2 * count`` plus the scale byte of a scaled message."""
        return self.nbytes(count) + 1  # with the scale byte


@register_wire
class BFloat16(Wire):
    """16-bit truncation: the high 16 bits of each float32 (pipe-sgd-li2018 §3.2, "drops the less
    significant mantissa bits"); ``2m`` bytes, ±Inf and NaN carried."""

    name = "bfloat16"
    value_bytes = 2

    def encode(self, values, loss=None, buffers=None):
        """Truncates each value to its high 16 bits (:func:`tfsparse.ops.cpu.bfloat16_encode`),
        the codes in a buffer taken from ``buffers`` when given."""
        values = _f32(values)
        out = None if buffers is None else buffers.take(values.size, np.uint16)
        return _kernels().bfloat16_encode(values, loss=loss, out=out)[0].view(np.uint8)

    fuses_compensation = True

    def compensate_encode(self, pieces, acc, buffers=None, stream=False):
        """Each piece summed, encoded and its loss written in one pass
        (:func:`tfsparse.ops.cpu.add_encode16`)."""
        return _compensate_encode16(self, pieces, acc, buffers, stream, half=False)

    def _decode_range(self, buf, count, lo, hi, out, accumulate):
        k = _kernels()
        k.decode16_into(buf[2 * lo:2 * hi].view(np.uint16), k.BF16_TABLE, out, accumulate)


def _compensate_encode16(wire, pieces, acc, buffers, stream, half):
    """:meth:`Wire.compensate_encode` for the 16-bit wires: the codes of ``g + r`` in one
    message, the loss over ``acc``."""
    codes = np.empty(acc.size, np.uint16) if buffers is None else buffers.take(acc.size, np.uint16)
    over, finite = 0, True
    for g, r, at in pieces:
        o, ok = _kernels().add_encode16(g, r, acc[at:at + g.size], codes[at:at + g.size], half, stream)
        over, finite = over + o, finite and ok
    if not finite or not over:
        return codes.view(np.uint8), finite
    del codes  # back to the pool for the scaled message
    for g, r, at in pieces:  # some sum overflowed float16: the whole message is scaled
        np.add(g, r, out=acc[at:at + g.size])
        traffic.count("compensate", read=8 * g.size, written=4 * g.size)
    return wire.encode(acc, acc, buffers), True


@register_wire
class Int8(Wire):
    """``q = rint(x * 127 / max|x|)`` per chunk of ``INT8_CHUNK`` values (round half to even),
    the chunk's scale ``max|x| / 127`` as float32 after the codes."""

    name = "int8"
    value_bytes = 1

    def nbytes(self, count):
        """``count`` one-byte codes plus a float32 scale per chunk of :data:`INT8_CHUNK` values:
        ``count + 4 ceil(count / INT8_CHUNK)``."""
        return int(count) + 4 * (-(-int(count) // INT8_CHUNK))

    def encode(self, values, loss=None, buffers=None):
        """Quantizes each chunk of :data:`INT8_CHUNK` values to ``rint(x * 127 / max|x|)``
        (:func:`tfsparse.ops.cpu.quantize_int8_chunks`); the message is the codes, then the
        chunks' float32 scales (one message taken from ``buffers`` when given)."""
        values = _f32(values)
        count = values.size
        if buffers is None:
            q, scales, _ = _kernels().quantize_int8_chunks(values, INT8_CHUNK, loss=loss)
            return np.concatenate([q.view(np.uint8), scales.view(np.uint8)])
        buf = buffers.take(self.nbytes(count), np.uint8)  # the codes, then the scales, in one message
        _, scales, _ = _kernels().quantize_int8_chunks(values, INT8_CHUNK, loss=loss, out=buf[:count])
        buf[count:] = scales.view(np.uint8)
        return buf

    fuses_compensation = True

    def compensate_encode(self, pieces, acc, buffers=None, stream=False):
        """Every chunk that lies within one piece is summed, quantized and its loss written in
        one pass (:func:`tfsparse.ops.cpu.add_quantize_int8_chunks`); the few chunks a piece
        boundary cuts are summed piece by piece, then quantized in place.  The same message and
        loss as summing first and :meth:`encode` with ``loss=acc`` after."""
        k = _kernels()
        count, C = acc.size, INT8_CHUNK
        buf = np.empty(self.nbytes(count), np.uint8) if buffers is None else buffers.take(self.nbytes(count), np.uint8)
        codes = buf[:count]
        scales = np.empty(-(-count // C), np.float32)
        cut = set()  # chunks a piece boundary cuts
        for g, r, at in pieces:
            end = at + g.size
            lo = -(-at // C) * C                     # the first chunk that starts in this piece ...
            hi = end if end == count else end // C * C  # ... to the last one that ends in it
            if hi <= lo:
                lo = hi = end
            else:
                scales[lo // C:-(-hi // C)] = k.add_quantize_int8_chunks(
                    g[lo - at:hi - at], r[lo - at:hi - at], acc[lo:hi], C, codes[lo:hi], stream)
            for a, b in ((at, lo), (hi, end)):  # the parts of cut chunks
                if b > a:
                    np.add(g[a - at:b - at], r[a - at:b - at], out=acc[a:b])
                    traffic.count("compensate", read=8 * (b - a), written=4 * (b - a))
                    cut.update(range(a // C, -(-b // C)))
        for c in sorted(cut):
            lo, hi = c * C, min(c * C + C, count)
            scales[c] = k.quantize_int8_chunks(acc[lo:hi], C, loss=acc[lo:hi], out=codes[lo:hi])[1][0]
        buf[count:] = scales.view(np.uint8)
        return buf, bool(np.isfinite(scales).all())  # a chunk's scale is NaN/Inf where a sum is

    def _decode_range(self, buf, count, lo, hi, out, accumulate):
        first, end = lo // INT8_CHUNK, -(-hi // INT8_CHUNK)  # lo is a multiple of INT8_CHUNK
        q = buf[lo:hi].view(np.int8)
        scales = buf[count + 4 * first:count + 4 * end].view(np.float32)
        _kernels().dequantize_int8_chunks_into(q, scales, INT8_CHUNK, out, accumulate)

    def entries(self, nbytes, index_bytes=0):
        """Solves ``nbytes = m (index_bytes + 1) + 4 ceil(m / INT8_CHUNK)`` for ``m`` (each entry's index and
        code, and the scales of their chunks); RuntimeError where no ``m`` fits (a corrupt length)."""
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


#: elements per block of :class:`BlockedIndices` (an index's low 16 bits travel, the block's
#: number is implied by the count of each block)
INDEX_BLOCK = 1 << 16


class PlainIndices:
    """Indices as they are: int32 (int64 from ``2**31`` elements), in any order."""

    header_bytes = 0

    def __init__(self, n: int):
        self.itype = np.dtype(index_dtype(n))
        self.index_bytes = self.itype.itemsize

    def nbytes(self, m) -> int:
        """Bytes of the indices of ``m`` entries (with any header; ``m`` may be an expected count)."""
        return m * self.index_bytes

    def encode(self, idx) -> np.ndarray:
        """``idx`` as the bytes of contiguous int32 (int64 from ``2**31`` elements), in the order given."""
        return np.ascontiguousarray(idx, dtype=self.itype).reshape(-1).view(np.uint8)

    def split(self, buf, wire) -> tuple[np.ndarray, int]:
        """``(indices, values' offset)`` of a message ``[indices | values]``: int64 indices."""
        m = wire.entries(buf.size, self.index_bytes)
        return buf[:m * self.index_bytes].copy().view(self.itype).astype(np.int64), m * self.index_bytes

    def __repr__(self):
        return f"PlainIndices({self.itype.name})"


class BlockedIndices:
    """Ascending indices in three quarters of int32's bytes, losslessly: the count of indices in
    each block of :data:`INDEX_BLOCK` elements (uint32, one per block of the vector), then each
    index's low 16 bits (uint16, padded to 4 bytes so that float32 values after them stay
    aligned).  ``header_bytes + 2m`` against int32's ``4m``: chosen by :func:`index_codec` where
    it is smaller.  Decoding rebuilds the same int64 indices; encoding checks that they ascend."""

    index_bytes = 2

    def __init__(self, n: int):
        self.n = int(n)
        self.blocks = max(1, -(-self.n // INDEX_BLOCK))
        self.header_bytes = 4 * self.blocks

    def nbytes(self, m) -> int:
        """The counts per block (``header_bytes``) and ``m`` uint16 low parts padded to 4 bytes:
        ``header_bytes + 4 ceil(m / 2)``."""
        return self.header_bytes + 4 * math.ceil(m / 2)

    def encode(self, idx) -> np.ndarray:
        """The count of indices in each block, then each index's low 16 bits
        (:func:`tfsparse.ops.cpu.blocked_indices_encode`); ValueError unless ``idx`` ascends strictly
        within ``[0, n)``."""
        from .ops import cpu

        return cpu.blocked_indices_encode(idx, self.n, self.blocks)

    def split(self, buf, wire) -> tuple[np.ndarray, int]:
        """``(indices, values' offset)`` of a message ``[indices | values]``: the int64 indices rebuilt
        from the counts and the low bits; RuntimeError when the length does not match the counts."""
        from .ops import cpu

        if buf.size < self.header_bytes:
            raise _corrupt(wire, buf.size, self.index_bytes)
        counts = buf[:self.header_bytes].copy().view(np.uint32)
        m = int(counts.sum(dtype=np.int64))
        end = self.nbytes(m)
        if buf.size < end or wire.entries(buf.size - end, 0) != m:
            raise _corrupt(wire, buf.size, self.index_bytes)
        low = buf[self.header_bytes:self.header_bytes + 2 * m].copy().view(np.uint16)
        return cpu.blocked_indices_decode(counts, low), end

    def __repr__(self):
        return f"BlockedIndices(n={self.n})"


def index_codec(n: int, k: int, ascending: bool = True):
    """How the indices of an ``n``-element vector's sparse messages of about ``k`` entries
    travel: :class:`BlockedIndices` where they ascend and that takes fewer bytes than int32 for
    ``k`` entries, else :class:`PlainIndices`.  Every rank derives the same codec from ``(n, k)``."""
    plain = PlainIndices(n)
    if ascending and k > 0:
        blocked = BlockedIndices(n)
        if blocked.nbytes(k) < plain.nbytes(k):
            return blocked
    return plain


def pack_sparse(idx, val, codec, wire: Wire = FLOAT32) -> tuple[np.ndarray, np.ndarray | None]:
    """One message ``[indices by codec | values encoded by wire]``; returns ``(buffer, loss)``
    where ``loss`` is what the encoding lost on each value (None for float32).  ``codec``: an
    index codec (:func:`index_codec`)."""
    loss = np.empty(np.size(val), np.float32) if wire.lossy else None
    enc = wire.encode(val, loss)
    return np.concatenate([codec.encode(idx), enc]), loss


def unpack_sparse(buf, codec, wire: Wire = FLOAT32) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_sparse`: ``(int64 indices, float32 values)``."""
    buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    idx, offset = codec.split(buf, wire)
    return idx, wire.decode(buf[offset:], idx.size)


# -- what the wire lost ----------------------------------------------------------------------

class WireLoss:
    """This rank's record of ``value - decode(encode(value))`` for the values it encoded.

    ``where`` is an int64 index array or a ``slice`` of the exchanged vector.  Aggregators
    record every encoding they perform (:meth:`add`, with the loss :meth:`Wire.encode` wrote)
    and keep, at the end of the exchange, the losses of the values that reached the global
    result (:meth:`restrict`); the memory adds them to the residual.  Nothing is recorded for
    a lossless wire.
    """

    def __init__(self):
        self.parts: list = []

    def add(self, where, loss) -> None:
        """Records ``loss``, one value per element of ``where`` (an int64 index array or a ``slice``); a None
        loss (a lossless wire) records nothing."""
        if loss is not None:
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

    def apply_to(self, residual, space=HOST) -> None:
        """``residual[where] += loss`` for every record (indices are unique within a record);
        ``space``: where ``residual`` lives (:mod:`tfsparse.space`: a device residual is added to
        on the device)."""
        for where, loss in self.parts:
            traffic.count("update", read=2 * loss.nbytes, written=loss.nbytes)
            space.add_at(residual, where, loss)

    def __bool__(self):
        return bool(self.parts)
