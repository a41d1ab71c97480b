"""``tfsparse-run``: launch one process per worker through ``mpirun`` with the right flags.

    tfsparse-run -np 4 python train.py [args...]
    tfsparse-run -np 4 --net 1gbit python train.py      # on an emulated 1 Gbit/s cluster

Adds ``--oversubscribe`` when more processes than cores are asked for, the
run-as-root flags when run by root, ``--bind-to none`` (TensorFlow manages its own
threads) and exports ``PYTHONUNBUFFERED=1`` so ranks' output is not held back.
Extra mpirun options go after ``--mpi-args`` as one quoted string.

``--net RATE[,latency=DELAY]`` runs every rank in its own network namespace behind a link
shaped to RATE in both directions, Open MPI restricted to TCP over those links (see
:mod:`tfsparse.network`); the launcher then stays in the foreground and removes the namespaces
and links when the job ends, fails, or is interrupted (Ctrl-C, SIGTERM are passed on to mpirun).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys

from .network import EmulatedNetwork, NetSpec


def build_command(np_: int, command: list[str], mpi_args: str = "", hosts: str | None = None,
                  network: EmulatedNetwork | None = None) -> tuple[list[str], dict]:
    """The mpirun command line and environment; ``network`` (already built) confines the ranks."""
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
    if network is not None:
        cmd += network.mpirun_args()
        env.update(network.environment())
    cmd += shlex.split(mpi_args)
    # mpirun started by its absolute path acts as if given --prefix and puts its own bin/ first
    # on the ranks' PATH (/usr/bin/python3 instead of the caller's python3): resolve the program
    # against the caller's PATH here
    program = command[0] if os.sep in command[0] else (shutil.which(command[0]) or command[0])
    command = [program, *command[1:]]
    cmd += network.wrap(command) if network is not None else command
    return cmd, env


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_on_network(np_: int, spec: NetSpec, command: list[str], mpi_args: str = "") -> int:
    """Builds the emulated network, runs mpirun in it, removes it; returns mpirun's exit status.

    Signals are passed on to mpirun (which stops the ranks) and the network is removed after
    it exits, whatever the outcome.
    """
    child: list[subprocess.Popen] = []

    def forward(signum, _frame):
        if child:
            child[0].send_signal(signum)
        else:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        with EmulatedNetwork(np_, spec) as net:
            cmd, env = build_command(np_, command, mpi_args, network=net)
            print(f"tfsparse-run: {np_} ranks on an emulated network, {spec} per rank link "
                  f"(both directions), subnet {net.subnet}", file=sys.stderr, flush=True)
            child.append(subprocess.Popen(cmd, env=env))
            code = child[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tfsparse-run", description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", "-n", dest="np", type=int, required=True, help="number of processes")
    parser.add_argument("-H", "--hosts", default=None, help="host list, as for mpirun -H")
    parser.add_argument("--mpi-args", default="", help="extra mpirun arguments (one quoted string)")
    parser.add_argument("--net", default=None, metavar="RATE[,latency=DELAY]",
                        help="run on an emulated network: each rank in its own network namespace, "
                             "its link shaped to RATE both ways (e.g. 1gbit); needs root")
    parser.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run")
    args = parser.parse_args(argv)
    try:
        spec = NetSpec.parse(args.net) if args.net is not None else None
        if spec is not None and args.hosts:
            raise ValueError(f"--net with -H {args.hosts}: the emulated network lives on this "
                             "machine; accepted: one of them")
        cmd, env = build_command(args.np, args.command, args.mpi_args, args.hosts)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if spec is not None and not args.dry_run:
        try:
            return run_on_network(args.np, spec, args.command, args.mpi_args)
        except (RuntimeError, PermissionError, ValueError) as e:
            print(f"tfsparse-run: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
