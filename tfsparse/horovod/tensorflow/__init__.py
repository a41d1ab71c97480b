"""``horovod.tensorflow``'s process queries and collectives, on tfsparse's communicator.

>>> import tfsparse.horovod.tensorflow as hvd     # was: import horovod.tensorflow as hvd
>>> hvd.init()
>>> hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()
>>> hvd.allreduce(tf.constant([1.0, 2.0]))                    # the mean over ranks (op=hvd.Average)
>>> hvd.allgather(tf.ones([hvd.rank() + 1, 3]))               # rows of every rank, in rank order
>>> hvd.broadcast(tf.constant(hvd.rank()), root_rank=0)      # rank 0's value everywhere
>>> hvd.broadcast_variables(model.variables, root_rank=0)

Each call has Horovod's meaning, eagerly and inside ``tf.function`` (where the collectives of a
function run in the order they were written, on every rank), with Horovod's gradients
(``allreduce``'s is the allreduce of the gradient; ``allgather``'s the average of the gradient's
rows of this rank; ``broadcast``'s the average on the root rank, zero elsewhere).  Every rank
must make the same calls in the same order: unlike Horovod, which matches the ranks' tensors by
name, tfsparse matches them by order; as Horovod, each collective first checks that the ranks'
tensors agree in dtype and shape (``allgather``'s after the first dimension) and raises the same
``ValueError`` on every rank where they do not.  Python objects travel with
``broadcast_object`` and ``allgather_object``; Horovod's questions about the build
(``mpi_built()``, ``nccl_built()``, ...) are answered for tfsparse (:mod:`.basics`).

What differs from Horovod: there are no process sets (``process_set=`` accepts the global one
only), no Adasum or Product reduction, and ``device_dense``/``device_sparse`` are accepted and
ignored (the collectives run on the host).  ``Compression.fp16`` halves what a float tensor
carries as Horovod's does; the sum is formed in float32 and rounded to float16 once (Horovod
rounds after every addition), so results may differ from Horovod's in the last bit.  Names
of ``horovod.tensorflow`` not provided here raise an ``AttributeError`` naming them.
"""
from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from ... import _checks, runtime
from ...collectives import host_ids
from ...tf_glue import on_values

#: the reduction ops, with Horovod's values (``hvd.Average == 0`` as in horovod.tensorflow)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OPS = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max"}
_NOT_PROVIDED_OPS = {Adasum: "Adasum", Product: "Product"}


class NoneCompressor:
    """No compression: the tensor travels as it is (Horovod's ``Compression.none``)."""

    @staticmethod
    def compress(tensor):
        """``tensor`` as it is, with no context.

        Args:
          tensor: the tensor to send.

        Returns:
          ``(tensor, None)``.
        """
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """``tensor`` as it is.

        Args:
          tensor: the tensor received.
          ctx: the context :meth:`compress` returned (None; unused).

        Returns:
          ``tensor``.
        """
        return tensor


class FP16Compressor:
    """Float tensors travel as float16 and come back in their own dtype (Horovod's
    ``Compression.fp16``); other dtypes travel as they are."""

    @staticmethod
    def compress(tensor):
        """A float tensor cast to float16, with its own dtype as the context; any other tensor as it is.

        Args:
          tensor: the tensor to send.

        Returns:
          ``(tensor as float16, its dtype)`` for a float tensor that is not float16, else ``(tensor, None)``.
        """
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """``tensor`` cast back to the dtype :meth:`compress` recorded.

        Args:
          tensor: the tensor received.
          ctx: the context :meth:`compress` returned: the tensor's dtype, or None (nothing to cast).

        Returns:
          The tensor in its original dtype.
        """
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Horovod's choice of what a tensor travels as: ``Compression.none`` or ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


class _GlobalProcessSet:
    """The only process set there is: every rank (Horovod's ``hvd.global_process_set``)."""

    process_set_id = 0

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def __repr__(self):
        return "ProcessSet(process_set_id=0, ranks=all)"


global_process_set = _GlobalProcessSet()

_state: dict = {"topology": None}


def init(comm=None, process_sets=None) -> None:
    """Joins the job's world and learns which ranks share a host (Horovod's ``hvd.init()``).

    Runs :func:`tfsparse.init` (MPI, or Horovod's collectives when launched by ``horovodrun``)
    and one allgather of a hash of each rank's host name, from which the local and cross ranks
    come; collective (every rank calls it), idempotent.

    Args:
      comm: Horovod's sub-communicator; only ``None`` (the whole job) is accepted.
      process_sets: Horovod's process sets; only ``None`` (or an empty list) is accepted: there are
        none here.

    Raises:
      ValueError: ``comm`` or ``process_sets`` given.
    """
    if comm is not None:
        raise ValueError(f"init(comm={comm!r}) is not supported by tfsparse.horovod: it runs on every rank of the "
                         f"job (accepted: comm=None)")
    if process_sets not in (None, [], ()):
        raise ValueError(f"init(process_sets={process_sets!r}) is not supported by tfsparse.horovod: there are no "
                         f"process sets (accepted: process_sets=None)")
    world = runtime.init()
    if _state["topology"] is None:
        _state["topology"] = _topology(world)


def _topology(world) -> dict:
    """local and cross ranks and sizes from the ranks' hosts (one allgather of a hostname hash):
    the local ranks are the ranks on this host in rank order; the cross ranks, those with this
    local rank, one per host."""
    hosts = host_ids(world)
    local_of = [sum(1 for q in range(r) if hosts[q] == hosts[r]) for r in range(len(hosts))]
    me = world.rank
    cross = [r for r in range(len(hosts)) if local_of[r] == local_of[me]]
    return {"local_rank": local_of[me], "local_size": hosts.count(hosts[me]),
            "cross_rank": cross.index(me), "cross_size": len(cross),
            "homogeneous": len({hosts.count(h) for h in hosts}) == 1}


def shutdown() -> None:
    """Ends this module's use of the world (Horovod's ``hvd.shutdown()``).

    Later queries raise until :func:`init` is called again; the world itself (MPI) ends with the
    process.
    """
    _state["topology"] = None


def is_initialized() -> bool:
    """Whether :func:`init` has been called, and :func:`shutdown` not since.

    Returns:
      ``True`` between :func:`init` and :func:`shutdown`.
    """
    return _state["topology"] is not None


def _topo(key: str) -> int:
    if _state["topology"] is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state["topology"][key]


def rank() -> int:
    """This process's rank in the job.

    Returns:
      An integer from 0 to ``size() - 1``.

    Raises:
      ValueError: before :func:`init` (Horovod's "Horovod has not been initialized; use hvd.init().").
    """
    _topo("local_rank")
    return runtime.rank()


def size() -> int:
    """The number of ranks in the job.

    Returns:
      The number of processes the launcher started (``-np``).

    Raises:
      ValueError: before :func:`init` (Horovod's "Horovod has not been initialized; use hvd.init().").
    """
    _topo("local_rank")
    return runtime.size()


def local_rank() -> int:
    """This rank's index among the ranks on its host, in rank order.

    Returns:
      An integer from 0 to ``local_size() - 1`` (use it to pick this rank's GPU).

    Raises:
      ValueError: before :func:`init` (Horovod's "Horovod has not been initialized; use hvd.init().").
    """
    return _topo("local_rank")


def local_size() -> int:
    """The number of ranks on this rank's host.

    Returns:
      The ranks that share this rank's host name.

    Raises:
      ValueError: before :func:`init` (Horovod's "Horovod has not been initialized; use hvd.init().").
    """
    return _topo("local_size")


def cross_rank() -> int:
    """This rank's index among the ranks with its local rank (one per host that has one).

    Returns:
      An integer from 0 to ``cross_size() - 1``, in rank order.

    Raises:
      ValueError: before :func:`init` (Horovod's "Horovod has not been initialized; use hvd.init().").
    """
    return _topo("cross_rank")


def cross_size() -> int:
    """The number of ranks with this rank's local rank.

    Returns:
      The hosts that have a rank with this local rank (the number of hosts, where each runs as many).

    Raises:
      ValueError: before :func:`init` (Horovod's "Horovod has not been initialized; use hvd.init().").
    """
    return _topo("cross_size")


def _comm():
    _topo("local_rank")
    return runtime.communicator()


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise ValueError(f"process_set={process_set!r} is not supported by tfsparse.horovod: there are no process "
                         f"sets (accepted: hvd.global_process_set)")


def _resolve_op(op, average) -> int:
    """Horovod's rules: ``average`` (deprecated) or ``op``, not both; neither: Average."""
    if op is not None and average is not None:
        raise ValueError(f"op={op!r} and average={average!r}: give one of them (op, average is deprecated)")
    if op is None:
        return Average if average is None or average else Sum
    if op in _NOT_PROVIDED_OPS:
        raise ValueError(f"op=hvd.{_NOT_PROVIDED_OPS[op]} is not supported by tfsparse.horovod; accepted: "
                         f"{', '.join('hvd.' + n for n in _OPS.values())}")
    return _checks.choice("op", op, tuple(_OPS),
                          accepted=", ".join("hvd." + n for n in _OPS.values()))


# -- ordering and the numpy side ----------------------------------------------
_last_collective: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ordered(fn, inputs, dtypes):
    """``tf.numpy_function(fn, inputs, dtypes)``; inside a ``tf.function``, after the collective
    made before it in the same graph (control dependency), so that every rank runs a function's
    collectives in the order they were written, whatever order TensorFlow schedules them in."""
    if tf.executing_eagerly():
        return tf.numpy_function(fn, inputs, dtypes, stateful=True)
    graph = tf.compat.v1.get_default_graph()
    before = _last_collective.get(graph)
    with tf.control_dependencies([] if before is None else [before]):
        out = tf.numpy_function(fn, inputs, dtypes, stateful=True)
    _last_collective[graph] = out[0] if isinstance(out, (list, tuple)) else out
    return out


def _check_same(what: str, x: np.ndarray, shape: bool = True) -> None:
    """Collective: the same ValueError on every rank when the ranks' tensors differ in dtype (or
    in shape, with ``shape``), as Horovod's "Mismatched ..." errors, before a collective that
    would mix them up (MPI would truncate, read past the end, or wait forever)."""
    comm = runtime.communicator()
    if comm.size == 1:
        return
    mine = np.frombuffer((x.dtype.name + (f" {list(x.shape)}" if shape else "")).encode(), np.uint8)
    theirs = [bytes(np.asarray(p, np.uint8)).decode() for p in comm.allgather(mine)]
    if len(set(theirs)) > 1:
        raise ValueError(f"{what}: every rank's tensor must have the same {'shape and dtype' if shape else 'dtype'}; "
                         "got " + ", ".join(f"rank {q}: {t}" for q, t in enumerate(theirs)))


def _np_allreduce(x: np.ndarray, op: int, prescale: float, postscale: float) -> np.ndarray:
    comm = runtime.communicator()
    x = np.asarray(x)
    _check_same("allreduce", x)
    dtype = x.dtype
    # float16 is summed in float32 (MPI has no float16 type) and rounded once
    work = x.astype(np.float32) if dtype == np.float16 else x
    if prescale != 1.0:
        work = np.asarray(work * prescale).astype(work.dtype)
    out = comm.allreduce(work, {Sum: "sum", Average: "sum", Min: "min", Max: "max"}[op])
    if op == Average:  # the sum divided by the ranks (integers: truncated, as Horovod's)
        out = out / comm.size if out.dtype.kind == "f" else np.trunc(out / comm.size)
    if postscale != 1.0:
        out = out * postscale
    return np.asarray(out).astype(dtype)


def _reduce(tensor, op: int, prescale: float, postscale: float):
    @tf.custom_gradient
    def reduce(x):
        y = _ordered(lambda a: _np_allreduce(a, op, prescale, postscale), [x], x.dtype)
        y.set_shape(x.shape)

        def grad(dy):  # Horovod's: the gradient reduced as the value was
            return _reduce(tf.convert_to_tensor(dy), op, prescale, postscale)
        return y, grad
    return reduce(tensor)


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """The element-wise reduction of ``tensor`` over the ranks (Horovod's ``hvd.allreduce``).

    Every rank gets the same result, bit for bit. A ``tf.IndexedSlices`` (an Embedding's
    gradient) is gathered instead -- the values and indices of every rank, the values divided by
    the ranks for Average -- as Horovod does. Its gradient is the allreduce of the gradient.

    Args:
      tensor: a tensor (or a ``tf.IndexedSlices``) of the same shape and dtype on every rank.
      average: deprecated, as in Horovod: ``True`` for ``op=hvd.Average``, ``False`` for ``hvd.Sum``;
        give ``op`` or ``average``, not both.
      device_dense: accepted and ignored (the collectives run on the host).
      device_sparse: accepted and ignored.
      compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16`` (a float tensor
        travels as float16; the sum is formed in float32 and rounded once).
      op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min`` or ``hvd.Max``.
      prescale_factor: multiplies each rank's tensor before the reduction.
      postscale_factor: multiplies the result after it.
      name: accepted and ignored (Horovod's op name).
      process_set: only ``hvd.global_process_set``.
      ignore_name_scope: accepted and ignored.

    Returns:
      A tensor of ``tensor``'s shape and dtype (a ``tf.IndexedSlices`` for one).

    Raises:
      ValueError: an op not provided (Adasum, Product), ``op`` and ``average`` both given, or
        a ``tf.IndexedSlices`` with Min, Max or a scale factor; before :func:`init`; ranks whose
        tensors differ in shape or dtype (on every rank, naming every rank's; inside a
        ``tf.function`` TensorFlow raises it as a ``tf.errors.InvalidArgumentError``).
    """
    op = _resolve_op(op, average)
    _check_process_set(process_set)
    _comm()
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Sum, Average):
            raise ValueError(f"op=hvd.{_OPS[op]} with a tf.IndexedSlices: only hvd.Sum and hvd.Average are supported "
                             f"(as in Horovod); pass a dense tensor (tf.convert_to_tensor) for the others")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise ValueError("prescale_factor/postscale_factor are not supported with a tf.IndexedSlices "
                             "(as in Horovod)")
        values = allgather(tensor.values)
        if op == Average:
            values = values / tf.cast(size(), values.dtype)
        return tf.IndexedSlices(values, allgather(tensor.indices), dense_shape=tensor.dense_shape)
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(_reduce(compressed, op, float(prescale_factor), float(postscale_factor)), ctx)


def _np_allgather(x: np.ndarray):
    comm = runtime.communicator()
    x = np.asarray(x)
    _check_same("allgather", x, shape=False)  # its first dimension may differ
    shapes = comm.allgather(np.array(x.shape, np.int64))
    rest = [tuple(int(d) for d in s[1:]) for s in shapes]
    if len({len(s) for s in shapes}) != 1 or len(set(rest)) != 1:
        raise ValueError(f"allgather: every rank's tensor must have the same rank and the same dimensions after "
                         f"the first; got shapes {[tuple(int(d) for d in s) for s in shapes]}")
    parts = comm.allgather(np.ascontiguousarray(x).reshape(-1))
    return np.concatenate([p.reshape((-1,) + rest[0]) for p in parts]).astype(x.dtype, copy=False)


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order.

    Its gradient is the average over the ranks of the gradient, this rank's rows of it (Horovod's).

    Args:
      tensor: a tensor of rank >= 1; the first dimension may differ between ranks, the others may not.
      name: accepted and ignored (Horovod's op name).
      ignore_name_scope: accepted and ignored.
      process_set: only ``hvd.global_process_set``.

    Returns:
      A tensor whose first dimension is the sum of the ranks' first dimensions.

    Raises:
      ValueError: a scalar; before :func:`init`; ranks whose tensors differ in rank or in the
        dimensions after the first (on every rank, naming every rank's shape; inside a
        ``tf.function`` TensorFlow raises it as a ``tf.errors.InvalidArgumentError``).
    """
    _check_process_set(process_set)
    _comm()
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor of rank >= 1 (it concatenates along the first dimension); "
                         "got a scalar: reshape it to [1]")
    return _gather(tensor)


def _gather(tensor):
    @tf.custom_gradient
    def gather(x):
        y = _ordered(_np_allgather, [x], x.dtype)
        y.set_shape([None] + x.shape.as_list()[1:])

        def grad(dy):  # Horovod's: the average over ranks of the gradient, this rank's rows of it
            dy = _reduce(tf.convert_to_tensor(dy), Average, 1.0, 1.0)
            counts = _gather(tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1]))
            start = tf.reduce_sum(counts[:rank()])
            return dy[start:start + tf.shape(x, out_type=tf.int64)[0]]
        return y, grad
    return gather(tensor)


def _np_broadcast(x: np.ndarray, root: int) -> np.ndarray:
    comm = runtime.communicator()
    x = np.asarray(x)
    _check_same("broadcast", x)
    return np.asarray(comm.bcast(x if comm.rank == root else None, root=root, shape=x.shape, dtype=x.dtype))


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """``root_rank``'s ``tensor`` on every rank (Horovod's ``hvd.broadcast``).

    Its gradient is the average of the gradient on the root rank, zero elsewhere (Horovod's).

    Args:
      tensor: a tensor of the same shape and dtype on every rank.
      root_rank: the rank whose value everyone gets, from 0 to ``size() - 1``.
      name: accepted and ignored (Horovod's op name).
      ignore_name_scope: accepted and ignored.
      process_set: only ``hvd.global_process_set``.

    Returns:
      ``root_rank``'s tensor.

    Raises:
      ValueError: ``root_rank`` not a rank of the job; before :func:`init`; ranks whose tensors
        differ in shape or dtype (on every rank, naming every rank's; inside a ``tf.function``
        TensorFlow raises it as a ``tf.errors.InvalidArgumentError``).
    """
    _check_process_set(process_set)
    root = _check_root(root_rank)
    return _broadcast(tf.convert_to_tensor(tensor), root)


def _check_root(root_rank) -> int:
    n = _comm().size
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < n:
        raise ValueError(f"root_rank={root_rank!r} is not valid; accepted: an integer from 0 to {n - 1}")
    return int(root_rank)


def _broadcast(tensor, root: int):
    @tf.custom_gradient
    def bcast(x):
        y = _ordered(lambda a: _np_broadcast(a, root), [x], x.dtype)
        y.set_shape(x.shape)

        def grad(dy):  # Horovod's: the average of the gradient on the root, zero elsewhere
            reduced = _reduce(tf.convert_to_tensor(dy), Average, 1.0, 1.0)
            return reduced if rank() == root else reduced * 0
        return y, grad
    return bcast(tensor)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assigns ``root_rank``'s values to ``variables`` on every rank (Horovod's ``hvd.broadcast_variables``).

    Eagerly, one broadcast per dtype; inside a ``tf.function``, one per variable, grouped.

    Args:
      variables: Keras or TensorFlow variables: a model's ``variables``, an optimizer's ``variables``.
      root_rank: the rank whose values everyone takes, from 0 to ``size() - 1``.
      process_set: only ``hvd.global_process_set``.
      inplace: accepted and ignored (the variables are always assigned in place).

    Returns:
      None eagerly; inside a ``tf.function``, the group of assignments (an op to run).

    Raises:
      ValueError: ``root_rank`` not a rank of the job; before :func:`init`; ranks whose variables
        differ in shape or dtype (on every rank: eagerly a ``tfsparse.ConfigurationMismatch``,
        inside a ``tf.function`` TensorFlow's ``tf.errors.InvalidArgumentError``).
    """
    _check_process_set(process_set)
    root = _check_root(root_rank)
    variables = list(variables)
    if tf.executing_eagerly():
        from ...keras.sync import broadcast_variables as fused

        fused(variables, root_rank=root, communicator=_comm())
        return None
    return tf.group(*[v.assign(_broadcast(tf.convert_to_tensor(v), root)) for v in variables])


def _reduce_gradients(grads, op: int, compression, sparse_as_dense: bool, predivide: float):
    """Horovod's reduction of a list of gradients: the dense ones of each dtype concatenated into
    one allreduce (as Horovod's tensor fusion does), ``tf.IndexedSlices`` gathered (or made dense,
    ``sparse_as_dense``), None left None.  ``predivide``: Horovod's ``gradient_predivide_factor``
    (Average only: each rank's gradient divided by it before the sum, the sum multiplied by it
    over the ranks after)."""
    if predivide != 1.0 and op != Average:
        raise ValueError(f"gradient_predivide_factor={predivide!r} needs op=hvd.Average (as in Horovod)")
    out = list(grads)
    groups: dict = {}
    for i, g in enumerate(out):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if not sparse_as_dense:
                out[i] = allreduce(g, op=op, compression=compression)
                continue
            g = out[i] = tf.convert_to_tensor(g)
        groups.setdefault(g.dtype, []).append(i)
    for dtype, idx in groups.items():
        flat = tf.concat([tf.reshape(out[i], [-1]) for i in idx], axis=0)
        if op == Average and predivide != 1.0:
            flat = allreduce(flat, op=Sum, compression=compression, prescale_factor=1.0 / predivide,
                             postscale_factor=predivide / size())
        else:
            flat = allreduce(flat, op=op, compression=compression)
        sizes = [tf.size(out[i]) for i in idx]
        for i, part in zip(idx, tf.split(flat, sizes)):
            out[i] = tf.reshape(part, tf.shape(out[i]))
    return out


class _DistributedGradientTape:
    """What :func:`DistributedGradientTape` returns: the user's tape, whose :meth:`gradient`
    reduces the gradients over the ranks; every other attribute is the tape's own."""

    def __init__(self, tape, op, compression, sparse_as_dense, predivide, scale_local_gradients):
        self._tape = tape
        self._reduce = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense, predivide=predivide)
        self._local: dict = {}  # id -> source (Keras 3 variables have no .ref(): Horovod's failure, issue 4290)
        self.scale_local_gradients = scale_local_gradients

    def register_local_source(self, source):
        """``source``'s gradient stays this rank's own (not reduced; divided by the ranks when
        ``scale_local_gradients``, as Horovod does)."""
        self._local[id(source)] = source

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        nested = tf.nest.flatten(sources)
        grads = self._tape.gradient(target, nested, output_gradients=output_gradients)
        shared = [i for i, s in enumerate(nested) if id(s) not in self._local]
        reduced = _reduce_gradients([grads[i] for i in shared], **self._reduce)
        for i, g in zip(shared, reduced):
            grads[i] = g
        if self.scale_local_gradients:
            for i, s in enumerate(nested):
                if id(s) in self._local and grads[i] is not None:
                    grads[i] = on_values(grads[i], lambda v: v / size())
        return tf.nest.pack_sequence_as(sources, grads)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """``gradtape`` whose ``gradient()`` returns the gradients reduced over the ranks (Horovod's).

    Lossless and the same on every rank, as Horovod's: the dense gradients of one dtype travel as
    one allreduce; an Embedding's ``tf.IndexedSlices`` is gathered (or reduced as a dense tensor with
    ``sparse_as_dense``). ``register_local_source(variable)`` on the returned tape keeps a variable's
    gradient this rank's own.

    Args:
      gradtape: a ``tf.GradientTape``.
      device_dense: accepted and ignored (the collectives run on the host).
      device_sparse: accepted and ignored.
      compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``.
      sparse_as_dense: reduce ``tf.IndexedSlices`` as dense tensors instead of gathering them.
      op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min`` or ``hvd.Max``.
      gradient_predivide_factor: Average only: each rank's gradient divided by it before the sum,
        the sum multiplied by it over the ranks after.
      num_groups: Horovod's fusion groups; only the default (0).
      groups: Horovod's fusion groups; only the default (None).
      process_set: only ``hvd.global_process_set``.
      scale_local_gradients: divide the gradients of registered local sources by the ranks.

    Returns:
      A tape that behaves as ``gradtape`` (``with`` it, ``watch``, ...) with the reducing ``gradient()``.

    Raises:
      ValueError: ``gradtape`` not a ``tf.GradientTape``, fusion groups, an op not provided; before
        :func:`init`.
    """
    _check_process_set(process_set)
    op = _resolve_op(op, None)
    if num_groups not in (0, None) or groups is not None:
        raise ValueError(f"num_groups={num_groups!r}, groups={groups!r}: tfsparse.horovod fuses the gradients of "
                         f"one dtype into one allreduce; accepted: num_groups=0, groups=None")
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError(f"gradtape={gradtape!r} is not valid; accepted: a tf.GradientTape")
    _comm()
    return _DistributedGradientTape(gradtape, op, compression, bool(sparse_as_dense),
                                    float(gradient_predivide_factor), bool(scale_local_gradients))


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True, **tfsparse_settings):
    """Horovod's ``hvd.DistributedOptimizer`` for a Keras 3 optimizer.

    The same as :func:`tfsparse.horovod.tensorflow.keras.DistributedOptimizer`, which documents
    the arguments; TensorFlow 1's ``tf.compat.v1.train.Optimizer`` is not supported.

    Args:
      optimizer: a ``keras.optimizers.Optimizer``.
      name: the wrapper's name.
      use_locking: accepted and ignored.
      device_dense: accepted and ignored.
      device_sparse: accepted and ignored.
      compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``.
      sparse_as_dense: accepted and ignored (an Embedding's gradient always travels dense).
      backward_passes_per_step: steps whose gradients are accumulated locally per exchange.
      op: ``hvd.Average`` (default) or ``hvd.Sum``.
      gradient_predivide_factor: see the Keras function.
      average_aggregated_gradients: divide the accumulated gradients by ``backward_passes_per_step``.
      num_groups: only the default (0).
      groups: only the default (None).
      process_set: only ``hvd.global_process_set``.
      scale_local_gradients: only ``True``.
      **tfsparse_settings: any keyword of :class:`tfsparse.keras.DistributedOptimizer`.

    Returns:
      A :class:`tfsparse.horovod.tensorflow.keras.HorovodOptimizer` wrapping ``optimizer``.
    """
    from .keras import DistributedOptimizer as keras_distributed_optimizer

    return keras_distributed_optimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups, groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
        **tfsparse_settings)


from .basics import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous,  # noqa: E402
                     mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from .basics import NAMES as _BASICS  # noqa: E402
from .functions import allgather_object, broadcast_object  # noqa: E402
from .functions import NAMES as _FUNCTIONS  # noqa: E402

_PROVIDED = ("init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
             "cross_size", "allreduce", "allgather", "broadcast", "broadcast_variables", *_FUNCTIONS,
             "DistributedGradientTape", "DistributedOptimizer",
             "Compression",
             "Average", "Sum", "Min", "Max", "global_process_set", *_BASICS)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"tfsparse.horovod.tensorflow does not provide horovod.tensorflow.{name}; provided: "
                         f"{', '.join(_PROVIDED)}")
