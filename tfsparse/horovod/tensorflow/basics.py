"""Horovod's questions about the build and the running job (``hvd.mpi_built()``,
``hvd.nccl_built()``, ``hvd.is_homogeneous()``, ...), answered for tfsparse.

Horovod scripts ask them to choose a code path (``if hvd.nccl_built(): ...``).  tfsparse's
collectives run over MPI (mpi4py), or over Horovod's own under ``horovodrun``; it has no Gloo,
NCCL, DDL, oneCCL or ROCm collectives, so those answer False (``nccl_built``: 0, Horovod's "no
NCCL version").  The questions about the job need :func:`tfsparse.horovod.tensorflow.init`
first, as Horovod's do.
"""
from __future__ import annotations

from ... import runtime


def _world():
    from . import _comm  # raises Horovod's ValueError before init

    return _comm()


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks.

    Returns:
      True when each host of the job holds as many ranks as every other.

    Raises:
      ValueError: before :func:`~tfsparse.horovod.tensorflow.init`.
    """
    from . import _topo

    return bool(_topo("homogeneous"))


def mpi_threads_supported() -> bool:
    """Whether the transport lets several threads make calls at once (MPI_THREAD_MULTIPLE), as
    tfsparse's communication thread needs to overlap the exchange with the computation.

    Returns:
      True when it does.

    Raises:
      ValueError: before :func:`~tfsparse.horovod.tensorflow.init`.
    """
    return bool(_world().thread_safe)


def mpi_enabled() -> bool:
    """Whether the job's collectives run over MPI: on tfsparse's MPI backend, yes; under
    ``horovodrun`` (Horovod's collectives), Horovod's own answer.

    Returns:
      True when MPI carries the collectives.

    Raises:
      ValueError: before :func:`~tfsparse.horovod.tensorflow.init`.
    """
    _world()
    if runtime.backend() == "mpi":
        return True
    import horovod.tensorflow as horovod

    return bool(horovod.mpi_enabled())


def mpi_built() -> bool:
    """Whether MPI collectives are available (mpi4py imports).

    Returns:
      True when mpi4py is installed.
    """
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def nccl_built() -> int:
    """NCCL's version code where it is built in, else 0: tfsparse has no NCCL collectives (its
    GPU path copies the sparse payload to the host for MPI).

    Returns:
      0.
    """
    return 0


def cuda_built() -> bool:
    """Whether tfsparse can run its kernels on a CUDA GPU here: TensorFlow sees a GPU and numba-cuda
    imports and finds one (:func:`tfsparse.ops.tf.cuda_usable`, the test behind the default path).

    Returns:
      True when the CUDA kernels can run.
    """
    from ...ops import tf as ops_tf

    return ops_tf.cuda_usable()


def _never(name: str, what: str):
    """A query of Horovod's about a part tfsparse does not have: it answers False."""
    def query() -> bool:
        return False

    query.__name__ = query.__qualname__ = name
    query.__doc__ = f"Whether {what}: never in tfsparse.\n\nReturns:\n  False.\n"
    return query


gloo_enabled = _never("gloo_enabled", "Gloo runs the collectives")
gloo_built = _never("gloo_built", "Gloo is built in")
ddl_built = _never("ddl_built", "IBM DDL is built in")
ccl_built = _never("ccl_built", "oneCCL is built in")
rocm_built = _never("rocm_built", "ROCm is built in")

NAMES = ("is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
         "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built")
"""The names this module provides, as ``horovod.tensorflow`` and ``horovod.tensorflow.keras`` do."""
