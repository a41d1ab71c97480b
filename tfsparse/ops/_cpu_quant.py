"""The CPU quantization kernels (:mod:`tfsparse.ops.cpu`): int8 and int4 by chunk, float16 with round to
nearest even, bfloat16, their fused error-feedback encodes and the decodes into a sum."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._cpu_bits import (_ABS, _BLK, _CH, _INFK, _NANK, _as_float, _copy_stream16, _from_half, _shifted_max,
                        _store_fence, _to_half)

@njit(parallel=True, cache=True, nogil=True)
def _max_key(xu):
    n = xu.size
    nch = (n + _CH - 1) // _CH
    part = np.zeros(max(nch, 1), np.int64)
    for c in prange(nch):
        lo = c * _CH
        hi = min(lo + _CH, n)
        part[c] = _shifted_max(xu, lo, hi) >> 1
    return min(part.max(), _NANK)


@njit(parallel=True, cache=True, nogil=True)
def _quantize(x, inv, q):
    for i in prange(x.size):
        q[i] = np.int8(min(max(np.rint(x[i] * inv), np.float32(-127.0)), np.float32(127.0)))
    return q


@njit(parallel=True, cache=True, nogil=True)
def _dequantize(q, scale, out):
    for i in prange(q.size):
        out[i] = np.float32(q[i]) * scale
    return out


@njit(parallel=True, cache=True, nogil=True)
def _half_rne(xu, x, table, out, loss):
    """float32 bits -> IEEE binary16 bits, round to nearest even (numpy's ``astype(float16)``),
    and ``loss = x - decoded`` (0 for NaN/Inf, which travel as they are; ``x`` itself where a
    finite value overflowed to Inf, so that a caller writing the loss over ``x`` keeps it);
    returns how many finite values overflowed to Inf.  ``loss`` may be ``x`` itself.

    The conversion is the CPU's (:func:`_to_half`, branch-free and vectorised; timed against
    numpy's ``astype`` by tools/bench_choices.py, ``half_encode`` in docs/engine_choices.json);
    NaN keeps the top payload bits and is made quiet
    explicitly, so the codes do not depend on how a CPU converts NaN.  ``table`` is unused (the
    decoding table's place in the signature)."""
    over = 0
    for i in prange(xu.size):
        u = xu[i]
        a = u & np.uint32(_ABS)
        v = x[i]
        code = _to_half(v)
        if a > np.uint32(_INFK):             # NaN: quiet, keep the top payload bits
            code = np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7E00)
                             | ((a >> np.uint32(13)) & np.uint32(0x3FF)))
        big = a >= np.uint32(0x477FF000)     # >= 65520 rounds to Inf
        finite = a < np.uint32(_INFK)
        over += np.int64(big and finite)
        lost = v - _from_half(code)
        lost = v if big else lost
        out[i] = code
        loss[i] = lost if finite else np.float32(0.0)
    return over


@njit(parallel=True, cache=True, nogil=True)
def _bf16_truncate(xu, x, table, out, loss):
    """float32 bits -> their high 16 bits (bfloat16 by truncation; a NaN stays a NaN), and
    ``loss = x - decoded`` (the dropped low bits; 0 for NaN/Inf).  ``table`` is unused."""
    for i in prange(xu.size):
        u = xu[i]
        a = u & np.uint32(_ABS)
        h = u >> np.uint32(16)
        if a > np.uint32(_INFK):
            h |= np.uint32(0x40)
        out[i] = np.uint16(h)
        lost = x[i] - _as_float(u & np.uint32(0xFFFF0000))
        loss[i] = lost if a < np.uint32(_INFK) else np.float32(0.0)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _half_into(codes, table, out, accumulate):
    """``out[i] (+)= decode(codes[i])`` for binary16 codes: the CPU's conversion (:func:`_from_half`),
    the 65536-entry table only for NaN (numpy's NaN bits, whatever the CPU does).  Codes without a
    NaN (a vectorised test first) take a loop without the table, which vectorises (both paths
    timed by tools/bench_choices.py: ``half_decode`` in docs/engine_choices.json)."""
    if not _has_half_nan(codes):
        if accumulate:
            for i in prange(codes.size):
                out[i] += _from_half(codes[i])
        else:
            for i in prange(codes.size):
                out[i] = _from_half(codes[i])
    elif accumulate:
        for i in prange(codes.size):
            c = codes[i]
            out[i] += table[c] if (c & np.uint16(0x7C00)) == np.uint16(0x7C00) else _from_half(c)
    else:
        for i in prange(codes.size):
            c = codes[i]
            out[i] = table[c] if (c & np.uint16(0x7C00)) == np.uint16(0x7C00) else _from_half(c)
    return out


@njit(cache=True, nogil=True)
def _has_half_nan(codes):
    """Whether some binary16 code is a NaN (``|code| > 0x7C00``)."""
    m = np.uint16(0)
    for i in range(codes.size):
        m = max(m, np.uint16(codes[i] & np.uint16(0x7FFF)))
    return m > np.uint16(0x7C00)


@njit(parallel=True, cache=True, nogil=True)
def _bf16_into(codes, out, accumulate):
    """``out[i] (+)= decode(codes[i])`` for bfloat16 codes: the bits shifted into a float32."""
    if accumulate:
        for i in prange(codes.size):
            out[i] += _as_float(np.uint32(codes[i]) << np.uint32(16))
    else:
        for i in prange(codes.size):
            out[i] = _as_float(np.uint32(codes[i]) << np.uint32(16))
    return out


@njit(parallel=True, cache=True, nogil=True)
def _lookup_into(codes, table, out, accumulate):
    """``out[i] (+)= table[codes[i]]``: 16-bit decoding through a 65536-entry table."""
    if accumulate:
        for i in prange(codes.size):
            out[i] += table[codes[i]]
    else:
        for i in prange(codes.size):
            out[i] = table[codes[i]]
    return out


@njit(cache=True, inline="always")
def _quantize_chunk(y, xs, qs, ls, in_place):
    """One chunk of :func:`_quantize_chunks`: ``xs`` (``y``: its bits) into the codes ``qs`` and
    the loss ``ls`` (``xs`` itself with ``in_place``); returns the chunk's scale."""
    top = np.uint32(0)  # the largest magnitude's bits (vectorised; NaN's are above Inf's)
    for i in range(y.size):
        top = max(top, y[i] & np.uint32(_ABS))
    nan = top > np.uint32(_INFK)
    amax = _as_float(top)
    scale = np.float32(np.nan) if nan else np.float32(amax / np.float32(127.0))
    if nan or amax == np.inf or amax == 0:
        for i in range(qs.size):
            qs[i] = 0
            ls[i] = np.float32(0.0)
    else:
        inv = np.float32(np.float32(127.0) / amax)
        if inv == np.inf:  # max|x| below 127 / FLT_MAX: the ratio in float64
            for i in range(xs.size):
                v = xs[i]
                code = np.int8(min(max(np.rint(np.float64(v) * 127.0 / np.float64(amax)), -127.0), 127.0))
                qs[i] = code
                ls[i] = v - np.float32(code) * scale
        elif in_place:
            for i in range(xs.size):
                v = xs[i]
                code = np.int8(min(max(np.rint(v * inv), np.float32(-127.0)), np.float32(127.0)))
                qs[i] = code
                xs[i] = v - np.float32(code) * scale
        else:
            for i in range(xs.size):
                v = xs[i]
                code = np.int8(min(max(np.rint(v * inv), np.float32(-127.0)), np.float32(127.0)))
                qs[i] = code
                ls[i] = v - np.float32(code) * scale
    return scale


@njit(parallel=True, cache=True, nogil=True)
def _quantize_chunks(x, chunk, q, scales, loss, in_place):
    """Per chunk: ``scale = max|x| / 127``, ``q = clip(rint(x * (127 / max|x|)), -127, 127)``;
    a chunk holding NaN/Inf (or only zeros) gets ``q = 0`` and a NaN/Inf (or zero) scale.
    ``loss = x - q * scale`` (0 in a non-finite chunk: it decodes to NaN everywhere);
    ``in_place``: ``loss`` is ``x``.

    Every loop runs over a chunk's slices from 0 (LLVM's vectoriser does not vectorise
    ``range(lo, hi)`` over the whole arrays), and the
    in-place loop reads and writes one array, which the vectoriser's overlap check passes."""
    n = x.size
    xu = x.view(np.uint32)
    for c in prange(scales.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        scales[c] = _quantize_chunk(xu[lo:hi], x[lo:hi], q[lo:hi], loss[lo:hi], in_place)
    return q


@njit(cache=True, inline="always")
def _store_block(acc, lo, hi, buf, addr, stream):
    """``acc[lo:hi] = buf[:hi - lo]`` -- with ``stream``, by non-temporal stores from ``acc``'s
    first 64-byte aligned element on (``addr``: ``acc``'s address), so that its old lines are
    never read; ordered by the caller's :func:`_store_fence`."""
    m = hi - lo
    i = 0
    if stream:
        head = min(m, (-(addr // 4 + lo)) % 16)  # elements before the first aligned one
        a = acc[lo:lo + head]
        for j in range(head):
            a[j] = buf[j]
        i = head
        while i + 16 <= m:
            _copy_stream16(acc, lo + i, buf, i)
            i += 16
    a, b = acc[lo + i:hi], buf[i:m]
    for j in range(a.size):
        a[j] = b[j]


@njit(cache=True, inline="always")
def _chunk_sum(buf, g, r, lo, hi):
    """``buf[:hi - lo] = g[lo:hi] + r[lo:hi]`` -- a fused error-feedback kernel's sums of one
    chunk, made in a buffer that stays in the cache; returns ``hi - lo``."""
    m = hi - lo
    bs, gs, rs = buf[:m], g[lo:hi], r[lo:hi]
    for i in range(m):
        bs[i] = gs[i] + rs[i]
    return m


@njit(parallel=True, cache=True, nogil=True)
def _add_quantize_chunks(g, r, acc, chunk, q, scales, addr, stream):
    """``acc = g + r`` quantized as :func:`_quantize_chunks` does in place -- error feedback and
    the int8 encoding in one pass: per chunk the sums are made in a chunk-sized buffer (in the
    cache), quantized there into ``q`` and ``scales``, and what that lost is written to ``acc``
    -- with ``stream``, by non-temporal stores from its first 64-byte aligned element on
    (``addr``: ``acc``'s address), so that ``acc``'s old lines are never read.  Memory traffic:
    ``g`` and ``r`` read, ``acc`` and the codes written, against the separate passes' ``g``,
    ``r`` read, ``acc`` written, read again and written again."""
    n = g.size
    nch = scales.size
    per = max(1, _CH // chunk)  # chunks per parallel task: one buffer each
    for t in prange((nch + per - 1) // per):
        buf = np.empty(chunk, np.float32)
        bu = buf.view(np.uint32)
        for c in range(t * per, min((t + 1) * per, nch)):
            lo = c * chunk
            hi = min(lo + chunk, n)
            m = _chunk_sum(buf, g, r, lo, hi)
            scales[c] = _quantize_chunk(bu[:m], buf[:m], q[lo:hi], buf[:m], True)
            _store_block(acc, lo, hi, buf, addr, stream)
        _store_fence()
    return scales


_SUM16 = 2048  # elements summed and encoded per step of _add_encode16 (8 KiB: stays in L1)


@njit(parallel=True, cache=True, nogil=True)
def _add_encode16(g, r, acc, codes, addr, stream, half):
    """``acc = g + r`` encoded to 16 bits -- error feedback and the float16 (``half``: as
    :func:`_half_rne`) or bfloat16 (as :func:`_bf16_truncate`) encoding in one pass: per
    :data:`_SUM16` elements the sums are made in a buffer (in the cache), encoded there into
    ``codes``, and what that lost is written to ``acc`` -- with ``stream``, by non-temporal stores
    from its first 64-byte aligned element on (``addr``: ``acc``'s address).  Returns
    ``(overflowed, nonfinite)``: how many finite sums float16 turned into Inf (their loss is not
    kept: the caller encodes again, scaled) and how many sums are NaN/Inf (their codes and loss
    are undefined: the caller drops the round)."""
    n = g.size
    over = 0
    bad = 0
    for t in prange((n + _CH - 1) // _CH):
        buf = np.empty(_SUM16, np.float32)
        bu = buf.view(np.uint32)
        for lo in range(t * _CH, min((t + 1) * _CH, n), _SUM16):
            hi = min(lo + _SUM16, n, (t + 1) * _CH)
            m = hi - lo
            bs, ys, gs, rs, cs = buf[:m], bu[:m], g[lo:hi], r[lo:hi], codes[lo:hi]
            for i in range(m):
                bs[i] = gs[i] + rs[i]
            if half:
                for i in range(m):
                    a = ys[i] & np.uint32(_ABS)
                    v = bs[i]
                    code = _to_half(v)
                    big = a >= np.uint32(0x477FF000)  # >= 65520 rounds to Inf
                    finite = a < np.uint32(_INFK)
                    over += np.int64(big and finite)
                    bad += np.int64(not finite)
                    cs[i] = code
                    bs[i] = v - _from_half(code)
            else:
                for i in range(m):
                    u = ys[i]
                    bad += np.int64((u & np.uint32(_ABS)) >= np.uint32(_INFK))
                    cs[i] = np.uint16(u >> np.uint32(16))
                    bs[i] = bs[i] - _as_float(u & np.uint32(0xFFFF0000))
            _store_block(acc, lo, hi, buf, addr, stream)
        _store_fence()
    return over, bad


@njit(parallel=True, cache=True, nogil=True)
def _dequantize_chunks_into(q, scales, chunk, out, accumulate):
    n = q.size
    for c in prange(scales.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        s = scales[c]
        qs, os = q[lo:hi], out[lo:hi]  # slices from 0: vectorised (see _quantize_chunks)
        if accumulate:
            for i in range(qs.size):
                os[i] = os[i] + np.float32(qs[i]) * s
        else:
            for i in range(qs.size):
                os[i] = np.float32(qs[i]) * s
    return out


@njit(cache=True, inline="always")
def _code4(t):
    """``clip(rint(t), -7, 7)`` as an offset nibble (1 to 15; 8 is zero): ``t`` is ``x * 7 / max|x|``."""
    return np.uint8(np.int32(min(max(np.rint(t), np.float32(-7.0)), np.float32(7.0))) + 8)


@njit(cache=True, inline="always")
def _quantize4_chunk(y, xs, qs, ls, cs):
    """One chunk of :func:`_quantize4_chunks`: ``xs`` (``y``: its bits, an even number of values
    but in the last chunk) into the packed nibbles ``qs`` (value ``2j`` in byte ``j``'s low
    nibble, ``2j + 1`` in its high one) and the loss ``ls`` (``xs`` itself allowed: each value is
    read before its loss is written), the codes first into ``cs`` (a chunk-sized buffer, in the
    cache: the per-value loops vectorise, the packing reads it); returns the chunk's scale."""
    top = np.uint32(0)
    for i in range(y.size):
        top = max(top, y[i] & np.uint32(_ABS))
    nan = top > np.uint32(_INFK)
    amax = _as_float(top)
    scale = np.float32(np.nan) if nan else np.float32(amax / np.float32(7.0))
    m = xs.size
    if nan or amax == np.inf or amax == 0:
        for j in range(qs.size):
            qs[j] = np.uint8(0x88)
        for i in range(m):
            ls[i] = np.float32(0.0)
        return scale
    inv = np.float32(np.float32(7.0) / amax)
    c = cs[:m]
    if inv == np.inf:  # max|x| below 7 / FLT_MAX: the ratio in float64
        for i in range(m):
            c[i] = _code4(np.float64(xs[i]) * 7.0 / np.float64(amax))
    else:
        for i in range(m):
            c[i] = _code4(xs[i] * inv)
    for i in range(m):
        ls[i] = xs[i] - np.float32(np.int32(c[i]) - 8) * scale
    for j in range(m // 2):
        qs[j] = c[2 * j] | (c[2 * j + 1] << np.uint8(4))
    if m % 2:
        qs[m // 2] = c[m - 1] | np.uint8(0x80)  # the unused high nibble: zero
    return scale


@njit(parallel=True, cache=True, nogil=True)
def _quantize4_chunks(x, chunk, q, scales, loss):
    """Per chunk of ``chunk`` (even) values: ``scale = max|x| / 7``, ``code = clip(rint(x * (7 /
    max|x|)), -7, 7)``, two codes a byte (:func:`_quantize4_chunk`); a chunk holding NaN/Inf (or
    only zeros) gets zero codes and a NaN/Inf (or zero) scale.  ``loss = x - code * scale`` (0
    in a non-finite chunk; ``x`` itself allowed)."""
    n = x.size
    xu = x.view(np.uint32)
    nch = scales.size
    per = max(1, _CH // chunk)  # chunks per parallel task: one code buffer each
    for t in prange((nch + per - 1) // per):
        cs = np.empty(chunk, np.uint8)
        for c in range(t * per, min((t + 1) * per, nch)):
            lo = c * chunk
            hi = min(lo + chunk, n)
            scales[c] = _quantize4_chunk(xu[lo:hi], x[lo:hi], q[lo // 2:(hi + 1) // 2], loss[lo:hi], cs)
    return q


@njit(parallel=True, cache=True, nogil=True)
def _add_quantize4_chunks(g, r, acc, chunk, q, scales, addr, stream):
    """``acc = g + r`` quantized as :func:`_quantize4_chunks` does in place, in one pass, as
    :func:`_add_quantize_chunks` does for int8: per chunk the sums are made in a buffer (in the
    cache), quantized there into ``q`` and ``scales``, and what that lost is written to ``acc``
    (``stream``: by non-temporal stores from its first 64-byte aligned element on; ``addr``:
    ``acc``'s address)."""
    n = g.size
    nch = scales.size
    per = max(1, _CH // chunk)
    for t in prange((nch + per - 1) // per):
        buf = np.empty(chunk, np.float32)
        bu = buf.view(np.uint32)
        cs = np.empty(chunk, np.uint8)
        for c in range(t * per, min((t + 1) * per, nch)):
            lo = c * chunk
            hi = min(lo + chunk, n)
            m = _chunk_sum(buf, g, r, lo, hi)
            scales[c] = _quantize4_chunk(bu[:m], buf[:m], q[lo // 2:(hi + 1) // 2], buf[:m], cs)
            _store_block(acc, lo, hi, buf, addr, stream)
        _store_fence()
    return scales


@njit(parallel=True, cache=True, nogil=True)
def _dequantize4_chunks_into(q, scales, chunk, n, out, accumulate):
    """``out (+)= (code - 8) * scale`` for the ``n`` values packed two a byte in ``q``."""
    for c in prange(scales.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        s = scales[c]
        qs, os = q[lo // 2:(hi + 1) // 2], out[lo:hi]
        m = hi - lo
        for j in range(m // 2):
            b = np.int32(qs[j])
            a0 = np.float32((b & 15) - 8) * s
            a1 = np.float32((b >> 4) - 8) * s
            if accumulate:
                os[2 * j] += a0
                os[2 * j + 1] += a1
            else:
                os[2 * j] = a0
                os[2 * j + 1] = a1
        if m % 2:
            a0 = np.float32((np.int32(qs[m // 2]) & 15) - 8) * s
            if accumulate:
                os[m - 1] += a0
            else:
                os[m - 1] = a0
    return out


@njit(parallel=True, cache=True, nogil=True)
def _truncate_fp16(xu, out):
    """float32 bits -> IEEE binary16 bits, rounding toward zero (drops mantissa bits)."""
    for i in prange(xu.size):
        u = np.int64(xu[i])
        sign = (u >> 16) & 0x8000
        a = u & _ABS
        e = a >> 23
        if a > _INFK:                        # NaN: quiet, keep the top payload bits
            h = 0x7E00 | ((a >> 13) & 0x3FF)
        elif a == _INFK:
            h = 0x7C00
        elif e >= 143:                       # beyond 65504: saturate (round toward zero)
            h = 0x7BFF
        elif e >= 113:                       # normal half
            h = (a >> 13) - (112 << 10)
        elif e >= 102:                       # subnormal half
            h = ((a & 0x7FFFFF) | 0x800000) >> (126 - e)
        else:                                # below the smallest subnormal
            h = 0
        out[i] = np.uint16(sign | h)
    return out


@njit(cache=True, fastmath={"reassoc"}, inline="always")
def _abs_sum32(x, b0, b1):
    y = x[b0:b1]
    s = np.float32(0.0)
    for i in range(y.size):
        s += abs(y[i])
    return s


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc"})
def _chunk_l1(x, chunk, out):
    """float32 sums of 256-element blocks (vectorised: 8 elements per lane) added in float64."""
    n = x.size
    for c in prange(out.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        s = 0.0
        for b0 in range(lo, hi, 4 * _BLK):
            s += np.float64(_abs_sum32(x, b0, min(b0 + 4 * _BLK, hi)))
        out[c] = np.float32(s)
    return out
