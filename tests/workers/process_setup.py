"""What ``tfsparse.init()`` changes in the process, launched with ``TFSPARSE_SETUP`` as the test
sets it (``none``: a bare ``mpirun``; ``all``: as ``tfsparse-run`` sets it): stdout, the
excepthook, warnings filters, loggers, the allocator variable, TensorFlow's thread pools, the
kernels' thread limit, the threads' priority.  With ``fail``, rank 1 then raises an uncaught
exception while the others wait in a collective: every rank must end, non-zero.

Usage: process_setup.py [fail]"""
import logging
import os
import sys
import warnings

import numpy as np
import tensorflow as tf

from mpi_harness import save_result

excepthook, stdout, filters = sys.excepthook, sys.stdout, list(warnings.filters)
intra = tf.config.threading.get_intra_op_parallelism_threads()

import tfsparse  # noqa: E402
from tfsparse.collectives import thread  # noqa: E402
from tfsparse.ops import cpu  # noqa: E402

comm = tfsparse.init()
save_result(comm.rank, excepthook_kept=sys.excepthook is excepthook, stdout_kept=sys.stdout is stdout,
            filters_kept=list(warnings.filters) == filters, tf_level=logging.getLogger("tensorflow").level,
            allocator=os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
            intra_before=intra, intra=tf.config.threading.get_intra_op_parallelism_threads(),
            kernel_threads=cpu._THREAD_LIMIT[0], numba_threads=cpu.numba.config.NUMBA_NUM_THREADS,
            priority=thread._ALLOWED[0])
if sys.argv[1:] == ["fail"]:
    if comm.rank == 1:
        raise RuntimeError("rank 1 fails here")
    comm.allreduce(np.ones(3))  # waits for rank 1 forever, unless the job is aborted
