"""The value encodings (``wire_dtype``): float32, float16, bfloat16, int8 and int4, one :class:`Wire` each
(the package's docstring, :mod:`tfsparse.wire`, gives their table)."""
from __future__ import annotations

import numpy as np

from .. import traffic
from .._registry import Registry

INT8_CHUNK = 4096
#: the values that share one float32 scale on the int4 wire (even: two codes a byte; it divides
#: :data:`DECODE_PIECE`): with 15 levels a smaller chunk than int8's keeps a large value from
#: zeroing its neighbours, for 1.6 % more bytes
INT4_CHUNK = 512
#: values decoded between two calls of :meth:`Wire.decode_into`'s ``progress`` (64 int8 chunks,
#: 1 MiB of float32 output): between pieces the messages still in flight move on, and each call
#: has its overhead, so both one piece and many small ones make the dense int8 exchange slower
DECODE_PIECE = 64 * INT8_CHUNK
_F16_MAX = np.float32(65504.0)
#: the wires by name, one instance each, in the order registered
WIRES = Registry("wire", "wire_dtype", ordered=True, make=lambda cls: cls())
register_wire = WIRES.register  # class decorator: makes ``cls`` available as ``wire_dtype=cls.name``


def available_wires() -> tuple[str, ...]:
    """The names ``wire_dtype=`` accepts (:func:`get_wire`), in the order the wires were registered.

    Returns:
      A tuple of names: ``("float32", "float16", "bfloat16", "int8", "int4")`` unless more wires are registered.
    """
    return WIRES.names()


def get_wire(name) -> "Wire":
    """The wire registered as ``name``.

    Args:
      name: a registered name (:func:`available_wires`), or a :class:`Wire`, returned as it is.

    Returns:
      The :class:`Wire` (one instance per name).

    Raises:
      ValueError: ``name`` is not registered; the message names the accepted values.
    """
    if isinstance(name, Wire):
        return name
    return WIRES.get(name)


def _f32(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1)


def _kernels():
    """The Numba CPU codec kernels (imported on first use: numba is not needed for float32)."""
    from ..ops import cpu

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
    #: whether only ``algorithm="dense"`` can send it (:func:`check_wire_for`)
    dense_only = False

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
        """:meth:`encode` of ``acc`` with its loss written over it, where ``acc`` is first the error feedback's sum.

        The same message and loss as summing first and :meth:`encode` with ``loss=acc`` after, in one
        pass; only a wire with :attr:`fuses_compensation` offers it (the others are summed by the
        memory and encoded by the aggregator).

        Args:
          pieces: ``(g, r, at)`` triples, float32 vectors whose sum ``g + r`` belongs at
            ``acc[at:at + g.size]``, covering ``acc`` in order (``g`` and ``r`` do not overlap
            ``acc``: a wire may read them again).
          acc: the float32 vector that receives the sums, then the loss.
          buffers: a :class:`tfsparse.buffers.Reusable` to take the message from; None: a new array.
          stream: ``acc`` leaves the cache anyway (non-temporal stores where the wire uses them).

        Returns:
          ``(message, finite)``: ``finite`` says whether every sum is finite -- if not, the message
          and ``acc`` are undefined.

        Raises:
          TypeError: the wire does not fuse the sum (``fuses_compensation`` is False).
        """
        raise TypeError(f"the {self.name} wire does not encode as it sums (fuses_compensation is False)")

    def decode(self, buf: np.ndarray, count: int) -> np.ndarray:
        """The float32 values a whole encoded block holds.

        Args:
          buf: the message (``uint8``), as :meth:`encode` made it.
          count: how many values it holds.

        Returns:
          A new float32 vector of ``count`` values.

        Raises:
          RuntimeError: ``buf`` is too short for ``count`` values.
        """
        return self.decode_into(buf, count, np.empty(int(count), np.float32))

    def entries(self, nbytes: int, index_bytes: int = 0) -> int:
        """How many entries a message of ``nbytes`` holds, each an index plus one encoded value.

        This one is for fixed-size values (``value_bytes`` each) after :meth:`_marker` bytes.

        Args:
          nbytes: the message's length.
          index_bytes: the bytes of each entry's index; 0: a block of values.

        Returns:
          The number of entries.

        Raises:
          RuntimeError: no number of entries gives that length (a corrupt message).
        """
        m, rem = divmod(int(nbytes) - self._marker(int(nbytes)), index_bytes + self.value_bytes)
        if rem:
            raise _corrupt(self, nbytes, index_bytes)
        return m

    def _marker(self, nbytes: int) -> int:
        """Bytes of a message that are neither indices nor values (float16's scale byte)."""
        return 0

    def nbytes(self, count: int) -> int:
        """Bytes of ``count`` encoded values (without the rare float16 scale byte).

        Args:
          count: how many values.

        Returns:
          The bytes, an int.
        """
        return int(count) * self.value_bytes

    def max_nbytes(self, count: int) -> int:
        """The most bytes a block of ``count`` encoded values can take (a receive buffer's size).

        Args:
          count: how many values.

        Returns:
          The bytes, an int.
        """
        return self.nbytes(count)

    def decode_into(self, buf: np.ndarray, count: int, out: np.ndarray, accumulate: bool = False,
                    progress=None) -> np.ndarray:
        """``out[:] = decode(buf)`` or, with ``accumulate``, ``out += decode(buf)``, in one pass.

        Args:
          buf: the message (``uint8``).
          count: how many values it holds.
          out: a float32 vector of ``count`` elements to write or add into.
          accumulate: add to ``out`` instead of overwriting it.
          progress: None, or a callable run between pieces of :data:`DECODE_PIECE` values (the
            communicator's :meth:`~tfsparse.collectives.communicator.Communicator.progress`).  A
            transport without a progress thread of its own -- Open MPI over TCP -- moves the messages
            still in flight only inside its calls, so a long decode that is meant to overlap them
            would otherwise hold them still.  The values written are the same.

        Returns:
          ``out``.

        Raises:
          RuntimeError: ``buf`` is too short for ``count`` values.
        """
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
        """What a receiver reads of ``values``.

        Args:
          values: float32 values.

        Returns:
          ``(encode(values), decode(encode(values)))``.
        """
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
        """The values' own float32 bytes; nothing is lost.

        Args:
          values: the float32 values.
          loss: None, or a float32 vector of their size, filled with zeros.
          buffers: unused (no copy is made where ``values`` is a contiguous float32 vector already,
            unless ``loss`` is over them).

        Returns:
          The message: ``4 * values.size`` bytes.
        """
        buf = _f32(values).view(np.uint8)
        if loss is not None:
            if np.shares_memory(buf, loss):  # the values travel as they are: keep them before the zeros
                buf = buf.copy()
            loss.fill(0.0)
        return buf

    def decode(self, buf, count):
        """The values a float32 message holds.

        Args:
          buf: the message.
          count: how many values to read.

        Returns:
          The first ``4 * count`` bytes of ``buf`` viewed as float32 (no copy where ``buf`` is
          contiguous uint8 already).

        Raises:
          RuntimeError: ``buf`` is shorter.
        """
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
        """Rounds to float16 (:func:`tfsparse.ops.cpu.half_encode`), scaling the message where a value would overflow.

        Where a finite value would round to Inf, the whole message is encoded scaled instead (a new
        one): every value divided by ``2**e``, ``e`` appended as one byte.  Where the message must be
        scaled and ``loss`` is ``values`` itself, the values are first recovered exactly from the codes
        and the loss.

        Args:
          values: the float32 values.
          loss: None, or a float32 vector of their size for what the rounding lost (:meth:`Wire.encode`).
          buffers: a :class:`tfsparse.buffers.Reusable` for the codes; None: a new array.

        Returns:
          The message: ``2m`` bytes, ``2m + 1`` where scaled.
        """
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
        """Each piece summed, encoded and its loss written in one pass (:func:`tfsparse.ops.cpu.add_encode16`).

        Where a sum overflows float16, the sums are made again and :meth:`encode` scales them (rare:
        gradients beyond 65504).

        Args:
          pieces: ``(g, r, at)`` triples (:meth:`Wire.compensate_encode`).
          acc: the float32 vector that receives the sums, then the loss.
          buffers: a :class:`tfsparse.buffers.Reusable` for the codes; None: a new array.
          stream: use non-temporal stores for ``acc``.

        Returns:
          ``(message, finite)`` as :meth:`Wire.compensate_encode`.
        """
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
        """``2 * count`` plus the scale byte of a scaled message.

        Args:
          count: how many values.

        Returns:
          The bytes, an int.
        """
        return self.nbytes(count) + 1  # with the scale byte


@register_wire
class BFloat16(Wire):
    """16-bit truncation: the high 16 bits of each float32 (pipe-sgd-li2018 §3.2, "drops the less
    significant mantissa bits"); ``2m`` bytes, ±Inf and NaN carried."""

    name = "bfloat16"
    value_bytes = 2

    def encode(self, values, loss=None, buffers=None):
        """Truncates each value to its high 16 bits (:func:`tfsparse.ops.cpu.bfloat16_encode`).

        Args:
          values: the float32 values.
          loss: None, or a float32 vector of their size for what the truncation lost (:meth:`Wire.encode`).
          buffers: a :class:`tfsparse.buffers.Reusable` for the codes; None: a new array.

        Returns:
          The message: ``2m`` bytes.
        """
        values = _f32(values)
        out = None if buffers is None else buffers.take(values.size, np.uint16)
        return _kernels().bfloat16_encode(values, loss=loss, out=out)[0].view(np.uint8)

    fuses_compensation = True

    def compensate_encode(self, pieces, acc, buffers=None, stream=False):
        """Each piece summed, encoded and its loss written in one pass (:func:`tfsparse.ops.cpu.add_encode16`).

        Args:
          pieces: ``(g, r, at)`` triples (:meth:`Wire.compensate_encode`).
          acc: receives the sums, then what the truncation lost.
          buffers: where the 16-bit codes are taken from; None: a new array.
          stream: use non-temporal stores for ``acc``.

        Returns:
          ``(message, finite)``: ``2m`` bytes, and whether every sum is finite.
        """
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


def _compensate_chunks(wire, pieces, acc, buffers, stream, C, shift, fused, plain):
    """:meth:`Wire.compensate_encode` for the wires quantized by chunk of ``C`` values (int8, int4):
    the chunks that lie within one piece by the ``fused`` kernel (sum, quantize, loss in one pass),
    those a piece boundary cuts summed piece by piece and then quantized in place by ``plain``.
    The message is the codes, ``2 ** shift`` a byte (``C`` a multiple of that: a chunk's codes
    start a byte), then the chunks' float32 scales."""
    count = acc.size
    buf = np.empty(wire.nbytes(count), np.uint8) if buffers is None else buffers.take(wire.nbytes(count), np.uint8)
    per = 1 << shift
    codes_bytes = (count + per - 1) >> shift

    def code_range(lo, hi):
        return buf[lo >> shift:(hi + per - 1) >> shift]

    scales = np.empty(-(-count // C), np.float32)
    cut = set()  # chunks a piece boundary cuts
    for g, r, at in pieces:
        end = at + g.size
        lo = -(-at // C) * C                     # the first chunk that starts in this piece ...
        hi = end if end == count else end // C * C  # ... to the last one that ends in it
        if hi <= lo:
            lo = hi = end
        else:
            scales[lo // C:-(-hi // C)] = fused(g[lo - at:hi - at], r[lo - at:hi - at], acc[lo:hi], C,
                                                code_range(lo, hi), stream)
        for a, b in ((at, lo), (hi, end)):  # the parts of cut chunks
            if b > a:
                np.add(g[a - at:b - at], r[a - at:b - at], out=acc[a:b])
                traffic.count("compensate", read=8 * (b - a), written=4 * (b - a))
                cut.update(range(a // C, -(-b // C)))
    for c in sorted(cut):
        lo, hi = c * C, min(c * C + C, count)
        scales[c] = plain(acc[lo:hi], C, loss=acc[lo:hi], out=code_range(lo, hi))[1][0]
    buf[codes_bytes:] = scales.view(np.uint8)
    return buf, bool(np.isfinite(scales).all())  # a chunk's scale is NaN/Inf where a sum is


@register_wire
class Int8(Wire):
    """``q = rint(x * 127 / max|x|)`` per chunk of ``INT8_CHUNK`` values (round half to even),
    the chunk's scale ``max|x| / 127`` as float32 after the codes."""

    name = "int8"
    value_bytes = 1

    def nbytes(self, count):
        """``count`` one-byte codes plus a float32 scale per chunk of :data:`INT8_CHUNK` values.

        Args:
          count: how many values.

        Returns:
          ``count + 4 ceil(count / INT8_CHUNK)``.
        """
        return int(count) + 4 * (-(-int(count) // INT8_CHUNK))

    def encode(self, values, loss=None, buffers=None):
        """Quantizes each chunk of :data:`INT8_CHUNK` values to ``rint(x * 127 / max|x|)`` (:func:`tfsparse.ops.cpu.quantize_int8_chunks`).

        Args:
          values: the float32 values.
          loss: None, or a float32 vector of their size for what the quantization lost (:meth:`Wire.encode`).
          buffers: a :class:`tfsparse.buffers.Reusable` to take the message from; None: a new array.

        Returns:
          The message: the codes, then the chunks' float32 scales (:meth:`nbytes` bytes).
        """
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
        """Sums, quantizes and writes the loss of every chunk that lies within one piece in one pass.

        That pass is :func:`tfsparse.ops.cpu.add_quantize_int8_chunks`; the few chunks a piece
        boundary cuts are summed piece by piece, then quantized in place.  The same message and loss
        as summing first and :meth:`encode` with ``loss=acc`` after.

        Args:
          pieces: ``(g, r, at)`` triples (:meth:`Wire.compensate_encode`); their boundaries may cut chunks.
          acc: receives the sums, then what the quantization lost.
          buffers: where the message (codes, then scales) is taken from; None: a new array.
          stream: use non-temporal stores for ``acc`` in the fused chunks.

        Returns:
          ``(message, finite)``: :meth:`nbytes` bytes, and whether every chunk's scale is finite.
        """
        k = _kernels()
        return _compensate_chunks(self, pieces, acc, buffers, stream, INT8_CHUNK, 0, k.add_quantize_int8_chunks,
                                  k.quantize_int8_chunks)

    def _decode_range(self, buf, count, lo, hi, out, accumulate):
        first, end = lo // INT8_CHUNK, -(-hi // INT8_CHUNK)  # lo is a multiple of INT8_CHUNK
        q = buf[lo:hi].view(np.int8)
        scales = buf[count + 4 * first:count + 4 * end].view(np.float32)
        _kernels().dequantize_int8_chunks_into(q, scales, INT8_CHUNK, out, accumulate)

    def entries(self, nbytes, index_bytes=0):
        """Solves ``nbytes = m (index_bytes + 1) + 4 ceil(m / INT8_CHUNK)`` for ``m``.

        Each entry is an index and a code; the scales of their chunks follow.

        Args:
          nbytes: the message's length.
          index_bytes: the bytes of each entry's index; 0: a block of values.

        Returns:
          ``m``, the number of entries.

        Raises:
          RuntimeError: no ``m`` fits (a corrupt length).
        """
        # nbytes = m * (index_bytes + 1) + 4 * q with q = ceil(m / C) chunks: try the few q near
        # nbytes / ((index_bytes + 1) * C + 4) and keep the consistent one
        nbytes, per = int(nbytes), index_bytes + 1
        q0 = nbytes // (per * INT8_CHUNK + 4)
        for q in (q0, q0 + 1, q0 + 2):
            rem = nbytes - 4 * q
            if rem >= 0 and rem % per == 0 and -(-(rem // per) // INT8_CHUNK) == q:
                return rem // per
        raise _corrupt(self, nbytes, index_bytes)


@register_wire
class Int4(Wire):
    """``code = rint(x * 7 / max|x|)`` per chunk of :data:`INT4_CHUNK` values (round half to even),
    two codes a byte, the chunk's scale ``max|x| / 7`` as float32 after the codes: half of int8's
    bytes.  For the dense exchange only (:attr:`dense_only`): a block's length does not tell an odd
    number of values from the even one after it, which a sparse message's reader needs."""

    name = "int4"
    value_bytes = 0.5
    dense_only = True

    def nbytes(self, count):
        """``ceil(count / 2)`` bytes of codes plus a float32 scale per chunk of :data:`INT4_CHUNK` values.

        Args:
          count: how many values.

        Returns:
          ``ceil(count / 2) + 4 ceil(count / INT4_CHUNK)``.
        """
        count = int(count)
        return (count + 1) // 2 + 4 * (-(-count // INT4_CHUNK))

    def encode(self, values, loss=None, buffers=None):
        """:meth:`Wire.encode` (the same arguments): each chunk of :data:`INT4_CHUNK` values
        quantized to ``rint(x * 7 / max|x|)`` (:func:`tfsparse.ops.cpu.quantize_int4_chunks`); the
        message is the codes, two a byte, then the chunks' float32 scales (:meth:`nbytes` bytes)."""
        values = _f32(values)
        count, codes = values.size, (values.size + 1) // 2
        buf = np.empty(self.nbytes(count), np.uint8) if buffers is None else buffers.take(self.nbytes(count), np.uint8)
        _, scales, _ = _kernels().quantize_int4_chunks(values, INT4_CHUNK, loss=loss, out=buf[:codes])
        buf[codes:] = scales.view(np.uint8)
        return buf

    fuses_compensation = True

    def compensate_encode(self, pieces, acc, buffers=None, stream=False):
        """:meth:`Wire.compensate_encode` (the same arguments and result) as :meth:`Int8.compensate_encode`
        does it: the chunks within one piece summed, quantized and their loss written in one pass
        (:func:`tfsparse.ops.cpu.add_quantize_int4_chunks`), the few a piece boundary cuts summed
        first, then quantized in place."""
        k = _kernels()
        return _compensate_chunks(self, pieces, acc, buffers, stream, INT4_CHUNK, 1, k.add_quantize_int4_chunks,
                                  k.quantize_int4_chunks)

    def _decode_range(self, buf, count, lo, hi, out, accumulate):
        first, end = lo // INT4_CHUNK, -(-hi // INT4_CHUNK)  # lo is a multiple of INT4_CHUNK
        codes = (count + 1) // 2
        scales = buf[codes + 4 * first:codes + 4 * end].view(np.float32)
        _kernels().dequantize_int4_chunks_into(buf[lo // 2:(hi + 1) // 2], scales, INT4_CHUNK, hi - lo, out,
                                               accumulate)

    def entries(self, nbytes, index_bytes=0):
        """:meth:`Wire.entries` (the same arguments and result): solves ``nbytes = m index_bytes +
        ceil(m / 2) + 4 ceil(m / INT4_CHUNK)`` for ``m``; a RuntimeError where no ``m`` fits (a
        corrupt length) or two do (a block of values: an odd count and the even one after it take
        the same bytes)."""
        nbytes = int(nbytes)
        fits = []
        # m (index_bytes + 0.5 + 4 / INT4_CHUNK) <= nbytes <= that + 4.5 (the roundings): start below
        m = max(0, int((nbytes - 5) / (index_bytes + 0.5 + 4 / INT4_CHUNK)) - 1)
        while m * index_bytes + self.nbytes(m) <= nbytes:
            if m * index_bytes + self.nbytes(m) == nbytes:
                fits.append(m)
            m += 1
        if len(fits) != 1:
            raise _corrupt(self, nbytes, index_bytes)
        return fits[0]


def check_wire_for(algorithm: str, wire_dtype) -> None:
    """Refuses a wire that the algorithm cannot send (``int4`` is for ``algorithm="dense"`` only).

    Args:
      algorithm: the aggregator's name (``"auto"`` is checked when it chooses).
      wire_dtype: the wire's name.

    Raises:
      ValueError: naming both and what to use instead.
    """
    wire = get_wire(wire_dtype)
    if wire.dense_only and algorithm not in ("dense", "auto"):
        raise ValueError(f"wire_dtype={wire.name!r} with algorithm={algorithm!r}: the "
                         f"{wire.name} wire sends dense blocks only; accepted with it: "
                         f"algorithm='dense' (or a sparse algorithm with wire_dtype='int8', 'float16', "
                         f"'bfloat16' or 'float32')")


FLOAT32 = get_wire("float32")
