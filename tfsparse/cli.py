"""``tfsparse``: the package's command line.

    tfsparse warmup      # compile the Numba kernels into their cache (once per machine and version)
    tfsparse --version

After ``pip install`` (which cannot run code of its own), ``tfsparse warmup`` on each node fills
the kernels' cache -- beside the package, or in ``NUMBA_CACHE_DIR`` -- so that the first step of
the first job does not wait for the compiler; ``tools/install.sh`` runs it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ._version import __version__


def warmup() -> float:
    """Compiles (or loads from the cache) every Numba CPU kernel; returns the seconds it took."""
    from .ops import cpu

    t0 = time.perf_counter()
    cpu.warmup()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    """``tfsparse``'s entry point on ``argv`` (default ``sys.argv[1:]``): ``warmup`` compiles the kernels,
    says where they are cached and returns 0; without a command, prints the help and returns 2."""
    parser = argparse.ArgumentParser(prog="tfsparse", description="tfsparse's command line (tfsparse-run launches jobs)")
    parser.add_argument("--version", action="version", version=f"tfsparse {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("warmup", help="compile the Numba kernels into their on-disk cache (once per machine)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command != "warmup":
        parser.print_help()
        return 2
    seconds = warmup()
    where = os.environ.get("NUMBA_CACHE_DIR") or "beside the package (tfsparse/ops/__pycache__)"
    print(f"tfsparse {__version__}: the Numba kernels are ready in {seconds:.1f} s, cached {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
