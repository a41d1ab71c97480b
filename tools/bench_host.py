"""The machine a benchmark ran on, named one way by every tool in ``tools/``: the host's name, its
core count and its CPU model (from ``/proc/cpuinfo``), e.g. ``"vm, 2 cores, Intel(R) Xeon(R) ..."``.
The same 2-core VM has run on an AMD and on an Intel host: the memory speed and the codecs' cost
moved with it, so a record without the CPU model cannot be compared with a later one.

The tools import this module by its name: run as scripts (``python tools/bench_fit_step.py``),
they have ``tools/`` first on the path; the two that other code loads by path
(``bench_fit_step``, ``bench_time_to_accuracy``) put it there themselves."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says of the processor."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """``"<host>, <N> cores, <CPU model>"``."""
    return f"{platform.node()}, {os.cpu_count()} cores, {cpu_model()}"
