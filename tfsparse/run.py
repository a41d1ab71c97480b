"""``tfsparse-run``: launch one process per worker through ``mpirun`` with the right flags.

    tfsparse-run -np 4 python train.py [args...]

Adds ``--oversubscribe`` when more processes than cores are asked for, the
run-as-root flags when run by root, ``--bind-to none`` (TensorFlow manages its own
threads) and exports ``PYTHONUNBUFFERED=1`` so ranks' output is not held back.
Extra mpirun options go after ``--mpi-args`` as one quoted string.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys


def build_command(np_: int, command: list[str], mpi_args: str = "", hosts: str | None = None) -> tuple[list[str], dict]:
    if np_ < 1:
        raise ValueError(f"-np {np_}: the number of processes must be >= 1")
    if not command:
        raise ValueError("no command given; usage: tfsparse-run -np 4 python train.py")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError("mpirun not found; install Open MPI (bash tools/install.sh)")
    cmd = [mpirun, "-np", str(np_), "--bind-to", "none"]
    env = dict(os.environ)
    if hosts:
        cmd += ["-H", hosts]
    if np_ > (os.cpu_count() or 1) or hosts is None:
        cmd.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for var in ("PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL", "TFSPARSE_BACKEND", "PYTHONPATH"):
        if var in env:
            cmd += ["-x", var]
    cmd += shlex.split(mpi_args)
    # mpirun started by its absolute path acts as if given --prefix and puts its own bin/ first
    # on the ranks' PATH (/usr/bin/python3 instead of the caller's python3): resolve the program
    # against the caller's PATH here
    program = command[0] if os.sep in command[0] else (shutil.which(command[0]) or command[0])
    cmd += [program, *command[1:]]
    return cmd, env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tfsparse-run", description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", "-n", dest="np", type=int, required=True, help="number of processes")
    parser.add_argument("-H", "--hosts", default=None, help="host list, as for mpirun -H")
    parser.add_argument("--mpi-args", default="", help="extra mpirun arguments (one quoted string)")
    parser.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run")
    args = parser.parse_args(argv)
    try:
        cmd, env = build_command(args.np, args.command, args.mpi_args, args.hosts)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
