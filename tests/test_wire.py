"""The typed wire (tfsparse.wire): encodings, byte counts, float16 overflow, non-finite values,
sparse messages and the record of what the wire lost."""
import numpy as np
import pytest

from tfsparse.buffers import Reusable
from tfsparse.wire import (DECODE_PIECE, INT4_CHUNK, INT8_CHUNK, BlockedIndices, PlainIndices, WireLoss, available_wires,
                           check_wire_for, get_wire, index_codec, index_dtype, pack_sparse, unpack_sparse)

WIRES = ("float32", "float16", "bfloat16", "int8", "int4")
#: the wires a sparse message carries (int4 is for the dense exchange)
SPARSE_WIRES = WIRES[:-1]


def data(n=10_000, seed=0):
    return (np.random.default_rng(seed).standard_normal(n) * np.logspace(-6, 2, n)).astype(np.float32)


def test_registered_and_bad_name():
    assert available_wires() == WIRES
    with pytest.raises(ValueError) as e:
        get_wire("fp8")
    assert "wire_dtype='fp8' is not supported" in str(e.value)
    for w in WIRES:
        assert repr(w) in str(e.value)


@pytest.mark.parametrize("name", WIRES)
@pytest.mark.parametrize("n", [0, 1, 7, INT8_CHUNK, INT8_CHUNK + 3, 10_000])
def test_roundtrip_sizes_and_determinism(name, n):
    w = get_wire(name)
    x = data(n)
    buf, dec = w.roundtrip(x)
    assert buf.dtype == np.uint8 and buf.size == w.nbytes(n)  # no overflow here: nominal size
    if name != "int4" or n == 0:  # int4: every odd count takes the bytes of the even one after it
        assert w.entries(buf.size) == n
    assert w.entries(buf.size + 4 * n, 4) == n  # beside indices every wire's count is unique
    np.testing.assert_array_equal(w.decode(buf, n), dec)
    if name not in ("int8", "int4"):  # 16-bit values re-encode exactly (int8 and int4 re-quantize)
        np.testing.assert_array_equal(w.decode(w.encode(dec), n), dec)
    assert dec.dtype == np.float32 and dec.shape == (n,)


def test_definitions():
    x = data()
    np.testing.assert_array_equal(get_wire("float32").roundtrip(x)[1], x)
    np.testing.assert_array_equal(get_wire("float16").roundtrip(x)[1], x.astype(np.float16).astype(np.float32))
    # bfloat16: the high 16 bits of each float32 (truncation toward zero)
    want = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    np.testing.assert_array_equal(get_wire("bfloat16").roundtrip(x)[1], want)
    assert np.all(np.abs(get_wire("bfloat16").roundtrip(x)[1]) <= np.abs(x))
    # int8: per chunk, q = rint(x * 127 / max|x|), value = q * max|x| / 127
    dec = get_wire("int8").roundtrip(x)[1]
    for c in range(0, x.size, INT8_CHUNK):
        chunk = x[c:c + INT8_CHUNK]
        amax = np.abs(chunk).max()
        q = np.clip(np.rint(chunk * (np.float32(127) / amax)), -127, 127)
        np.testing.assert_array_equal(dec[c:c + INT8_CHUNK], (q * (amax / np.float32(127))).astype(np.float32))
        assert np.abs(dec[c:c + INT8_CHUNK] - chunk).max() <= amax / 254 * 1.0001


def int4_reference(x, chunk=INT4_CHUNK):
    """numpy's int4 wire: per chunk ``q = clip(rint(x * (7 / max|x|)), -7, 7)``, value ``q * (max|x| / 7)``;
    the codes ``q + 8`` two a byte, the first value in the low nibble, an odd count's last high nibble 8."""
    x = np.asarray(x, np.float32)
    codes, dec, scales = np.full(x.size + x.size % 2, 8, np.uint8), np.empty_like(x), []
    for c in range(0, x.size, chunk):
        part = x[c:c + chunk]
        amax = np.abs(part).max()
        scale = np.float32(amax / np.float32(7))
        with np.errstate(over="ignore", divide="ignore"):
            inv = np.float32(7) / amax
        if amax == 0:
            q = np.zeros(part.size)
        elif np.isinf(inv):  # max|x| below 7 / FLT_MAX: the ratio in float64
            q = np.clip(np.rint(part.astype(np.float64) * 7.0 / np.float64(amax)), -7, 7)
        else:
            q = np.clip(np.rint(part * inv), -7, 7)
        codes[c:c + part.size] = (q + 8).astype(np.uint8)
        dec[c:c + chunk] = (q.astype(np.float32) * scale).astype(np.float32)
        scales.append(scale)
    packed = codes[0::2] | (codes[1::2] << 4)
    return np.concatenate([packed, np.array(scales, np.float32).view(np.uint8)]), dec


@pytest.mark.parametrize("n", [1, 2, 7, INT4_CHUNK - 1, INT4_CHUNK, INT4_CHUNK + 1, 3 * INT4_CHUNK + 5, 10_000])
def test_int4_is_its_definition(n):
    """int4: 15 levels per chunk of 512 values, two codes a byte -- the message byte for byte as
    numpy makes it, the loss ``x - decoded``, written in place too, at most half a level per value."""
    w = get_wire("int4")
    x = data(n, seed=n)
    want_buf, want = int4_reference(x)
    loss = np.empty(n, np.float32)
    buf = w.encode(x, loss)
    np.testing.assert_array_equal(buf, want_buf)
    assert buf.size == w.nbytes(n) == (n + 1) // 2 + 4 * -(-n // INT4_CHUNK)
    dec = w.decode(buf, n)
    np.testing.assert_array_equal(dec, want)
    np.testing.assert_array_equal(loss, x - dec)
    for c in range(0, n, INT4_CHUNK):
        amax = np.abs(x[c:c + INT4_CHUNK]).max()
        assert np.abs(dec[c:c + INT4_CHUNK] - x[c:c + INT4_CHUNK]).max() <= amax / 14 * 1.0001
    in_place = x.copy()
    np.testing.assert_array_equal(w.encode(in_place, in_place), want_buf)
    np.testing.assert_array_equal(in_place, x - dec)
    acc = np.ones(n, np.float32)
    w.decode_into(buf, n, acc, accumulate=True)
    np.testing.assert_array_equal(acc, np.float32(1) + dec)


def test_int4_decodes_in_pieces_and_guards_its_edges(monkeypatch):
    """Decoding in pieces (the communicator's progress between them) writes the same values; a
    chunk holding Inf or NaN decodes to NaN; a chunk whose maximum is tiny is scaled in float64;
    a length that fits two counts (an odd one and the even one after it) is refused as a block
    and read beside indices."""
    from tfsparse.wire import values

    w = get_wire("int4")
    x = data(3 * DECODE_PIECE + 1001, seed=3)
    buf = w.encode(x)
    whole = w.decode(buf, x.size)
    calls = []
    got = w.decode_into(buf, x.size, np.empty(x.size, np.float32), progress=lambda: calls.append(1))
    np.testing.assert_array_equal(got, whole)
    assert len(calls) == 3
    monkeypatch.setattr(values, "DECODE_PIECE", 8 * INT4_CHUNK)
    got = w.decode_into(buf, x.size, np.empty(x.size, np.float32), progress=lambda: None)
    np.testing.assert_array_equal(got, whole)
    y = np.zeros(INT4_CHUNK + 5, np.float32)
    y[3], y[-1] = np.inf, 1.0
    loss = np.full(y.size, 9, np.float32)
    dec = w.decode(w.encode(y, loss), y.size)
    assert np.isnan(dec[:INT4_CHUNK]).all() and dec[-1] == 1.0 and not loss[:INT4_CHUNK].any()
    tiny = np.array([1e-45, -2e-45, 0.0], np.float32)  # 7 / max|x| overflows float32
    np.testing.assert_array_equal(w.roundtrip(tiny)[1], int4_reference(tiny)[1])
    with pytest.raises(RuntimeError, match="corrupt int4"):
        w.entries(w.nbytes(7))  # 7 values or 8
    assert w.entries(w.nbytes(8) + 2 * 7, 2) == 7 and w.entries(w.nbytes(8) + 2 * 8, 2) == 8
    for m in (0, 1, 2, 511, 512, 513, 1025, 10_001):  # one-byte indices too: the search starts below
        assert w.entries(w.nbytes(m) + m, 1) == m and w.entries(w.nbytes(m) + 4 * m, 4) == m


def test_int4_is_for_the_dense_exchange_only():
    """A sparse algorithm with the int4 wire is refused before any communication, naming both and
    what is accepted: in the settings, and in a plan's bucket."""
    from tfsparse.settings import Settings

    check_wire_for("dense", "int4")
    for algorithm in ("topk", "gtopk", "oktopk"):
        check_wire_for(algorithm, "int8")
        with pytest.raises(ValueError, match=f"wire_dtype='int4' with algorithm='{algorithm}'.*algorithm='dense'"):
            Settings.of(algorithm=algorithm, wire_dtype="int4")
    with pytest.raises(ValueError, match="wire_dtype='int4' with algorithm='topk'"):
        Settings.of(wire_dtype="int4", density=0.1)  # a density without an algorithm pins top-k
    assert Settings.of(wire_dtype="int4").algorithm == "dense"  # the int4 wire alone: the dense exchange
    assert Settings.of(algorithm="dense", wire_dtype="int4").wire_dtype == "int4"
    with pytest.raises(ValueError, match=r"with algorithm='auto'.*e\.g\. algorithm='dense', wire_dtype='int4'"):
        Settings.of(algorithm="auto", wire_dtype="int4")


def test_float16_overflow_is_scaled_not_inf():
    w = get_wire("float16")
    x = np.array([1e6, -3e5, 1.0, 65504.0, 1e-3], np.float32)
    buf = w.encode(x)
    assert buf.size == 2 * x.size + 1  # one scale byte, an odd length tells the receiver
    dec = w.decode(buf, x.size)
    assert np.all(np.isfinite(dec))
    np.testing.assert_allclose(dec, x, rtol=1e-3, atol=0.1)
    assert w.entries(buf.size) == x.size and w.entries(buf.size + 4 * x.size, 4) == x.size
    e = int(buf[-1])
    assert np.float32(1e6) / 2 ** e <= 65504 < np.float32(1e6) / 2 ** (e - 1)
    # genuine infinities and NaN travel as they are, without scaling
    y = np.array([np.inf, -np.inf, np.nan, 2.0], np.float32)
    buf = w.encode(y)
    assert buf.size == 8
    dec = w.decode(buf, 4)
    assert dec[0] == np.inf and dec[1] == -np.inf and np.isnan(dec[2]) and dec[3] == 2.0


def test_non_finite_values():
    nan_low_payload = np.array([0x7F800001], np.uint32).view(np.float32)  # truncation alone would give Inf
    x = np.concatenate([np.array([np.inf, -np.inf, np.nan, 3.0], np.float32), nan_low_payload])
    dec = get_wire("bfloat16").roundtrip(x)[1]
    assert dec[0] == np.inf and dec[1] == -np.inf and np.isnan(dec[2]) and dec[3] == 3.0 and np.isnan(dec[4])
    # int8 cannot carry them: the chunk decodes to NaN (the receivers see the bad gradient)
    y = np.zeros(INT8_CHUNK + 5, np.float32)
    y[3], y[-1] = np.inf, 1.0
    dec = get_wire("int8").roundtrip(y)[1]
    assert np.isnan(dec[:INT8_CHUNK]).all() and dec[-1] == 1.0


CODECS = {"int32": PlainIndices(2**21), "int64": PlainIndices(2**31), "blocked": BlockedIndices(2**21 + 3)}


@pytest.mark.parametrize("name", SPARSE_WIRES)
@pytest.mark.parametrize("coding", sorted(CODECS))
def test_sparse_messages(name, coding):
    w = get_wire(name)
    codec = CODECS[coding]
    idx = np.array([0, 5, 9, 2**20], np.int64)
    val = np.array([1.5, -2.0, 1e-4, 7.0], np.float32)
    buf, lost = pack_sparse(idx, val, codec, w)
    assert buf.size == codec.nbytes(idx.size) + w.nbytes(idx.size)
    i2, v2 = unpack_sparse(buf, codec, w)
    np.testing.assert_array_equal(i2, idx)
    np.testing.assert_array_equal(v2, w.roundtrip(val)[1])
    if name == "float32":
        assert lost is None
    else:
        np.testing.assert_array_equal(lost, val - v2)
    e_idx, e_val = unpack_sparse(pack_sparse(idx[:0], val[:0], codec, w)[0], codec, w)
    assert e_idx.size == 0 and e_val.size == 0
    with pytest.raises(RuntimeError, match="corrupt"):
        unpack_sparse(buf[:-2] if name != "float16" else buf[:-3], codec, w)


@pytest.mark.parametrize("n", [1, 1000, 2**16, 2**16 + 1, 3 * 2**16 + 17, 17_088_522])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 1000])
def test_blocked_indices_roundtrip(n, m):
    """Any strictly ascending indices in [0, n) come back as they were, in header + 2 bytes each
    (padded to 4); the bytes are 3/4 of int32's and less once a message holds a few entries."""
    rng = np.random.default_rng(n + m)
    idx = np.sort(rng.choice(n, min(m, n), replace=False)).astype(np.int64)
    if idx.size:
        idx[-1] = n - 1  # the last block, the largest index
        idx = np.unique(idx)
    codec = BlockedIndices(n)
    val = rng.standard_normal(idx.size).astype(np.float32)
    for w in map(get_wire, SPARSE_WIRES):
        buf, _ = pack_sparse(idx, val, codec, w)
        i2, v2 = unpack_sparse(buf, codec, w)
        np.testing.assert_array_equal(i2, idx)
        assert i2.dtype == np.int64
        ref = unpack_sparse(pack_sparse(idx, val, PlainIndices(n), w)[0], PlainIndices(n), w)[1]
        np.testing.assert_array_equal(v2.view(np.uint32), ref.view(np.uint32))
    assert codec.nbytes(idx.size) == 4 * -(-n // 2**16) + 4 * -(-idx.size // 2)


def test_blocked_indices_need_ascending_indices():
    codec = BlockedIndices(100)
    for bad in ([3, 2], [1, 1], [-1, 4], [5, 100]):
        with pytest.raises(ValueError, match="strictly ascending"):
            pack_sparse(np.array(bad), np.ones(2, np.float32), codec)
    good, _ = pack_sparse(np.array([1, 2]), np.ones(2, np.float32), codec)
    good[:4] = np.array([3], np.uint32).view(np.uint8)  # the counts say 3 entries, 2 are there
    with pytest.raises(RuntimeError, match="corrupt"):
        unpack_sparse(good, codec)


def test_index_codec_picks_the_smaller_coding():
    n = 17_088_522  # 261 blocks: 1044 header bytes
    assert isinstance(index_codec(n, 170_886), BlockedIndices)  # 0.01: 0.34 MB against 0.68
    assert isinstance(index_codec(n, 18), PlainIndices)          # 1e-6: the header would dominate
    assert isinstance(index_codec(n, 170_886, ascending=False), PlainIndices)  # DRAGONN's slot order
    assert index_codec(2**31, 10).itype == np.int64


def test_index_dtype():
    assert index_dtype(2**31 - 1) == np.int32 and index_dtype(2**31) == np.int64


@pytest.mark.parametrize("name", WIRES)
def test_encode_writes_its_loss(name):
    """encode(x, loss): loss = value - decode(encode(value)), in the same pass, and the same
    message as encode(x); 0 where a value is NaN/Inf (everywhere on the lossless wire)."""
    w = get_wire(name)
    x = data(9000, seed=5)
    x[[7, 8]] = [np.inf, np.nan]
    loss = np.full_like(x, 7.0)
    buf = w.encode(x, loss)
    np.testing.assert_array_equal(buf, w.encode(x))
    if name == "float32":
        assert not loss.any()
        return
    dec = w.decode(buf, x.size)
    finite = np.isfinite(x) & np.isfinite(dec)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(loss[finite], (x - dec)[finite])
    assert loss[7] == 0 and loss[8] == 0 and np.isfinite(loss).all()
    big = data(100, seed=6)
    big[3] = 3e6  # a scaled float16 message: the loss of the scaled encoding
    loss = np.empty_like(big)
    buf = w.encode(big, loss)
    np.testing.assert_allclose(loss, big - w.decode(buf, big.size), rtol=0, atol=0)


@pytest.mark.parametrize("name", WIRES)
@pytest.mark.parametrize("overflow", [False, True])
def test_encode_writes_its_loss_over_the_values_themselves(name, overflow):
    """One pass for a dense exchange's residual: the message of encode(x), and its loss written
    into a given vector -- the encoded values themselves (finite), too; a float16 message that
    must be scaled is scaled from the values taken back exactly (signed zeros included)."""
    w = get_wire(name)
    x = data(9000, seed=8)
    x[::50] = -0.0
    if overflow:
        x[[3, 4]] = [3e6, -70000.0]
    buf = w.encode(x.copy())
    want = np.full_like(x, 7.0)
    np.testing.assert_array_equal(w.encode(x.copy(), want), buf)
    if name == "float32":
        assert not want.any()
    y = x.copy()
    np.testing.assert_array_equal(w.encode(y, y), buf)
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


def test_wire_loss_restrict_and_apply():
    loss = WireLoss()
    x = np.array([1.1, 2.2, 3.3], np.float32)
    loss.add(np.array([2, 5, 9]), None)  # a lossless wire: nothing recorded
    assert not loss
    loss.add(np.array([2, 5, 9]), x - np.round(x))
    loss.add(slice(0, 3), x)
    kept = loss.restrict(np.array([1, 2, 9]))
    r = np.zeros(10, np.float32)
    kept.apply_to(r)
    want = np.zeros(10, np.float32)
    want[[2, 9]] += x[[0, 2]] - np.round(x[[0, 2]])
    want[[1, 2]] += x[[1, 2]]
    np.testing.assert_allclose(r, want, rtol=1e-6)
    assert loss.restrict(None) is loss
    assert not loss.restrict(np.empty(0, np.int64))


@pytest.mark.parametrize("name", WIRES)
@pytest.mark.parametrize("n", [9000, 2 * DECODE_PIECE + INT8_CHUNK + 7])
def test_decode_into_accumulates(name, n):
    """Also in pieces, calling ``progress`` between them (what a dense exchange does over MPI):
    the same values, bit for bit, as one whole decode."""
    w = get_wire(name)
    x = data(n, seed=3)
    if name == "float16":
        x[5] = 1e7  # a scaled message takes the same path
    buf = w.encode(x)
    whole = w.decode(buf, x.size)
    calls = []
    base = data(n, seed=4)
    out = base.copy()
    w.decode_into(buf, x.size, out, accumulate=True, progress=lambda: calls.append(1))
    np.testing.assert_array_equal(out, base + whole)
    w.decode_into(buf, x.size, out, progress=lambda: calls.append(1))
    np.testing.assert_array_equal(out, whole)
    assert len(calls) == 2 * (-(-n // DECODE_PIECE) - 1)  # between pieces, never after the last


def test_half_encoding_is_numpys_round_to_nearest_even():
    """Every float16 value, every midpoint between two of them, the overflow edge, subnormals."""
    f = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    f = f[np.isfinite(f)]
    f = np.sort(f)
    mids = (f[:-1].astype(np.float64) + np.diff(f.astype(np.float64)) / 2).astype(np.float32)
    edge = np.array([65504, 65519.996, 65520, 1e9, 2**-24, 2**-25, 1.5 * 2**-25, 2**-26, 2**-14], np.float32)
    x = np.concatenate([f, mids, edge, -edge])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    from tfsparse.ops import cpu

    codes, loss, over = cpu.half_encode(x)
    got = cpu.decode16_into(codes, cpu.HALF_TABLE, np.empty(x.size, np.float32))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(loss[finite], (x - want)[finite])
    np.testing.assert_array_equal(got, want)
    assert over == int(np.sum(np.isinf(want)))


def test_int8_chunk_with_a_tiny_maximum():
    """max|x| below 127 / FLT_MAX: the codes are still right (the ratio is taken in float64)."""
    x = np.array([3e-38, 0.0, -1e-38, 1.5e-38], np.float32)
    dec = get_wire("int8").roundtrip(x)[1]
    np.testing.assert_allclose(dec, x, rtol=0.01, atol=3e-38 / 127)
    assert dec[1] == 0.0


@pytest.mark.parametrize("name", WIRES)
def test_short_buffers_are_refused(name):
    w = get_wire(name)
    buf = w.encode(data(100))
    with pytest.raises(RuntimeError, match="corrupt"):
        w.decode(buf[:w.nbytes(100) - 3], 100)


def test_16_bit_codecs_inside_tensorflows_flush_to_zero_threads():
    """The exchange encodes and decodes inside TensorFlow's ops, whose threads flush denormals
    (FTZ/DAZ): there too the float16 codes are numpy's, decoding gives numpy's values (half
    subnormals included: the CPU's conversion does not flush them), and the loss is
    ``x - decoded`` as numpy computes it in the same thread -- on denormal-heavy data."""
    tf = pytest.importorskip("tensorflow")

    def run():
        rng = np.random.default_rng(3)
        x = np.concatenate([(rng.standard_normal(5000) * 1e-39), rng.standard_normal(5000) * 1e-6,
                            rng.standard_normal(5000)]).astype(np.float32)
        x[:100] = 1e-42
        codes16 = np.arange(1 << 16, dtype=np.uint16)
        flushed = np.float32(1e-40) * np.float32(1.0) == 0
        out = [np.array([flushed], np.uint8)]
        for name, codes_of in (("float16", lambda v: v.astype(np.float16).view(np.uint16)),
                               ("bfloat16", lambda v: (v.view(np.uint32) >> 16).astype(np.uint16))):
            w = get_wire(name)
            loss = np.empty_like(x)
            buf = w.encode(x, loss)
            want_dec = w.decode(buf, x.size)
            out += [buf.view(np.uint16) == codes_of(x), loss.view(np.uint32) == (x - want_dec).view(np.uint32)]
            table = codes16.view(np.float16).astype(np.float32) if name == "float16" else \
                (codes16.astype(np.uint32) << 16).view(np.float32)
            got = w.decode(codes16.view(np.uint8), codes16.size)
            nan = np.isnan(table)
            out.append((got.view(np.uint32) == table.view(np.uint32)) | (nan & np.isnan(got)))
        return [np.asarray(a, np.uint8) for a in out]

    n = len(run())
    inside = tf.function(lambda: tf.numpy_function(run, [], [tf.uint8] * n, stateful=True))()
    assert inside[0].numpy()[0] == 1  # (TensorFlow's threads do flush denormals)
    for part in inside[1:]:
        assert part.numpy().all()
    for part in run()[1:]:
        assert part.all()


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("name", ["int8", "int4", "float16", "bfloat16"])
@pytest.mark.parametrize("sizes", [[5000, 3, 9000, 4096], [20_000], [100, 100], [4096, 4096, 1], [511, 2, 1023]])
def test_fused_error_feedback_is_the_sum_then_the_encoding(name, sizes, pooled):
    """Wire.compensate_encode -- int8 and int4: chunks inside a piece summed and quantized in one
    pass, chunks a piece boundary cuts (at odd offsets too: int4's codes share bytes) summed piece
    by piece and quantized after; float16 and bfloat16:
    every piece summed and encoded in one pass, float16 encoding again, scaled, where a sum
    overflows -- gives the message and the loss (over acc) of its definition: every sum first,
    then encode with the loss over acc; and a sum that is not finite is reported (finite False).  ``pooled``:
    messages taken from a pool (as the dense aggregator's), acc written by streaming stores."""
    def sum_then_encode(wire, pieces, acc):
        for g, r, at in pieces:
            np.add(g, r, out=acc[at:at + g.size])
        if not np.isfinite(acc).all():
            return None, False
        return wire.encode(acc, acc), True

    rng = np.random.default_rng(len(sizes))
    n = sum(sizes)
    g = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    r = (0.1 * rng.standard_normal(n)).astype(np.float32)
    pieces, at = [], 0
    for a in g:
        pieces.append((a, r[at:at + a.size], at))
        at += a.size
    wire = get_wire(name)
    assert wire.fuses_compensation
    acc, ref = np.empty(n, np.float32), np.empty(n, np.float32)

    pool = Reusable() if pooled else None

    def same():
        message, finite = wire.compensate_encode(pieces, acc, pool, stream=pooled)
        expected, ok = sum_then_encode(wire, pieces, ref)
        assert finite and ok
        np.testing.assert_array_equal(message, expected)
        np.testing.assert_array_equal(acc.view(np.uint32), ref.view(np.uint32))
        return message.copy()

    first = same()
    assert first.size == wire.nbytes(n)
    np.testing.assert_array_equal(same(), first)  # again, into a pooled message
    g[-1][0] = 7e4  # beyond float16's range: its message is scaled (one byte more)
    assert same().size == wire.nbytes(n) + (name == "float16")
    g[-1][-1] = np.inf
    assert not wire.compensate_encode(pieces, acc)[1]
    assert not sum_then_encode(wire, pieces, ref)[1]
    g[-1][-1] = np.nan
    assert not wire.compensate_encode(pieces, acc)[1]
    with pytest.raises(TypeError, match="float32 wire does not encode as it sums"):
        get_wire("float32").compensate_encode(pieces, ref)
