"""One timing model: every aggregator's own schedule, looked up by name and priced under α-β-γ.

Each aggregator declares the messages of one exchange step next to its code
(:meth:`tfsparse.aggregators.Aggregator.schedule`, and :meth:`~tfsparse.aggregators.Aggregator.period`
for the steps that differ); :mod:`tfsparse.collectives.simulate` is the machinery that records
and prices them (rounds, collectives' variants, token bucket, shared cores: its docstring has
the model).  This module builds the aggregator from the registry with the options given -- so
its own defaults and validation apply -- has it declare its schedule and prices it:
:func:`schedule`, :func:`period`, :func:`simulate`.  DRAGONN's cost model
(:mod:`tfsparse.selection`) prices the same declared schedules; ``tools/simulate_network.py``
and ``tools/validate_network_model.py`` run this one.

>>> from tfsparse.collectives import AlphaBeta
>>> from tfsparse.timing import simulate
>>> r = simulate("gtopk", 32, 25_200_000, 0.001, AlphaBeta.from_strings("1gbit", "50us"))
>>> r.seconds, r.bytes          # 0.0169 s, 1,008,040 bytes (rank 0's broadcasts)
"""
from __future__ import annotations

from . import _checks
from .aggregators import Aggregator, available_aggregators, get_aggregator
from .collectives.alphabeta import AlphaBeta
from .collectives.simulate import VALUE_BYTES, Builder, Schedule, SimResult, check_model, price
from .schedules import k_from_density

#: the aggregator registry's algorithms (each declares its schedule)
ALGORITHMS = available_aggregators()


def declared(aggregator: Aggregator, workers: int, n: int, density: float, step: int = 1,
             value_bytes: int = VALUE_BYTES) -> Schedule:
    """The schedule ``aggregator`` declares for one exchange step.

    Args:
      aggregator: an :class:`~tfsparse.aggregators.Aggregator`.
      workers: the ranks.
      n: the bucket's elements.
      density: the fraction sent (``k`` by :func:`~tfsparse.schedules.k_from_density`, as the exchange).
      step: the step, counted from 1.
      value_bytes: bytes per value on the wire.

    Returns:
      A :class:`~tfsparse.collectives.simulate.Schedule`.
    """
    b = Builder(workers, value_bytes)
    k = k_from_density(n, density)
    aggregator.schedule(b, n, k, step)
    return b.finish(aggregator.name, n, density, k, step)


def _case(algorithm, workers, n, density, options) -> tuple:
    aggregator = get_aggregator(algorithm, **options)  # the algorithm's own options and checks
    workers = _checks.integer("workers", workers, 1)
    n = _checks.integer("n", n, 1)
    density = _checks.real("density", density, 0.0, 1.0, lo_open=True)
    return aggregator, workers, n, density


def schedule(algorithm: str, workers: int, n: int, density: float, *, step: int = 1, **options) -> Schedule:
    """The messages of one exchange step of ``algorithm`` for a bucket of ``n`` float32 elements.

    Args:
      algorithm: one of :data:`ALGORITHMS`.
      workers: the ranks (>= 1).
      n: the bucket's elements (>= 1).
      density: in (0, 1].
      step: the step, counted from 1.
      **options: the aggregator's (``tfsparse.aggregators.get_aggregator(algorithm, **options)``:
        ``tau``, ``tau_prime`` for Ok-Topk, ``chunk_size``, ``chunk_selection`` for CSC,
        ``sample_ratio``, ``min_samples`` for DGC; those that do not change the expected schedule
        change nothing).

    Returns:
      A :class:`~tfsparse.collectives.simulate.Schedule`.

    Raises:
      ValueError: naming the argument and the accepted values on bad input.
    """
    aggregator, workers, n, density = _case(algorithm, workers, n, density, options)
    return declared(aggregator, workers, n, density, _checks.integer("step", step, 1))


def period(algorithm: str, **options) -> tuple:
    """The distinct steps of the algorithm's steady period and the fraction of steps like each.

    Ok-Topk: one period of ``lcm(tau, tau_prime)`` steps (step 1 repartitions and re-evaluates,
    ``1 + tau_prime·j`` re-evaluate, the rest reuse); CSC with ``chunk_selection="previous"``:
    step 2 (the first step alone differs); others: step 1.

    Args:
      algorithm: one of :data:`ALGORITHMS`.
      **options: the aggregator's options.

    Returns:
      ``((step, weight), ...)`` (the aggregator's ``period()``).
    """
    return get_aggregator(algorithm, **options).period()


def simulate(algorithm: str, workers: int, n: int, density: float, ab: AlphaBeta, gamma: float = 0.0, *,
             step: int | None = None, cores: int | None = None, value_bytes: int = VALUE_BYTES,
             **options) -> SimResult:
    """Predicted time and bytes of one exchange step under the α-β-γ model.

    Args:
      algorithm: one of :data:`ALGORITHMS` (the aggregator registry's names).
      workers: P (>= 1).
      n: elements of the (one, fused) bucket.
      density: in (0, 1].
      ab: the link (:class:`~tfsparse.collectives.AlphaBeta`; its ``burst``, a token bucket's
        depth, lets the first bytes after an idle moment through at once).
      gamma: seconds per element of local work inside the exchange (>= 0; default 0, the pure
        α-β model).
      cores: the cores all ``workers`` ranks share on one node (>= 1); None (default): every
        rank has cores of its own.  Local work that more ranks than cores do at once is slowed
        by ``busy / cores``.
      step: the step to price (from 1); None: the mean over the algorithm's :func:`period`.
      value_bytes: bytes per value on the wire (default 4, float32; 2 for the 16-bit wires, 0.5 for int4).
      **options: the aggregator's options (see :func:`schedule`).

    Returns:
      A :class:`~tfsparse.collectives.simulate.SimResult` (``seconds``, ``bytes`` -- max bytes
      sent by one rank --, ``rounds``).  One rank (``workers=1``) communicates nothing: 0
      seconds, 0 bytes.

    Raises:
      ValueError: naming the argument and the accepted values on bad input.
    """
    ab, gamma, cores = check_model(ab, gamma, cores)
    aggregator, workers, n, density = _case(algorithm, workers, n, density, options)
    steps = ((_checks.integer("step", step, 1), 1.0),) if step is not None else aggregator.period()
    value_bytes = _checks.real("value_bytes", value_bytes, 0.5)
    return price([(declared(aggregator, workers, n, density, t, value_bytes), weight) for t, weight in steps],
                 ab, gamma, cores)


#: a host's shared memory as a link (the two-level exchange's inside part): what Open MPI's
#: shared-memory transport moves between two ranks of one host -- about 1 µs and a few GB/s of
#: copies; give the measured one (``tools/bench_two_level.py`` reports it) where it matters
SHARED_MEMORY = AlphaBeta(alpha=1e-6, beta=4e9)


def shared_link(ab: AlphaBeta, per_host: int) -> AlphaBeta:
    """The link each of a host's ranks sees in the flat exchange.

    Every rank of a host sends across the network in the same rounds, so the host's bandwidth
    (and burst) is divided among them; the latency stays.

    Args:
      ab: the host's link.
      per_host: the ranks of the host.

    Returns:
      An :class:`~tfsparse.collectives.AlphaBeta`.
    """
    return AlphaBeta(alpha=ab.alpha, beta=ab.beta / per_host, burst=ab.burst / per_host)


def simulate_two_level(algorithm: str, hosts: int, per_host: int, n: int, density: float, ab: AlphaBeta,
                       gamma: float = 0.0, *, local: AlphaBeta = SHARED_MEMORY, add_s: float | None = None,
                       level_s: float | None = None, step: int | None = None, value_bytes: int = VALUE_BYTES,
                       **options) -> dict:
    """Predicted time of one step of the two-level exchange (``hierarchical=True``), and of the flat one on the same ranks.

    * Two-level: the host's sum up a binomial tree (``ceil(log2 per_host)`` levels, each a float32
      vector of ``n`` over ``local`` and its addition: ``gamma`` per element), then the algorithm
      among the ``hosts`` leaders over ``ab`` (:func:`simulate`), then the leader's broadcast of
      the result inside the host (a binomial tree over ``local``): the float32 vector for a dense
      algorithm, a sparse one's indices and values (at most ``hosts · k`` pairs of 4-byte values
      and 8-byte indices, :mod:`tfsparse.hierarchy`).
    * Flat: the algorithm among all ``hosts · per_host`` ranks, whose ``per_host`` ranks share
      their host's link (:func:`shared_link`) -- one host: shared memory alone (``local``).

    Both are the α-β(-γ) model of :mod:`tfsparse.collectives.simulate`; the network part of the
    two-level step is exactly :func:`simulate` over the hosts.

    Args:
      algorithm: one of :data:`ALGORITHMS`.
      hosts: the hosts (>= 1).
      per_host: the ranks of each host (>= 1).
      n: the bucket's elements.
      density: in (0, 1].
      ab: the link between hosts.
      gamma: seconds per element of local work.
      local: the link inside a host (default :data:`SHARED_MEMORY`).
      add_s: measured seconds to receive and add one rank's vector inside the host, instead of
        ``local``'s model (``tools/bench_two_level.py`` measures it); None: modelled.
      level_s: measured seconds per level of the host's broadcast; None: modelled.
      step: the step to price (from 1); None: the mean over the period.
      value_bytes: bytes per value on the wire.
      **options: the aggregator's options.

    Returns:
      ``{"two_level_s", "flat_s", "phases_s", "cross_bytes", "flat_bytes"}``.
    """
    hosts = _checks.integer("hosts", hosts, 1)
    per_host = _checks.integer("per_host", per_host, 1)
    n = _checks.integer("n", n, 1)
    check_model(local, gamma, None)
    cross = simulate(algorithm, hosts, n, density, ab, gamma, step=step, value_bytes=value_bytes, **options)
    vector = 4 * n
    levels = (per_host - 1).bit_length()  # the binomial tree's, up and down
    gather = levels * (local.time(vector) + gamma * n if add_s is None else float(add_s))
    shared = vector if algorithm == "dense" else min(vector, hosts * k_from_density(n, density) * 12)
    share = levels * (local.time(shared) if level_s is None else float(level_s))
    link = local if hosts == 1 else shared_link(ab, per_host)
    flat = simulate(algorithm, hosts * per_host, n, density, link, gamma, step=step, value_bytes=value_bytes,
                    **options)
    return {"two_level_s": gather + cross.seconds + share, "flat_s": flat.seconds,
            "phases_s": {"host sum": gather, "across hosts": cross.seconds, "host broadcast": share},
            "cross_bytes": cross.bytes, "flat_bytes": flat.bytes}
