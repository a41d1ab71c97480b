"""Where an exchange's vectors live: host memory (numpy) or a CUDA device.

A :class:`~tfsparse.exchange.GradientExchange` keeps, per bucket, the vector it sparsifies
(``acc``), the residual (error feedback) and the memory's velocity; one step also makes the
dense result.  A *space* holds those vectors and does the few things the exchange and the
memories do to them -- add, momentum, the finite check, zeroing the contributed entries, adding
what the wire lost, decoding a result -- so that one exchange pipeline serves both:

* :data:`HOST` -- numpy arrays, the operations exactly as numpy does them;
* :class:`CudaSpace` -- ``numba.cuda`` device arrays and the kernels of
  :mod:`tfsparse.ops.cuda`.  Gradients handed to the exchange as device arrays (anything with
  ``__cuda_array_interface__``: CuPy, Numba, PyTorch CUDA tensors; numba's simulator arrays)
  never leave the device: the selection runs there (the aggregators that can, see
  :attr:`tfsparse.aggregators.Aggregator.accepts_device`), only the sparse payload is copied to
  the host for the transport, and the result is decoded on the device (gtopk-ssgd-shi2019
  §III-F: "transferring the non-values through PCIe could be much faster than transferring the
  whole gradients"; dragonn-wang2022 §4.3: decoding on the GPU).  The buckets of the other
  aggregators keep their memory on the host: their gradients are copied once into a page-locked
  host vector (:meth:`CudaSpace.host_copies`), the host's fused passes run there, and the result
  is copied to the device.

Decoding is deterministic on both: the payloads of the P ranks are added one rank after the
other (each payload's indices are unique, so no two threads of a launch touch one element), in
the order ``np.add.at`` adds them on the host -- every rank gets bit-identical sums, equal to the
host path's.  The device's elementwise float32 arithmetic rounds as numpy's does (no FMA
contraction), so a device-resident exchange gives the host exchange's results bit for bit --
except for ``clip_norm``, whose float64 norm is summed in a different order.
"""
from __future__ import annotations

import contextlib
import functools
import math

import numpy as np

from . import traffic
from .buffers import HostOutputs


def clip_by_global_norm(arrays, max_norm: float) -> list:
    """DGC's local gradient clipping (Lin et al. 2018 §3.3, "we perform the gradient clipping
    locally before adding the current gradient to previous accumulation"): ``arrays`` scaled by
    ``max_norm / max(norm, max_norm)``, ``norm`` the L2 norm over all of them (as
    ``tf.clip_by_global_norm``).  New arrays when scaled; the input is never modified.  A
    non-finite norm leaves the arrays as they are (the exchange skips that round)."""
    squares = 0.0
    for a in arrays:
        v = a.reshape(-1).astype(np.float64)
        squares += float(np.dot(v, v))
    norm = math.sqrt(squares)
    if not math.isfinite(norm) or norm <= max_norm:
        return list(arrays)
    scale = max_norm / norm
    return [(a * scale).astype(a.dtype, copy=False) for a in arrays]


class _FreshOutputs:
    """A space whose decode allocates its own result (the device): nothing to hand out."""

    def take(self):
        return None


class HostSpace:
    """Vectors as numpy arrays (every operation as the exchange always did it)."""

    name = "host"
    on_device = False

    def active(self):
        """A context in which this space's operations run (the host: nothing to enter)."""
        return contextlib.nullcontext()

    def accept(self, a):
        """One gradient as an array of this space (a device array is copied to the host)."""
        if hasattr(a, "copy_to_host"):
            return a.copy_to_host()
        if hasattr(a, "__cuda_array_interface__"):
            from .ops import cuda as kc

            return kc.as_device(a, np.dtype(a.__cuda_array_interface__["typestr"])).copy_to_host()
        return np.asarray(a)

    def zeros(self, n: int):
        """A new float32 vector of ``n`` zeros."""
        return np.zeros(int(n), np.float32)

    def empty(self, n: int):
        """A new float32 vector of ``n`` elements, not initialised."""
        return np.empty(int(n), np.float32)

    def full(self, n: int, value: float):
        """A new float32 vector of ``n`` elements, each ``value``."""
        return np.full(int(n), value, np.float32)

    def fill(self, x, value: float) -> None:
        """``x[:] = value``, in place."""
        x.fill(value)

    def copy(self, out, a) -> None:
        """``out[:] = a`` (``a`` flattened; numpy's ``same_kind`` casting)."""
        np.copyto(out, np.reshape(a, -1), casting="same_kind")

    def add(self, a, b, out) -> None:
        """``out = a + b`` (``a`` flattened; ``out`` may be ``a`` or ``b``)."""
        np.add(np.reshape(a, -1), b, out=out, casting="same_kind")

    def plus(self, a, b):
        """A new vector ``a + b``."""
        return a + b

    def momentum(self, u, m, g, r, out) -> None:
        """``u = m*u + g; out = u + r``."""
        np.multiply(u, m, out=u)
        np.add(u, np.reshape(g, -1), out=u, casting="same_kind")
        np.add(u, r, out=out)

    def all_finite(self, x) -> bool:
        """One BLAS dot product (``x·x`` is NaN or Inf when any element is), confirmed element by
        element only when the dot overflowed."""
        # the dot against np.isfinite: the ``all_finite`` rows of docs/engine_choices.json
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(np.dot(x, x))) or bool(np.isfinite(x).all())

    def zero_nonfinite(self, x) -> None:
        """NaN and +-Inf elements of ``x`` set to 0, in place."""
        np.nan_to_num(x, copy=False, nan=0.0, posinf=0.0, neginf=0.0)

    def zero_at(self, x, idx) -> None:
        """``x[idx] = 0``, in place."""
        x[idx] = 0.0

    def add_at(self, x, where, values) -> None:
        """``x[where] += values`` (``where``: unique indices or a slice)."""
        x[where] += values

    def load(self, x, values) -> None:
        """``x[:] = values`` (host data of ``x``'s size, as float32), or zeros when ``values`` is None
        (restoring a state that lacks it)."""
        if values is None:
            self.fill(x, 0.0)
        else:
            self._put(x, np.ascontiguousarray(values, np.float32).reshape(-1))

    def _put(self, x, values) -> None:
        x[:] = values

    def to_host(self, x):
        """``x`` as a host array: ``x`` itself (a host vector already is one)."""
        return x

    def from_host(self, x):
        """``x`` as a float32 numpy array (no copy when it already is one)."""
        return np.asarray(x, np.float32)

    def outputs(self, n: int) -> HostOutputs:
        """The result vectors of a bucket of ``n`` elements (:class:`HostOutputs`)."""
        return HostOutputs(n)

    def decode(self, result, n: int, out=None):
        """The dense float32 result of an :class:`~tfsparse.aggregators.AllreduceResult`, written
        whole into ``out`` when given (a result vector of the bucket's :meth:`outputs`).  Every
        element is written, whatever ``out`` held: a vector handed to TensorFlow may come back
        written (its ops may reuse an input's memory for their output), so nothing is assumed
        about what it holds."""
        return result.to_dense(n, out)

    def concat(self, parts):
        """The vectors ``parts`` joined into one new vector (the copy counted as ``copy`` traffic,
        :mod:`tfsparse.traffic`)."""
        nbytes = sum(int(np.size(p)) for p in parts) * 4
        traffic.count("copy", read=nbytes, written=nbytes)
        return np.concatenate(parts)

    def clip_by_global_norm(self, arrays, max_norm: float) -> list:
        """DGC's local clipping of the host arrays ``arrays`` by their global L2 norm
        (:func:`clip_by_global_norm`): new arrays when scaled, the inputs otherwise."""
        return clip_by_global_norm(arrays, max_norm)


class CudaSpace(HostSpace):
    """Vectors as ``numba.cuda`` device arrays; operations by :mod:`tfsparse.ops.cuda` kernels."""

    name = "cuda"
    on_device = True

    def __init__(self, device_id: int = 0):
        from .ops import cuda as kc

        self._k = kc
        self._cuda = kc.cuda
        #: the CUDA ordinal of the GPU the vectors live on
        self.device_id = int(device_id)

    def active(self):
        """Makes this space's GPU current in the calling thread (``numba.cuda.gpus[i]``, the
        primary context pushed on entry and popped on exit).  The exchange enters it wherever it
        touches its vectors: in its caller's thread, in TensorFlow's executor threads (which run
        ``tf.py_function``) and in its communication thread -- a thread's current device is
        GPU 0 otherwise, wrong for every rank but the first of a node whose processes each see
        all GPUs (Horovod's and ``SparseStrategy``'s ``/gpu:<local_rank>``)."""
        return self._cuda.gpus[self.device_id]

    def accept(self, a):
        """A device view of one gradient (float32; host arrays are copied to the device)."""
        shape = tuple(int(d) for d in getattr(a, "shape", np.shape(a)))
        return self._k.as_device(a).reshape(shape)

    def zeros(self, n: int):
        """A new float32 device vector of ``n`` zeros (filled by a kernel)."""
        return self.full(n, 0.0)

    def empty(self, n: int):
        """A new float32 device vector of ``n`` elements, not initialised (``cuda.device_array``)."""
        return self._cuda.device_array(int(n), np.float32)

    def full(self, n: int, value: float):
        """A new float32 device vector of ``n`` elements, each ``value`` (filled by a kernel)."""
        out = self.empty(n)
        self._k.fill(out, value)
        return out

    def fill(self, x, value: float) -> None:
        """``x[:] = value`` on the device, in place."""
        self._k.fill(x, value)

    def copy(self, out, a) -> None:
        """``out[:] = a`` on the device (``a``: a float32 device array, viewed in place, or a host
        array, copied to the device first)."""
        out.copy_to_device(self._k.as_device(a))

    def add(self, a, b, out) -> None:
        """``out = a + b`` by one kernel (float32 device vectors of one length; ``out`` may be ``a``
        or ``b``)."""
        self._k.add(a, b, out)

    def plus(self, a, b):
        """A new device vector ``a + b``."""
        out = self.empty(a.size)
        self._k.add(a, b, out)
        return out

    def momentum(self, u, m, g, r, out) -> None:
        """``u = m*u + g; out = u + r`` by one kernel, rounded as numpy rounds it
        (:func:`tfsparse.ops.cuda.momentum_step`)."""
        self._k.momentum_step(u, m, g, r, out)

    def all_finite(self, x) -> bool:
        """Whether no element of the device vector ``x`` is NaN or +-Inf: one kernel, one flag
        read back to the host."""
        return self._k.all_finite(x)

    def zero_nonfinite(self, x) -> None:
        """NaN and +-Inf elements of ``x`` set to 0 on the device, in place."""
        self._k.zero_nonfinite(x)

    def zero_at(self, x, idx) -> None:
        """``x[idx] = 0`` on the device (``idx``: host or device int64 indices)."""
        self._k.zero_at(x, idx)

    def add_at(self, x, where, values) -> None:
        """``x[where] += values`` on the device: a slice by the elementwise add, unique indices by
        :func:`tfsparse.ops.cuda.scatter_add` (no two threads add to one element: deterministic)."""
        values = np.ascontiguousarray(values, np.float32)
        if isinstance(where, slice):
            part = x[where]
            self._k.add(part, values, part)
        else:
            self._k.scatter_add(x.size, np.asarray(where, np.int64), values, out=x)  # unique: deterministic

    def _put(self, x, values) -> None:
        x.copy_to_device(values)

    def to_host(self, x):
        """A host copy (numpy) of the device vector ``x``."""
        return x.copy_to_host()

    def host_copies(self, arrays, staging):
        """``arrays`` (device vectors) copied into consecutive views of ``staging``, a host float32
        vector at least as long as they are together (:meth:`staging`): one copy each, into memory
        that is reused (page-locked: the copies run at the link's speed, no page is faulted)."""
        out, off = [], 0
        for a in arrays:
            size = int(a.size)
            view = staging[off:off + size].reshape(a.shape)
            a.copy_to_host(view)
            out.append(view)
            off += size
        traffic.count("copy", read=4 * off, written=4 * off)
        return out

    def staging(self, n: int):
        """A page-locked host float32 vector of ``n`` elements, for :meth:`host_copies`."""
        return self._cuda.pinned_array(int(n), np.float32)

    def from_host(self, x):
        """A device copy of the host array ``x``, as contiguous float32."""
        return self._cuda.to_device(np.ascontiguousarray(x, np.float32))

    def outputs(self, n: int) -> _FreshOutputs:
        """No result vectors to hand out: the device's :meth:`decode` allocates each result itself
        (``take()`` gives None)."""
        return _FreshOutputs()

    def decode(self, result, n: int, out=None):
        """The dense result on the device: rank-ordered payloads added one payload per launch
        (deterministic), a sparse result set at its indices, a dense one copied over (``out``,
        a host vector, is not used)."""
        if result.pieces is not None:
            out = self.zeros(n)
            for idx, val in result.pieces:
                if len(idx):
                    self._k.scatter_add(n, np.asarray(idx, np.int64), np.asarray(val, np.float32), out=out)
            return out
        if result.indices is None:
            return self.from_host(np.asarray(result.values, np.float32).reshape(-1))
        out = self.zeros(n)
        self._k.set_at(out, np.asarray(result.indices, np.int64), np.asarray(result.values, np.float32))
        return out

    def concat(self, parts):
        """The device vectors ``parts`` copied one after the other into one new device vector."""
        out = self.empty(sum(int(p.size) for p in parts))
        off = 0
        for p in parts:
            out[off:off + p.size].copy_to_device(p)
            off += p.size
        return out

    def clip_by_global_norm(self, arrays, max_norm: float) -> list:
        """DGC's local clipping on the device: the global L2 norm of ``arrays`` from float64 sums of squares
        (one kernel per array, atomic partial sums: the last bits may differ from the host's), and each array
        scaled by ``max_norm / norm`` into a new one when the norm is above ``max_norm``; ``arrays`` as they are
        when it is not, or when it is not finite."""
        norm = math.sqrt(sum(self._k.sum_squares(a.reshape(-1)) for a in arrays))
        if not math.isfinite(norm) or norm <= max_norm:
            return list(arrays)
        out = []
        for a in arrays:
            scaled = self.empty(a.size)
            self._k.scale(a.reshape(-1), max_norm / norm, scaled)
            out.append(scaled.reshape(a.shape))
        return out


HOST = HostSpace()
_CUDA: dict = {}  # CUDA ordinal -> CudaSpace


def cuda_space(device_id: int | None = None) -> CudaSpace:
    """The :class:`CudaSpace` of GPU ``device_id`` (default: the calling thread's current device)."""
    if device_id is None:
        from numba import cuda

        device_id = getattr(cuda.get_current_device(), "id", 0)  # the simulator's device has no id
    device_id = int(device_id)
    if device_id not in _CUDA:
        _CUDA[device_id] = CudaSpace(device_id)
    return _CUDA[device_id]


def space_for(x):
    """:data:`HOST` for host arrays, the :class:`CudaSpace` of their GPU for device arrays: the
    device a DLPack producer names (CuPy, PyTorch, TensorFlow), else the calling thread's current
    device (Numba arrays, which do not say)."""
    from .ops import device_kind

    if device_kind(x) != "cuda":
        return HOST
    device = getattr(x, "__dlpack_device__", None)
    return cuda_space(int(device()[1]) if device is not None else None)


def in_space(method):
    """An exchange method run with the exchange's space active (its GPU current in the calling
    thread, :meth:`tfsparse.space.CudaSpace.active`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.space.active():
            return method(self, *args, **kwargs)

    return run
