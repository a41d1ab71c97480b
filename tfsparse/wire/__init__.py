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
``int4``      the same with 15 levels, ``rint(x*7/max|x|)``,   ``ceil(m/2)              yes
              per chunk of ``INT4_CHUNK`` (512) values, two    + 4 ceil(m/512)``
              codes a byte; for ``algorithm="dense"`` only
              (a block's length does not tell an odd count
              from the even one after it)
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
truncation keeps a quiet-NaN bit).  ``int8`` and ``int4`` cannot: a chunk holding a non-finite value gets
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

The package's modules, by concern: :mod:`tfsparse.wire.values` (the value encodings),
:mod:`tfsparse.wire.indices` (index codecs and sparse messages), :mod:`tfsparse.wire.loss`
(what the wire lost).
"""
from .indices import (INDEX_BLOCK, BlockedIndices, PlainIndices, index_codec, index_dtype, pack_sparse,  # noqa: F401
                      unpack_sparse)
from .loss import WireLoss  # noqa: F401
from .values import (DECODE_PIECE, FLOAT32, INT4_CHUNK, INT8_CHUNK, WIRES, BFloat16, Float16, Float32, Int4,  # noqa: F401
                     Int8, Wire, available_wires, check_wire_for, get_wire, register_wire)
