"""Process-world setup: ``tfsparse.init()``, ``rank()``, ``size()``, ``local_rank()``."""
from __future__ import annotations

import math
import os
import weakref

import numpy as np

from . import _checks
from .collectives.communicator import Communicator

_BACKENDS = ("auto", "mpi", "horovod")
_state: dict = {"comm": None, "local_rank": 0, "backend": None, "watch": None}


#: the process-wide changes :func:`init` can make, each under an argument of its own; its
#: ``"auto"`` default makes it where ``TFSPARSE_SETUP`` names it (``tfsparse-run`` sets ``all``)
SETUP = ("quiet_workers", "plain_output", "cores_per_rank", "cpu_allocator", "thread_priority")


def init(backend: str | None = None, *, abort_on_error: bool = True, quiet_workers: bool | str = "auto",
         plain_output: bool | str = "auto", cores_per_rank: int | str | None = "auto",
         cpu_allocator: str | None = "auto", thread_priority: bool | str = "auto",
         stall_warning: float | str | None = "auto", stall_timeout: float | str | None = "auto",
         stall_stacks: bool | str = "auto") -> Communicator:
    """Joins the job's process world; idempotent (later calls return the same communicator).

    By default it joins the world and changes nothing else in the process but what keeps a
    failure from hanging the job (``abort_on_error``, the watch thread).  Each other change to
    the process -- its output, warnings filters and ``sys.excepthook``, TensorFlow's and Numba's
    thread pools, an environment variable, the threads' priorities -- has an argument of its own
    (:data:`SETUP`).  Its default, ``"auto"``, makes the change where the environment variable
    ``TFSPARSE_SETUP`` names it: ``all``, ``none``, or names from :data:`SETUP` separated by
    commas.  ``tfsparse-run`` sets ``TFSPARSE_SETUP=all`` (unless it is set): launched by it, a
    rank gets them all; under ``mpirun`` or ``horovodrun`` none, unless the variable reaches
    the ranks (exported; ``mpirun -x TFSPARSE_SETUP=all``) or an argument asks.

    Args:
      backend: ``"mpi"`` (mpi4py, the default engine), ``"horovod"`` (Horovod's
        TF collectives; point-to-point still over mpi4py on the same world) or
        ``"auto"``: Horovod when the job was launched by ``horovodrun`` (and Horovod imports),
        else MPI.  ``None`` reads ``TFSPARSE_BACKEND`` (default ``auto``).  MPI is the default
        because it measured the faster one, dense and sparse (docs/keras.md, "Backends").
      abort_on_error: an exception that reaches the top of a rank (uncaught) ends *every*
        rank with ``MPI_Abort`` once Python has printed its traceback, as the process exits --
        instead of the other ranks waiting forever in a collective (a pending pipelined round
        included); and a rank whose program ends while another still waits for it in a
        collective (``fit`` returned early on one rank) makes that rank abort the job within
        10 s, naming the rank that left (:class:`~tfsparse.collectives.watchdog.DepartureWatch`;
        needs MPI_THREAD_MULTIPLE).  Registered with ``atexit``, so it runs once Python has
        joined the program's non-daemon threads; ``sys.excepthook`` is left alone
        (``quiet_workers`` chains it).  Not in an interactive or IPython session.
      quiet_workers: ``True``: on ranks other than 0, silence Keras' interactive output (progress
        bars), Python warnings (a filter) and TensorFlow's/absl's Python loggers below ERROR, so
        only rank 0 prints (TensorFlow's C++ start-up lines are governed by
        ``TF_CPP_MIN_LOG_LEVEL``, which ``tfsparse-run`` sets to 2); and, with
        ``abort_on_error``, chain ``sys.excepthook`` on every rank so that one failure prints one
        traceback: a rank whose error follows another rank's, or is an agreement's error every
        rank raises alike, prints one line naming it, and the job is aborted from the hook.
        ``"auto"`` (default): where ``TFSPARSE_SETUP`` names it.
      plain_output: ``True``: when stdout is not a terminal (a pipe, a log file, ``mpirun``'s
        forwarding), replace ``sys.stdout`` by a stream that drops the ANSI colour codes Keras'
        progress bars write anyway.  ``"auto"`` (default): where ``TFSPARSE_SETUP`` names it.
      cores_per_rank: how many threads this rank's kernels may use: ``"share"`` -- its share of
        the node's cores, ``max(1, cores // ranks_on_this_node)``, for tfsparse's Numba kernels
        (a limit they set around each launch) and, when TensorFlow is imported and not yet
        started, TensorFlow's intra-op pool (several ranks on one node otherwise oversubscribe
        the cores and every kernel slows down); an integer: that many; ``None``: leave the
        libraries' defaults.  ``"auto"`` (default): ``"share"`` where ``TFSPARSE_SETUP`` names
        ``cores_per_rank``, else the share for tfsparse's kernels alone (TensorFlow's pools are
        the process's).
      cpu_allocator: ``"bfc"`` -- TensorFlow's best-fit-with-coalescing allocator for host
        memory (``TF_CPU_ALLOCATOR_USE_BFC=true``, set in this process's environment when the
        variable is not set already; it takes effect when TensorFlow has not allocated host
        memory yet, as at the start of a program): it keeps and reuses the memory of freed
        tensors.  TensorFlow's default hands every large tensor back to the system, so each
        step's gradients and temporaries are mapped afresh and page-faulted in again, page by
        page (the measured cost: docs/getting-started.md, ``init``).  ``None``: TensorFlow's
        default.  ``"auto"`` (default): ``"bfc"`` where ``TFSPARSE_SETUP`` names
        ``cpu_allocator``, else ``None``.
      thread_priority: ``True``: a pipelined exchange's communication thread may run ahead of
        the process's other threads, which it renices
        (:meth:`~tfsparse.collectives.thread.CommThread.take_precedence`; Linux, no privilege
        needed, and the raised nice values stay), and then waits quietly (it tests its requests
        and sleeps between tests, instead of Open MPI's busy polling); off, it keeps Open MPI's
        waits at the training's priority.  ``"auto"`` (default): where
        ``TFSPARSE_SETUP`` names it.
      stall_warning: seconds a collective of the exchange (or a per-step agreement) may wait
        before rank 0 logs which ranks have not arrived and what each was last doing (its round;
        the collective it waits in, or how long ago it left its last one); repeated every that many
        seconds while the stall lasts.  ``"auto"`` (default): ``TFSPARSE_STALL_WARNING`` if set,
        else 60 (as Horovod's stall check); ``None`` or ``0``: no warning.
      stall_timeout: seconds a collective may wait before every rank exits non-zero
        (``MPI_Abort``) with that report.  ``"auto"`` (default): ``TFSPARSE_STALL_TIMEOUT`` if set,
        else off (``None``), as Horovod's stall shutdown: a long validation or checkpoint on one rank
        legitimately keeps the others waiting; set it above the longest such pause.  Both stall
        settings need ``MPI_THREAD_MULTIPLE`` (the watch thread that also catches departed ranks).
      stall_stacks: ``True``: at every stall inquiry each rank that answers (and the one that
        asked) also writes the Python stack of each of its threads to its standard error; and a
        rank whose watch thread cannot run for ``stall_warning`` seconds (``stall_timeout`` where
        there is no warning; plus at most half a second) --
        some thread holds Python's GIL, so the rank gives no answer -- has Python's
        ``faulthandler`` write them from a thread of its own, which needs no GIL (``faulthandler``'s
        one timer is then the watch thread's).  For finding what a stalled rank is doing.
        ``"auto"`` (default): ``TFSPARSE_STALL_STACKS`` if set (``1``/``on``/``true`` or
        ``0``/``off``/``false``), else off.

    Returns:
      The world's :class:`~tfsparse.collectives.communicator.Communicator` (``rank``, ``size``,
      the collectives every exchange runs over).

    Raises:
      ValueError: an argument outside its accepted values (before any communication), or a
        ``backend`` other than the one this process joined with already.
    """
    setup = _setup_from_environment()
    _checks.choice("abort_on_error", abort_on_error, (True, False), accepted="True or False")
    quiet_workers = _switch("quiet_workers", quiet_workers, setup)
    plain_output = _switch("plain_output", plain_output, setup)
    thread_priority = _switch("thread_priority", thread_priority, setup)
    _check_cores(cores_per_rank)
    _check_allocator(cpu_allocator)
    pools = cores_per_rank != "auto" or "cores_per_rank" in setup  # TensorFlow's thread pools too
    if cpu_allocator == "auto":
        cpu_allocator = "bfc" if "cpu_allocator" in setup else None
    stall_warning = _stall_seconds("stall_warning", stall_warning, "TFSPARSE_STALL_WARNING", 60.0)
    stall_timeout = _stall_seconds("stall_timeout", stall_timeout, "TFSPARSE_STALL_TIMEOUT", None)
    stall_stacks = _stall_stacks(stall_stacks)
    if _state["comm"] is not None:
        if backend not in (None, "auto", _state["backend"]):
            raise ValueError(f"tfsparse is already initialised with backend={_state['backend']!r}; "
                             f"init(backend={backend!r}) cannot switch it within one process")
        return _state["comm"]
    if cpu_allocator == "bfc":  # before Horovod's init or any TF op allocates host memory
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    if backend is None:
        backend = os.environ.get("TFSPARSE_BACKEND", "auto")
    _checks.choice("backend", backend, _BACKENDS, accepted=", ".join(_BACKENDS))
    from .collectives.horovod import HorovodCommunicator, horovod_available

    if backend == "auto":
        backend = "horovod" if _launched_by_horovodrun() and horovod_available() else "mpi"
    if backend == "horovod":
        if not horovod_available():
            raise ValueError("backend='horovod' but horovod.tensorflow does not import or has neither "
                             "MPI nor Gloo; install it with `bash tools/install.sh --horovod` or use backend='mpi'")
        comm = HorovodCommunicator()
        import horovod.tensorflow as hvd

        local = hvd.local_rank()
    else:
        from .collectives.mpi import MPICommunicator

        comm = MPICommunicator()
        local = _mpi_local_rank()
    _state.update(comm=comm, local_rank=local, backend=backend)
    if abort_on_error and quiet_workers and comm.size > 1:
        _abort_on_uncaught_exception(comm.rank, comm.size)
    if comm.size > 1 and (abort_on_error or stall_warning is not None or stall_timeout is not None):
        _watch(abort_on_error, stall_warning, stall_timeout, stall_stacks)
    if abort_on_error and comm.size > 1:  # after the watch's own atexit call: runs before it
        _abort_at_exit(comm.rank, comm.size)
    _share_cores(cores_per_rank, backend, pools)
    if thread_priority:
        from .collectives import thread

        thread.allow_precedence(True)
    if quiet_workers and comm.rank != 0:
        _quiet_worker()
    if plain_output:
        _strip_terminal_codes()
    return comm


def _quiet_worker() -> None:
    """Ranks other than 0: no progress bars (Keras' interactive logging off), no Python
    warnings (rank 0 shows the same ones) and only errors from TensorFlow's and absl's loggers.
    Keras is not imported for it (a numpy-only program would pay TensorFlow's start-up and print
    its start-up lines): when Keras is not imported yet, :func:`quiet_keras` does its part when
    tfsparse's Keras-facing modules are imported."""
    import logging
    import sys
    import warnings

    warnings.simplefilter("ignore")
    for name in ("tensorflow", "absl", "keras"):
        logging.getLogger(name).setLevel(logging.ERROR)
    _state["quiet_keras"] = True
    if "keras" in sys.modules:
        quiet_keras()


def quiet_keras() -> None:
    """Turns Keras' interactive logging (progress bars) off on this rank when
    ``init(quiet_workers=True)`` asked for it; called by ``tfsparse.keras`` as it is imported."""
    if _state.get("quiet_keras"):
        import keras

        keras.config.disable_interactive_logging()


class _PlainText:
    """A text stream that drops ANSI colour/bold codes (Keras' progress bars write them even
    when stdout is a pipe, e.g. under mpirun); everything else is the wrapped stream's."""

    def __init__(self, stream):
        import re

        self._stream = stream
        self._codes = re.compile(r"\x1b\[[0-9;]*m")

    def write(self, text):
        self._stream.write(self._codes.sub("", text))
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _stdout_is_terminal(out) -> bool:
    """Whether what this rank prints ends on a terminal.  Under ``mpirun`` a rank's stdout is a
    pseudo-terminal that mpirun reads and forwards to *its* stdout, so what counts is mpirun's
    (the rank's parent process on the launch node): a terminal, or a pipe / file (Linux /proc)."""
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        try:
            target = os.readlink(f"/proc/{os.getppid()}/fd/1")
            return target.startswith(("/dev/pts/", "/dev/tty"))
        except OSError:
            pass
    return bool(hasattr(out, "isatty") and out.isatty())


def _strip_terminal_codes() -> None:
    import sys

    out = sys.stdout
    if out is not None and not isinstance(out, _PlainText) and not _stdout_is_terminal(out):
        sys.stdout = _PlainText(out)


def _launched_by_horovodrun() -> bool:
    """``horovodrun --gloo`` exports ``HOROVOD_RANK``; ``horovodrun`` over Open MPI exports no
    Horovod variable but always passes ``-mca btl ^openib`` and ``-x NCCL_SOCKET_IFNAME`` to
    ``mpirun`` (horovod/runner/mpi_run.py), which reach every rank on every node."""
    env = os.environ
    return "HOROVOD_RANK" in env or ("NCCL_SOCKET_IFNAME" in env and env.get("OMPI_MCA_btl") == "^openib")


def _ranks_on_this_node(backend: str) -> int:
    if backend == "horovod":
        import horovod.tensorflow as hvd

        return int(hvd.local_size())
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)  # collective: every rank is in init()
    try:
        return int(node.Get_size())
    finally:
        node.Free()


def _setup_from_environment() -> frozenset:
    """The names of :data:`SETUP` that ``TFSPARSE_SETUP`` switches on (unset or ``none``: none;
    ``all``: all; else names separated by commas)."""
    text = os.environ.get("TFSPARSE_SETUP", "").strip()
    if text.lower() in ("", "none"):
        return frozenset()
    if text.lower() == "all":
        return frozenset(SETUP)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETUP]
    if unknown:
        raise ValueError(f"TFSPARSE_SETUP={text!r} names {', '.join(map(repr, unknown))}; accepted: 'all', "
                         f"'none', or names from {', '.join(SETUP)} separated by commas")
    return frozenset(names)


def _switch(name: str, value, setup: frozenset) -> bool:
    """One of :func:`init`'s switches: True, False, or ``"auto"`` (on where ``setup`` names it)."""
    _checks.choice(name, value, (True, False, "auto"), accepted="True, False or 'auto' (TFSPARSE_SETUP)")
    return name in setup if value == "auto" else value


def _check_cores(cores_per_rank) -> None:
    ok = cores_per_rank in (None, "auto", "share") or (isinstance(cores_per_rank, int) and not isinstance(cores_per_rank, bool)
                                              and cores_per_rank >= 1)
    if not ok:
        raise ValueError(f"cores_per_rank={cores_per_rank!r} is not supported; accepted: 'auto', 'share', an "
                         f"integer >= 1, or None")


_ALLOCATORS = ("auto", "bfc", None)


def _check_allocator(cpu_allocator) -> None:
    _checks.choice("cpu_allocator", cpu_allocator, _ALLOCATORS, accepted=(
        "'auto' (TFSPARSE_SETUP), 'bfc' (TensorFlow's reusing allocator for host memory) or None (TensorFlow's "
        "default)"))


def _share_cores(cores_per_rank, backend: str, pools: bool) -> None:
    """Limits tfsparse's kernels (a limit they set around each launch: the process's Numba
    setting stays) and, when ``pools``, TensorFlow's thread pools to ``cores_per_rank``."""
    if cores_per_rank is None:
        return
    if cores_per_rank in ("auto", "share"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // _ranks_on_this_node(backend))
    else:
        threads = cores_per_rank
    from .ops import cpu

    cpu.set_thread_limit(threads)
    import sys

    if pools and "tensorflow" in sys.modules:
        tf = sys.modules["tensorflow"]
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
        except RuntimeError:  # TensorFlow already started: its pools are fixed
            pass


#: exceptions that every rank raises alike (agreements); only rank 0 prints their traceback
_ALIKE_EVERYWHERE = ("ConfigurationMismatch", "StepCountMismatch")


def _raised_alike_everywhere(exc) -> bool:
    """Whether ``exc`` is an agreement's error, which every rank raises with the same message --
    itself, or wrapped by TensorFlow (raised in a ``tf.numpy_function``: its message then starts
    with the class name)."""
    names = {t.__name__ for t in type(exc).__mro__}
    return bool(names & set(_ALIKE_EVERYWHERE)) or any(f"{n}:" in str(exc) for n in _ALIKE_EVERYWHERE)


def _abort_on_uncaught_exception(rank: int, size: int) -> None:
    """Chains ``sys.excepthook`` (``init(quiet_workers=True, abort_on_error=True)``): one
    traceback per failure, then ``MPI_Abort`` on the world
    (:func:`~tfsparse.collectives.watchdog.abort_world`), from the hook.

    The rank that fails first prints its traceback and tells the others (each prints one line
    naming it) before it aborts the job; a rank whose own exception comes after another rank's
    announced failure prints one line instead of its traceback, as does every rank but 0 for an
    agreement's error (:data:`_ALIKE_EVERYWHERE`: the same message on every rank) -- those ranks
    leave the abort to the rank that printed, and abort themselves only 10 s later (one
    ``MPI_Abort`` per job: Open MPI prints its abort notice per aborting rank)."""
    import sys

    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        watch = _state.get("watch")
        alike = _raised_alike_everywhere(exc)
        earlier = watch.first_failure() if watch is not None else None
        quiet = watch is not None and ((alike and rank != 0) or earlier is not None)
        try:
            if quiet:
                first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:200]
                why = (f"the same error as on rank 0, which prints the traceback" if alike and earlier is None else
                       f"after rank {earlier[0]} failed with {earlier[1]} (its traceback is printed by rank {earlier[0]})")
                sys.stdout.flush()
                sys.stderr.write(f"tfsparse: rank {rank} stopped with {exc_type.__name__}: {first} -- {why}\n")
                sys.stderr.flush()
                watch.failing = True
            else:
                previous(exc_type, exc, tb)
                if watch is not None and not alike:
                    watch.announce_failure(exc_type.__name__)
        finally:  # quiet: the rank that printed the traceback aborts the job meanwhile
            _abort_job(rank, size, exc_type.__name__, after=10.0 if quiet else 0.0)

    sys.excepthook = hook


#: (module, function) of the outermost frame of an exception that ends a program: a script's
#: or ``python -c``'s module code, or ``python -m``'s runner
_TOP_LEVEL = {("__main__", "<module>"), ("runpy", "_run_module_as_main"), ("runpy", "_run_code")}


def _uncaught_exception():
    """The exception that ends this process, uncaught, or None: what Python left in
    ``sys.last_value`` after printing it -- if its traceback starts at the program's top level
    (:data:`_TOP_LEVEL`).  Others leave ``sys.last_value`` for errors they handled -- pytest for
    a failed test, an interactive or IPython session for an earlier error, C code reporting a
    callback's -- and those end nothing."""
    import sys

    exc, tb = getattr(sys, "last_value", None), getattr(sys, "last_traceback", None)
    if exc is None or tb is None or hasattr(sys, "ps1") or sys.flags.interactive:
        return None
    ipython = sys.modules.get("IPython")
    if ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None:
        return None
    top = tb.tb_frame
    return exc if (top.f_globals.get("__name__"), top.f_code.co_name) in _TOP_LEVEL else None


def _abort_at_exit(rank: int, size: int) -> None:
    """Registers an ``atexit`` call that ends every rank with ``MPI_Abort`` when this process
    exits because of an uncaught exception (:func:`_uncaught_exception`: Python has printed its
    traceback); a normal exit and ``sys.exit`` (the departure watch sees those) abort nothing.
    ``sys.excepthook`` stays the program's own.  It runs before mpi4py's finalisation (a
    ``Py_AtExit`` call, after every ``atexit`` one), which could wait for the ranks still in a
    collective; and after Python has joined the program's own non-daemon threads -- one blocked
    for good keeps this rank from getting there (tfsparse's threads are daemons; the excepthook
    that ``quiet_workers`` chains aborts before that join)."""
    import atexit

    def at_exit():
        exc = _uncaught_exception()
        if exc is not None:  # an error every rank raised alike: rank 0's abort ends the job meanwhile
            alike = _state.get("watch") is not None and _raised_alike_everywhere(exc) and rank != 0
            _abort_job(rank, size, type(exc).__name__, after=10.0 if alike else 0.0)

    atexit.register(at_exit)


def _abort_job(rank: int, size: int, name: str, after: float = 0.0) -> None:
    """Ends every rank (:func:`~tfsparse.collectives.watchdog.abort_world`) for this rank's
    uncaught exception of type ``name``, ``after`` seconds from now; the message names the ranks
    that had ended before it (the departure watch's)."""
    if after:
        import time

        time.sleep(after)
    watch = _state.get("watch")
    gone = watch.gone() if watch is not None else []
    cause = (f" (rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} had ended: the program "
             f"finished or fit returned early on that rank)") if gone else ""
    from mpi4py import MPI

    from .collectives.watchdog import abort_world

    abort_world(MPI.COMM_WORLD, f"tfsparse: rank {rank} stopped with an uncaught {name}{cause}; "
                                f"aborting all {size} ranks (MPI_Abort)\n")


def _stall_seconds(name: str, value, variable: str, default):
    """``stall_warning`` / ``stall_timeout`` as seconds or None (off): ``"auto"`` reads
    ``variable`` (a number of seconds; ``0``, ``off`` or ``none``: off), else ``default``."""
    if isinstance(value, str) and value == "auto":
        text = os.environ.get(variable)
        if text is None:
            return default
        if text.strip().lower() in ("", "0", "off", "none"):
            return None
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"{variable}={text!r} is not valid; accepted: a number of seconds > 0, or 0/off/none")
        return seconds
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    return _checks.real(name, value, 0.0, lo_open=True, hint=(
        f", None or 0 (off), or 'auto' (the environment variable {variable})"))


def _stall_stacks(value) -> bool:
    """``stall_stacks`` as a bool: ``"auto"`` reads ``TFSPARSE_STALL_STACKS`` (off where unset)."""
    _checks.choice("stall_stacks", value, (True, False, "auto"),
                   accepted="True, False or 'auto' (the environment variable TFSPARSE_STALL_STACKS)")
    if value != "auto":
        return value
    text = os.environ.get("TFSPARSE_STALL_STACKS", "").strip().lower()
    if text in ("", "0", "off", "false", "no"):
        return False
    if text in ("1", "on", "true", "yes"):
        return True
    raise ValueError(f"TFSPARSE_STALL_STACKS={text!r} is not valid; accepted: 1, on, true, yes or 0, off, false, no")


def _watch(departures: bool, stall_warning, stall_timeout, stall_stacks: bool = False) -> None:
    """Starts the watch thread (collective: every rank is in init()) -- the departure watch and
    the stall report -- and tells the other ranks at a normal exit that this one is gone.
    Its ``atexit`` call runs before mpi4py's finalisation (a ``Py_AtExit`` call, after every
    ``atexit`` one)."""
    import atexit

    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return
    from .collectives.watchdog import DepartureWatch

    watch = DepartureWatch(departures=departures, stall_warning=stall_warning, stall_timeout=stall_timeout,
                           stacks=stall_stacks)
    _state["watch"] = watch
    atexit.register(watch.depart)


def _mpi_local_rank() -> int:
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def communicator() -> Communicator:
    """The world communicator (initialising it with defaults if needed).

    Returns:
      The :class:`~tfsparse.collectives.Communicator` of every rank of the job.
    """
    return _state["comm"] if _state["comm"] is not None else init()


def backend() -> str:
    """The engine this process joined with (initialising it with defaults if needed).

    Returns:
      ``"mpi"`` or ``"horovod"``.
    """
    communicator()
    return _state["backend"]


def rank() -> int:
    """This process's rank in the job (initialising it with defaults if needed).

    Returns:
      An int from 0 to ``size() - 1``; rank 0 is the one that prints and saves.
    """
    return communicator().rank


def size() -> int:
    """How many processes (workers, P) the job has (initialising it with defaults if needed).

    Returns:
      An int >= 1: the ranks whose gradients every exchange sums.
    """
    return communicator().size


def local_rank() -> int:
    """This process's rank among the job's processes on its own host (initialising it with
    defaults if needed): what picks its GPU on a node with several.

    Returns:
      An int from 0 to the number of ranks on this host less one.
    """
    communicator()
    return _state["local_rank"]


def is_initialized() -> bool:
    """Whether this process has joined the job's world already (:func:`init`, or anything that
    called it).  Joins nothing.

    Returns:
      True once :func:`init` has run in this process.
    """
    return _state["comm"] is not None


class StepCountMismatch(RuntimeError):
    """Ranks were given different numbers of batches (they would hang in a collective)."""


def check_step_counts(comm, steps: int) -> None:
    """All ranks compare their number of batches; raises on every rank if they differ.

    Collective.

    Args:
      comm: the ranks' communicator.
      steps: this rank's number of batches per epoch (-1: unknown).

    Raises:
      StepCountMismatch: the ranks' counts differ.
    """
    got = comm.allgather(np.array([steps], dtype=np.int64))
    raise_on_uneven_counts([int(g[0]) for g in got])


def raise_on_uneven_counts(counts: list[int]) -> None:
    """Raises :class:`StepCountMismatch` when the ranks' numbers of batches differ.

    The message names each rank's count and any rank without data.

    Args:
      counts: every rank's number of batches, in rank order (-1: unknown).

    Raises:
      StepCountMismatch: the counts differ.
    """
    if len(set(counts)) <= 1:
        return
    listed = ", ".join(f"rank {r}: {'unknown' if c < 0 else c}" for r, c in enumerate(counts))
    empty = [r for r, c in enumerate(counts) if c == 0]
    none = (f" Rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} ha{'ve' if len(empty) > 1 else 's'} "
            f"no data at all (an empty shard).") if empty else ""
    raise StepCountMismatch(
        f"ranks were given different numbers of batches per epoch ({listed}).{none} "
        f"Every collective step needs all ranks, so this would hang. Give every rank the same number "
        f"of batches: shard with tfsparse.data.shard(x, y) (equal shards), pass the same "
        f"steps_per_epoch= on every rank, or drop the remainder (batch(..., drop_remainder=True)).")


def held_weakly(method):
    """``method`` called through a weak reference to its object.

    For a Python function that TensorFlow keeps -- that of a ``tf.numpy_function`` traced in a
    ``tf.function`` or a dataset, which it holds for the life of the process: so the object (a
    strategy, an exchange, their buffers) is freed once nothing else holds it.

    Args:
      method: a bound method.

    Returns:
      A function that calls ``method`` with its arguments, and raises a ``RuntimeError`` once the
      object has been freed.
    """
    ref, name = weakref.WeakMethod(method), method.__qualname__

    def call(*args):
        bound = ref()
        if bound is None:
            raise RuntimeError(f"tfsparse: {name} runs for an object that has been freed (a "
                               f"strategy or exchange nothing holds any more); keep a reference to it while "
                               f"the traced function or dataset runs")
        return bound(*args)

    return call
