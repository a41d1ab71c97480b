"""One bucket of an exchange at run time: the stages a round runs on it, each a part with
explicit state.

    compensate (memory) -> select and encode (aggregator: compressor + wire)       caller's thread
        -> exchange (aggregator over the communicator)                    communication thread
        -> decode -> update (memory)                        the thread that finishes the round

A dense exchange over a lossy wire settles the memory earlier, on the communication thread, as
soon as the residual is whole (:meth:`Bucket.exchange`): the bucket's next round may then start
while the rest of this one travels (:meth:`Bucket.check_start`, :meth:`Bucket.wait_settled`).

* the :mod:`memory <tfsparse.memory>` owns the bucket's vectors: the buffer offered to the
  exchange (``acc``), the residual and (momentum correction) the velocity;
* the :mod:`aggregator <tfsparse.aggregators>` owns its compressor and its own state
  (thresholds, boundaries, random generators); its ``encode`` runs on the caller's thread,
  its ``exchange`` on the communication thread;
* the :mod:`wire <tfsparse.wire>` says how values travel (stateless).

:class:`ExchangeStats` holds the counters every bucket's rounds add to.
"""
from __future__ import annotations

import copy
import threading
import time
import warnings

import numpy as np

from .aggregators import get_aggregator
from .aggregators.dense import DenseAllreduce
from .compensation import compensation_for
from .memory import get_memory
from .schedules import check_density, k_from_density
from .space import HOST
from .wire import FLOAT32, check_wire_for, get_wire


class ExchangeStats:
    """Counters of one exchange; CommunicationStats reads and resets them.

    ``encode_seconds`` (caller's thread: error feedback, selection, encoding),
    ``comm_seconds`` (communication thread: the collectives), ``decode_seconds``
    (the thread that finishes the round: dense result and residual update) and ``wait_seconds``
    (that thread blocked until the communication thread delivered a result -- what the overlap
    did not hide) are summed over buckets.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        """Sets every counter to zero (:class:`~tfsparse.keras.callbacks.CommunicationStats` does at each
        epoch's start)."""
        self.steps = 0
        self.bytes_sent = 0
        self.sent_elements = 0
        self.total_elements = 0
        self.seconds = 0.0
        self.encode_seconds = 0.0
        self.comm_seconds = 0.0
        self.decode_seconds = 0.0
        self.wait_seconds = 0.0
        self.skipped_buckets = 0

    def add(self, outcome: "Outcome", elements: int, waited: float) -> None:
        """One finished bucket's round."""
        self.bytes_sent += outcome.bytes
        self.sent_elements += outcome.sent
        self.total_elements += elements
        self.comm_seconds += outcome.comm_s
        self.decode_seconds += outcome.decode_s
        self.wait_seconds += waited
        self.skipped_buckets += int(outcome.skipped)

    @property
    def bytes_per_step(self) -> float:
        """Mean bytes sent per step: ``bytes_sent / steps`` (0.0 before the first)."""
        return self.bytes_sent / self.steps if self.steps else 0.0

    @property
    def density(self) -> float:
        """The fraction of gradient elements sent: ``sent_elements / total_elements`` (0.0 before any)."""
        return self.sent_elements / self.total_elements if self.total_elements else 0.0


class Outcome:
    """A bucket's finished round: the dense result and what it cost."""

    __slots__ = ("dense", "bytes", "sent", "comm_s", "decode_s", "skipped")

    def __init__(self, dense, nbytes, sent, comm_s, decode_s, skipped=False):
        self.dense, self.bytes, self.sent, self.comm_s, self.decode_s = dense, nbytes, sent, comm_s, decode_s
        self.skipped = skipped


class Received:
    """A bucket's round off the wire, not yet decoded: the aggregator's result, the vector to
    decode it into, the bytes sent and the seconds the collectives took."""

    __slots__ = ("result", "out", "bytes", "comm_s", "settled")

    def __init__(self, result, out, nbytes, comm_s, settled=False):
        self.result, self.out, self.bytes, self.comm_s = result, out, nbytes, comm_s
        #: the memory was updated already, on the communication thread (:meth:`Bucket.exchange`)
        self.settled = settled


class Bucket:
    """A bucket of the plan at run time: its plan entry, memory, aggregator, wire, density
    (None: the exchange's) and the rounds started on it (``futures``: round index -> the
    communication job's future; ``settlements``: round index -> an event set once the round's
    memory update is done or its job has ended, and ``settled``: the rounds whose memory update
    was done early, on the communication thread)."""

    def __init__(self, spec, aggregator, wire, density, memory, outputs=None, staging=None, home=HOST):
        self.spec = spec
        #: where the memory and the result vectors live (the exchange's space, or the host for an
        #: aggregator that takes no device vector)
        self.home = home
        self.aggregator = aggregator
        self.dense = None  # the bucket's DenseAllreduce, for dense steps of a sparse algorithm
        self.wire = wire
        self.density = density
        self.memory = memory
        #: where the round results are decoded (the space's result vectors, reused when free)
        self.outputs = outputs
        self.rounds = 0
        self.futures: dict = {}
        self.settlements: dict = {}
        self.settled: set = set()
        #: the host copy of the gradients, where they live on a device and the memory does not
        self._staging = staging
        #: error feedback's pass over the bucket (:mod:`tfsparse.compensation`), chosen for its memory
        self.compensation = compensation_for(memory)

    def check_start(self, previous) -> int:
        """The index of the round about to start; RuntimeError if this bucket's last round is
        still in flight with its memory not yet updated (a round whose memory settled early,
        :meth:`wait_settled`, may still be on the wire: the communication thread runs the rounds in
        order), or the ``previous`` bucket has not started this round yet (collectives must run in
        the same order on every rank: bucket order, always)."""
        if any(index not in self.settled for index in self.futures):
            raise RuntimeError(f"bucket {self.spec.index} of the exchange was started again before its round "
                               f"{min(self.futures)} finished; wait() for a round before starting the next")
        if previous is not None and previous.rounds != self.rounds + 1:
            raise RuntimeError(f"bucket {self.spec.index} was started before bucket {previous.spec.index} of the "
                               f"same round; buckets start in bucket order")
        return self.rounds

    def aggregator_at(self, density: float):
        """The aggregator of a round at ``density``: a dense step (density 1) of a sparse
        algorithm is a true dense allreduce."""
        if density >= 1.0 and self.aggregator.uses_memory:
            if self.dense is None:
                self.dense = DenseAllreduce()
            return self.dense
        return self.aggregator

    def encode(self, comm, space, arrays, density: float, dsync: bool) -> tuple:
        """The caller's-thread stages: error feedback over every tensor of the bucket with the
        finite check (:attr:`compensation`, the pass chosen when the bucket was made:
        :mod:`tfsparse.compensation`), then the aggregator's selection and encoding of what that
        pass offers it.  Returns the communication job's arguments.

        Gradients on a device for an aggregator that takes no device vector (dense, Ok-Topk, DGC,
        Gaussian-k, CSC: :func:`make_bucket` keeps their memory on the host) are copied once into
        the bucket's page-locked host vector, and the host's passes above run on the copies."""
        if self._staging is not None:  # the gradients live on a device, the memory on the host
            arrays = space.host_copies(arrays, self._staging)
        aggregator = self.aggregator_at(density)
        size = int(self.spec.size)
        k = k_from_density(size, density) if aggregator.uses_memory else size
        wire = FLOAT32 if dsync else self.wire
        acc, offer, finite = self.compensation.run(comm, arrays, aggregator, k, wire)
        return aggregator, aggregator.encode(comm, acc, k, wire, offer), finite

    def exchange(self, comm, space, aggregator, payload, index: int) -> "Received":
        """The communication thread's stage: the collectives (into a result vector of
        :attr:`outputs` where the aggregator writes its dense result as it receives).  An
        aggregator that has the whole residual early says so (``settled``,
        :meth:`Aggregator.exchange <tfsparse.aggregators.Aggregator.exchange>`); the memory is
        then updated here (:meth:`ResidualMemory.swap <tfsparse.memory.ResidualMemory.swap>`) and
        round ``index`` marked :attr:`settled`, so that the bucket's next round may start while
        the rest of this one travels."""
        t0 = time.perf_counter()
        before = comm.bytes_sent
        out = self.outputs.take() if self.outputs is not None else None

        def settle():
            self.memory.swap()
            self.settled.add(index)
            self.settlements[index].set()
        result = aggregator.exchange(comm, payload, out, settle)
        return Received(result, out, comm.bytes_sent - before, time.perf_counter() - t0,
                        settled=index in self.settled)

    def expect_settlement(self, index: int) -> None:
        """Before round ``index``'s job is queued: its settlement event (:meth:`wait_settled`)."""
        self.settlements[index] = threading.Event()

    def wait_settled(self, index: int) -> bool:
        """Waits until round ``index``'s memory is updated or its job has ended; True where the
        memory settled early (the next round may start now: :meth:`check_start`), False where the
        round must be finished first."""
        event = self.settlements.get(index)
        if event is None:
            return False
        event.wait()
        return index in self.settled

    def forget(self, index: int) -> None:
        """Round ``index`` is finished: its settlement is dropped."""
        self.settlements.pop(index, None)
        self.settled.discard(index)

    def complete(self, space, received) -> Outcome:
        """The stages after the wire, on the thread that finishes the round (so that while one
        bucket is decoded the communication thread has the next one on the wire): the dense
        result, then the memory's update.  A round that was skipped is complete already."""
        if isinstance(received, Outcome):
            return received
        t0 = time.perf_counter()
        result = received.result
        dense = space.decode(result, self.spec.size, received.out)
        if not received.settled:
            self.memory.update(result)
        return Outcome(dense, received.bytes, result.sent_elements, received.comm_s, time.perf_counter() - t0)

    def communicate(self, comm, space, aggregator, payload, finite: bool, index: int, nonfinite_result: str):
        """The communication thread's job for round ``index``: the finite flags of every rank, then
        :meth:`exchange` (its :class:`Received`, for :meth:`complete`) -- or, when some rank's input is not finite, :meth:`skip` on every rank:
        no rank exchanges it, every residual stays as it was before the round (it never takes
        NaN/Inf), and every rank gets the same result -- zeros (``nonfinite_result="zeros"``, with
        a warning), or NaN (``"nan"``: a loss-scaling optimizer decides on the step, so that every
        rank skips it and lowers its loss scale)."""
        t0 = time.perf_counter()
        bad = nonfinite_ranks(comm, finite)
        if not bad:
            return self.exchange(comm, space, aggregator, payload, index)
        if nonfinite_result == "zeros":
            warnings.warn(f"tfsparse: the gradient of round {index} is not finite (NaN/Inf) on rank(s) {bad}; "
                          f"bucket {self.spec.index} is skipped on every rank (a zero gradient), residuals unchanged",
                          RuntimeWarning, stacklevel=2)
        return self.skip(space, np.nan if nonfinite_result == "nan" else 0.0, time.perf_counter() - t0)

    def skip(self, space, fill: float, seconds: float) -> Outcome:
        """A round dropped on every rank (a non-finite input somewhere): the memory keeps no NaN/Inf,
        the result is ``fill`` everywhere."""
        self.memory.drop_nonfinite()
        return Outcome(space.full(self.spec.size, fill), 0, 0, seconds, 0.0, skipped=True)

    # -- explicit state ---------------------------------------------------
    def aggregator_state(self) -> dict:
        """The aggregator's state, under ``bucket<i>.<key>`` (the memory's state is placed over the
        whole layout by the exchange)."""
        return {f"bucket{self.spec.index}.{key}": np.asarray(value).copy()
                for key, value in self.aggregator.get_state().items()}

    def set_state(self, state: dict) -> None:
        """Restores from a state over the whole layout: this bucket's slice of the memory's keys,
        and its ``bucket<i>.`` keys."""
        lo, hi = self.spec.start, self.spec.stop
        self.memory.set_state({key: state[key].reshape(-1)[lo:hi] for key in self.memory.get_state() if key in state})
        prefix = f"bucket{self.spec.index}."
        self.aggregator.set_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


def nonfinite_ranks(comm, finite: bool) -> list[int]:
    """The ranks whose input to a bucket (gradient + residual) is not finite: the flag travels
    first in every bucket's job (one allgather of an int32 per rank, on the communication thread,
    so all ranks decide together; counted by the communicator, not in the exchange's
    ``bytes_sent``)."""
    if comm.size == 1:
        return [] if finite else [0]
    flags = comm.allgather(np.array([0 if finite else 1], np.int32))
    return [r for r, f in enumerate(flags) if f[0]]


def make_bucket(spec, settings, space, replaces: Bucket | None = None, layout=None) -> Bucket:
    """A plan entry's stages: its aggregator (the settings' algorithm and options, or the plan's
    for this bucket), its wire and its memory (vectors allocated in ``space``).  ``replaces``:
    the bucket of the same entry this one takes over from, between rounds -- its memory is kept
    where it is the kind these settings use (:func:`~tfsparse.memory.get_memory`'s ``reuse``),
    and its result and staging vectors where they live in the same space.  ``layout``: the
    gradients' :class:`~tfsparse.plan.Layout`, whose row-sparse tensors the memory is told of."""
    algorithm = spec.algorithm or settings.algorithm
    options = copy.deepcopy({**(settings.options if algorithm == settings.algorithm else {}), **spec.options})
    density = None if spec.density is None else check_density(spec.density, f"density of bucket {spec.index}")
    aggregator, wire = get_aggregator(algorithm, **options), get_wire(spec.wire_dtype or settings.wire_dtype)
    check_wire_for(algorithm, wire)
    # error feedback where the aggregator takes its vector: an aggregator that takes no device
    # vector is handed the bucket on the host anyway, so there the gradients cross to the host
    # once and the host's fused passes run (Bucket.encode)
    home = space if aggregator.accepts_device or not space.on_device else HOST
    before = replaces if replaces is not None and replaces.home is home else None
    rows = () if layout is None else [  # the row-sparse tensors' elements in this bucket, from its start
        (max(0, int(layout.offsets[i]) - spec.start), min(spec.size, int(layout.offsets[i + 1]) - spec.start))
        for i in range(spec.first, spec.last) if layout.specs[i].rows]
    memory = get_memory(settings.memory, spec.size, settings.memory_options, aggregator.uses_memory or wire.lossy,
                        home, reuse=None if before is None else before.memory, rows=rows)
    staging = None if home is space else (before._staging if before is not None and before._staging is not None
                                          else space.staging(spec.size))
    outputs = before.outputs if before is not None else home.outputs(spec.size)
    return Bucket(spec, aggregator, wire, density, memory, outputs, staging, home)


def assemble(layout, buckets, dense: dict, flat: bool, space):
    """Bucket results (``{bucket index: flat array}``) as one flat array, or one array per tensor
    of ``layout`` (shaped).  One bucket's flat result is its vector itself, not a copy."""
    if flat and len(buckets) == 1:
        return dense[buckets[0].spec.index]
    if flat:
        return space.concat([dense[b.spec.index] for b in sorted(buckets, key=lambda b: b.spec.start)])
    out = [None] * len(layout)
    for b in buckets:
        offs = layout.offsets[b.spec.first:b.spec.last + 1] - b.spec.start
        for i, (lo, hi) in enumerate(zip(offs[:-1], offs[1:]), start=b.spec.first):
            out[i] = dense[b.spec.index][lo:hi].reshape(layout.specs[i].shape)
    return out


def check_saved_layout(state: dict, layout, buckets, plan) -> None:
    """ValueError when a saved state's ``sizes`` or ``buckets`` are not this exchange's."""
    sizes = state.get("sizes")
    if sizes is not None and not np.array_equal(np.asarray(sizes, np.int64).reshape(-1), layout.sizes):
        raise ValueError(f"the saved exchange state belongs to gradients of sizes {np.asarray(sizes).tolist()}, "
                         f"this model's are {layout.sizes.tolist()}")
    saved = state.get("buckets")
    mine = [[b.spec.start, b.spec.stop] for b in buckets]
    if saved is not None and np.asarray(saved).reshape(-1, 2).tolist() != mine:
        raise ValueError(f"the saved exchange state belongs to buckets {np.asarray(saved).tolist()}, this "
                         f"exchange's plan ({plan!r}) makes {mine}; use the plan it was saved with")


def agreement(config: dict, plan, comm, layout, buckets) -> dict:
    """What every rank must share, compared at an exchange's first round (one 32-byte
    allgather): the settings, the transport, the gradient layout (shapes, dtypes and which are
    row-sparse, in order --
    not the names: Keras numbers layers per process, so a rank that built one more model has
    other names for the same layers) and the planned buckets."""
    plan = {k: v for k, v in plan.config().items() if k != "assign"}  # a function: compared by its buckets
    return {"settings": {**config, "plan": plan}, "transport": type(comm).__name__,
            "gradients": [[list(s.shape), s.dtype, s.rows] for s in layout.specs],
            "buckets": [{"elements": [b.spec.start, b.spec.stop], "algorithm": type(b.aggregator).__name__,
                         "density": b.density, "wire": b.wire.name} for b in buckets]}
