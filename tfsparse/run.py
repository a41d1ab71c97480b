"""``tfsparse-run``: launch one process per worker through ``mpirun`` with the right flags.

    tfsparse-run -np 4 python train.py [args...]
    tfsparse-run -np 4 --net 1gbit python train.py      # on an emulated 1 Gbit/s cluster
    tfsparse-run -np 4 -x FOO=1 --mca btl self,vader python train.py   # mpirun flags pass through

Adds ``--oversubscribe`` on this machine alone (no host list) and, with ``-H`` or an mpirun
``--hostfile``, only when more processes are asked for than the hosts' slots; the run-as-root
flags when run by root; ``--bind-to none`` (TensorFlow manages its own threads); and exports
``PYTHONUNBUFFERED=1`` so ranks' output is not held back and ``TFSPARSE_SETUP=all`` (unless
set): :func:`tfsparse.init` then makes its process-wide changes (workers kept quiet, plain
output, each rank its share of the cores, TensorFlow's reusing allocator, the communication
thread's priority), which it leaves alone under a bare ``mpirun``.  Every rank, on every host, gets the
launching shell's ``PATH``, ``PYTHONPATH``, ``LD_LIBRARY_PATH``, ``VIRTUAL_ENV`` and every
``TFSPARSE_*`` and ``NUMBA_*`` variable (:data:`FORWARDED`), as well as the caller's ``-x`` list.

With other hosts than this one, every host is first asked over ssh, all at once and without
prompts (:func:`tfsparse.cluster.check_hosts`), whether it can start its ranks: a host that
cannot be reached, asks for a password or a host-key confirmation, or lacks the program (its
absolute path here) is named on one line each within seconds, and the job does not start,
instead of ``mpirun`` waiting (``TFSPARSE_HOST_CHECK=0`` skips the check).

Any other flag before the program is mpirun's and is passed on (``-x VAR[=value]``,
``--mca key value``, ``--map-by ...``, ``--tag-output``, ...): Open MPI's flags are known with the
number of values each takes (:data:`MPIRUN_FLAGS`), so the program is the first word that is
neither a flag nor a flag's value, and everything from it on belongs to the program.  A flag
tfsparse-run does not know is accepted in ``--flag=value`` form or before a ``--`` that ends
mpirun's flags (``tfsparse-run -np 2 --new-flag v -- python train.py``); extra mpirun options
can also go after ``--mpi-args`` as one quoted string.  A ``--bind-to`` of the caller's replaces
``--bind-to none``; ``--nooversubscribe`` drops ``--oversubscribe``.

``--net RATE[,latency=DELAY]`` runs every rank in its own network namespace behind a link
shaped to RATE in both directions, Open MPI restricted to TCP over those links (see
:mod:`tfsparse.network`); the launcher then stays in the foreground and removes the namespaces
and links when the job ends, fails, or is interrupted (Ctrl-C, SIGTERM are passed on to mpirun).

``--emulate-hosts H`` makes H hosts on this machine (:class:`~tfsparse.network.EmulatedHosts`):
each its own network and hostname namespace (``h1`` ... ``hH``) with its own ``sshd``, linked at
``--net``'s rate; the ranks are spread evenly over them (or as ``-H h1:N,...`` or a
``--hostfile`` says) and Open MPI starts them through ssh, as on a cluster.  The hosts are
removed when the job ends, fails or is interrupted.

``--max-restarts N`` (like torchrun's; default 0) relaunches the whole mpirun job when it exits
with a non-zero status, up to N times, one line on stderr per restart, and returns the last
job's exit status; a job interrupted by Ctrl-C or SIGTERM is not relaunched.  A script that
trains with :class:`tfsparse.keras.callbacks.BackupAndRestore` goes on from its last backup.
(mpirun's own, unrelated ``--max-restarts`` -- Open MPI's per-process restarts -- is reached
through ``--mpi-args "--max-restarts N"``.)

tfsparse-run stays in the foreground and watches mpirun (:class:`LauncherWatch`): Open MPI 4.1's
``mpirun`` at times outlives every rank of a job that ended in ``MPI_Abort`` (its runtime logs
``ORTE_ERROR_LOG: Data unpack would read past end of buffer in file .../show_help.c`` and then
waits forever), so an mpirun that is still there :data:`LINGER_S` seconds after its last rank
ended is ended, with a line on stderr, and the job's exit status is 1.

The job's standard error passes through :class:`tfsparse.banner.BannerFilter`: TensorFlow's
start-up notices (oneDNN, absl's logging notice), which every rank prints twice, are shown once
per job (``TFSPARSE_TF_BANNER=all`` shows every rank's).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .banner import filtered_stderr, start_pump
from .cluster import check_hosts, parse_host_list, read_hostfile, remote_hosts, total_slots
from .network import EmulatedHosts, EmulatedNetwork, NetSpec

# Open MPI's mpirun flags and how many values each takes (mpirun --help all, Open MPI 4.1; and
# the PRRTE flags of Open MPI 5).  Keys without their leading dashes: mpirun accepts its long
# flags with one dash or two.  The process count and the host list are tfsparse-run's own.
_MPIRUN_FLAGS_BY_ARITY = {
    0: """allow-run-as-root bind-to-core bind-to-socket bycore bynode byslot continuous d debug-devel
          debug debug-daemons debug-daemons-file disable-recovery display-allocation
          display-devel-allocation display-devel-map display-diffable-map display-map display-topo
          do-not-launch do-not-resolve dvm enable-instant-on-support enable-recovery fwd-mpirun-port
          get-stack-traces index-argv-by-rank leave-session-attached merge-stderr-to-stdout nolocal
          nooversubscribe noprefix novm output-proctable oversubscribe pernode q quiet
          report-bindings report-child-jobs-separately report-state-on-timeout s preload-binary
          set-cwd-to-session-dir show-progress tag-output timestamp-output tv use-hwthread-cpus
          use-regexp v verbose V version xml""",
    1: """am app bind-to cf cartofile cpu-list cpu-set cpus-per-proc cpus-per-rank debugger
          default-hostfile hnp hostfile launch-agent machinefile map-by max-vm-size N
          npernode npersocket ompi-server output-filename path personality ppr prefix preload-files
          rank-by report-events report-pid report-uri rf rankfile stdin timeout tune wd wdir x
          xml-file xterm display output runtime-options add-host add-hostfile""",
    2: "gmca mca prtemca pmixmca",
}
# mpirun's own --max-restarts is left out: tfsparse-run's --max-restarts (relaunch the whole job)
# takes its place; mpirun's goes through --mpi-args
MPIRUN_FLAGS = {name: n for n, names in _MPIRUN_FLAGS_BY_ARITY.items() for name in names.split()}


def _restarts(text: str) -> int:
    """``--max-restarts``' value: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; accepted: an integer >= 0 (the number of times "
                                         f"a failed job is relaunched)")
    return value


# tfsparse-run's own options: (flags, argparse keyword arguments)
_OPTIONS = (
    (("-np", "-n", "--np", "-c"), dict(dest="np", type=int, required=True, help="number of processes")),
    (("-H", "--hosts", "--host", "-host"), dict(dest="hosts", default=None, help="host list, as for mpirun -H")),
    (("--mpi-args",), dict(default="", help="extra mpirun arguments (one quoted string)")),
    (("--net",), dict(default=None, metavar="RATE[,latency=DELAY]",
                      help="run on an emulated network: each rank in its own network namespace, its link "
                           "shaped to RATE both ways (e.g. 1gbit, 100mbit,latency=50us); needs root")),
    (("--emulate-hosts",), dict(dest="emulate_hosts", type=int, default=None, metavar="H",
                                help="run on H emulated hosts on this machine, each with its own sshd and "
                                     "hostname, the ranks spread evenly (or as -H h1:N,h2:N... says), Open MPI "
                                     "starting them over ssh; --net RATE shapes the links between hosts; "
                                     "needs root and openssh-server")),
    (("--max-restarts",), dict(dest="max_restarts", type=_restarts, default=0, metavar="N",
                               help="relaunch the whole job when it fails (exits non-zero), up to N times "
                                    "(default 0); a script with tfsparse.keras.callbacks.BackupAndRestore "
                                    "resumes from its last backup")),
    (("--dry-run",), dict(action="store_true", help="print the mpirun command and exit")),
    (("-h", "--help"), dict(action="help", help="show this help message and exit")),
)
_OWN_ARITY = {flag: 0 if kw.get("action") in ("store_true", "help") else 1
              for flags, kw in _OPTIONS for flag in flags}

_DESCRIPTION = """\
Launch one process per worker through mpirun with the right flags: adds
--oversubscribe on this machine alone (with -H or --hostfile: only beyond the
hosts' slots), the run-as-root flags when run by root, --bind-to none
(TensorFlow manages its own threads), and exports PYTHONUNBUFFERED=1 so that
the ranks' output is not held back and TFSPARSE_SETUP=all (tfsparse.init's
process-wide changes: quiet workers, plain output, a share of the cores each,
TensorFlow's reusing allocator, the communication thread's priority). PATH, PYTHONPATH, LD_LIBRARY_PATH,
VIRTUAL_ENV and every TFSPARSE_* and NUMBA_* variable reach every rank. Other
hosts are first asked over ssh (no prompts, seconds) whether they can start
their ranks; one that cannot is named and the job does not start.

Any other flag before the program is passed on to mpirun (-x VAR[=value],
--mca key value, --map-by ..., --tag-output, ...). The program is the first
word that is neither a flag nor a flag's value; everything from it on belongs
to the program. A flag tfsparse-run does not know goes in --flag=value form, or
before a -- that ends mpirun's flags."""

_EPILOG = """\
examples:
  tfsparse-run -np 4 python train.py
      4 ranks on this machine
  tfsparse-run -np 4 --net 1gbit python train.py
      each rank in its own network namespace behind a 1 Gbit/s link (root)
  tfsparse-run -np 4 --net 100mbit,latency=50us python train.py
      a slower link with 50 us of one-way delay (needs the netem qdisc)
  tfsparse-run -np 2 -x FOO=1 --mca btl self,vader,tcp python train.py
      mpirun's flags pass through: FOO=1 in every rank, Open MPI on these
      transports
  tfsparse-run -np 8 -H node1:4,node2:4 --map-by node python train.py
      two hosts, ranks placed round-robin over the nodes
  tfsparse-run -np 4 --emulate-hosts 2 --net 1gbit python train.py
      two emulated hosts on this machine (h1, h2), two ranks each, started
      over ssh, 1 Gbit/s between them (root, openssh-server)
  tfsparse-run -np 2 --some-new-flag value -- python train.py
      a flag tfsparse-run does not know: end mpirun's flags with --
  tfsparse-run -np 4 --max-restarts 3 python train.py
      relaunch the job up to 3 times when it fails (the script resumes
      from its tfsparse.keras.callbacks.BackupAndRestore backup)
  tfsparse-run -np 4 --dry-run python train.py
      print the mpirun command line instead of running it"""


def find_program(name: str) -> str | None:
    """``name`` next to the running Python (a virtual environment's bin/, activated or not),
    else on PATH; None when neither has it."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def _flag_name(token: str) -> str:
    return token.partition("=")[0].lstrip("-")


def split_argv(argv) -> tuple[list[str], list[str], list[str]]:
    """Splits a tfsparse-run command line into (its own options, mpirun's flags, the program).

    The program starts at the first word that is neither a flag nor a flag's value (Open MPI's
    flags are known with their number of values, :data:`MPIRUN_FLAGS`), or right after ``--``.
    Before a ``--`` any flag is accepted and passed on as written.
    """
    argv = [str(a) for a in argv]
    cut = argv.index("--") if "--" in argv else None
    end = len(argv) if cut is None else cut
    own: list[str] = []
    mpi: list[str] = []
    i = 0
    while i < end:
        token = argv[i]
        name, eq, _ = token.partition("=")
        if name in _OWN_ARITY:
            n = 0 if eq else _OWN_ARITY[name]
            own += argv[i:min(i + 1 + n, end)]
            i += 1 + n
            continue
        if not token.startswith("-") or token == "-":
            if cut is None:
                return own, mpi, argv[i:]
            mpi.append(token)  # a value of a flag tfsparse-run does not know, before --
            i += 1
            continue
        n = MPIRUN_FLAGS.get(_flag_name(token))
        if n is None:
            if cut is None and not eq:
                raise ValueError(
                    f"mpirun flag {token!r} is not one tfsparse-run knows, so it cannot tell whether "
                    f"{argv[i + 1] if i + 1 < end else 'what follows'!r} is its value or the program; "
                    f"accepted: Open MPI's mpirun flags (mpirun --help all), {name}=VALUE, or any flags "
                    f"before a -- that ends them (tfsparse-run -np 2 {name} VALUE -- python train.py)")
            n = 0
        n = 0 if eq else n
        values = argv[i + 1:i + 1 + n]
        if len(values) < n or i + 1 + n > end or any(v.startswith("-") and v != "-" and not _is_number(v)
                                                     for v in values):
            raise ValueError(f"mpirun flag {token!r} takes {n} value{'s' if n > 1 else ''}, got "
                             f"{argv[i + 1:min(i + 1 + n, end)]}; e.g. "
                             f"{'-x FOO=1' if n == 1 else '--mca btl self,vader,tcp'}")
        mpi += [token, *values]
        i += 1 + n
    return own, mpi, ([] if cut is None else argv[cut + 1:])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_command(np_: int, command: list[str], mpi_args: str = "", hosts: str | None = None,
                  network: EmulatedNetwork | None = None, mpi_flags=()) -> tuple[list[str], dict]:
    """The mpirun command line and environment; ``network`` (already built) confines the ranks.

    ``mpi_flags`` (a list) and ``mpi_args`` (one string, split like a shell) go to mpirun as they
    are, after tfsparse-run's own flags and before the program.
    """
    if np_ < 1:
        raise ValueError(f"-np {np_}: the number of processes must be >= 1")
    if not command:
        raise ValueError("no command given; usage: tfsparse-run -np 4 python train.py")
    mpirun = find_program("mpirun")
    if mpirun is None:
        raise FileNotFoundError("mpirun not found; install Open MPI (bash tools/install.sh)")
    extra = [*mpi_flags, *shlex.split(mpi_args)]
    given = {_flag_name(a) for a in extra if a.startswith("-")}
    cmd = [mpirun, "-np", str(np_)]
    if not given & {"bind-to", "bind-to-core", "bind-to-socket"}:
        cmd += ["--bind-to", "none"]
    env = dict(os.environ)
    if hosts:
        cmd += ["-H", hosts]
    placement = job_hosts(hosts, extra)
    slots = total_slots(placement) if placement is not None else None
    # on this machine alone (no host list), as many ranks as asked; on hosts, only beyond their
    # slots; under a batch system's allocation Open MPI reads the hosts and slots from it, and a
    # job beyond them is refused, as mpirun refuses it there
    alone = placement is None and not batch_allocation(env)
    if (alone or (slots is not None and np_ > slots)) and "nooversubscribe" not in given:
        cmd.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TFSPARSE_SETUP", "all")  # tfsparse.init()'s process-wide changes, all of them
    # Open MPI 4.1's aggregation of identical help messages (e.g. every rank's MPI_Abort notice)
    # can fail to unpack ("Data unpack would read past end of buffer ... show_help.c", open-mpi/ompi
    # #8356); seen once in this project's CI (a departing-rank test), where mpirun then hung
    # instead of ending the job: print each rank's message instead
    env.setdefault("OMPI_MCA_orte_base_help_aggregate", "0")
    for var in forwarded(env):
        cmd += ["-x", var]
    if network is not None:
        cmd += network.mpirun_args()
        env.update(network.environment())
    cmd += extra
    # mpirun started by its absolute path acts as if given --prefix and puts its own bin/ first
    # on the ranks' PATH (/usr/bin/python3 instead of the caller's python3): resolve the program
    # against the caller's PATH here
    command = [resolve_program(command[0]), *command[1:]]
    cmd += network.wrap(command) if network is not None else command
    return cmd, env


#: the variables every rank gets from the launching shell (``-x``), on this machine and others:
#: Python's and the libraries' search paths, and every ``TFSPARSE_*`` and ``NUMBA_*`` setting
FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL")
FORWARDED_PREFIXES = ("TFSPARSE_", "NUMBA_")


def forwarded(env: dict) -> list[str]:
    """The names in ``env`` that go to every rank: :data:`FORWARDED`, then the
    :data:`FORWARDED_PREFIXES` ones, sorted."""
    return [v for v in FORWARDED if v in env] + sorted(v for v in env if v.startswith(FORWARDED_PREFIXES))


def resolve_program(name: str) -> str:
    """The program's absolute path on this machine (a name is looked up on the caller's PATH),
    which every host must have too (:func:`tfsparse.cluster.check_hosts`)."""
    return name if os.sep in name else (shutil.which(name) or name)


def _flag_value(extra: list[str], names) -> str | None:
    """The value of the last of mpirun's flags ``names`` in ``extra`` (``--flag v`` or
    ``--flag=v``), else None."""
    value = None
    for i, token in enumerate(extra):
        if token.startswith("-") and _flag_name(token) in names:
            value = token.partition("=")[2] if "=" in token else (extra[i + 1] if i + 1 < len(extra) else None)
    return value


def job_hosts(hosts: str | None, extra: list[str]):
    """The job's (host, slots) pairs from ``-H`` or an mpirun ``--hostfile``, or None (this
    machine only)."""
    if hosts:
        return parse_host_list(hosts)
    hostfile = _flag_value(extra, ("hostfile", "machinefile", "default-hostfile"))
    return read_hostfile(hostfile) if hostfile else None


def ssh_agent(extra: list[str], env: dict) -> str:
    """What Open MPI starts remote ranks through: ``--mca plm_rsh_agent``, else
    ``OMPI_MCA_plm_rsh_agent``, else ssh (the first of ``"ssh : rsh"`` alternatives)."""
    agent = env.get("OMPI_MCA_plm_rsh_agent", "ssh")
    for i, token in enumerate(extra[:-2]):
        if _flag_name(token) == "mca" and extra[i + 1] in ("plm_rsh_agent", "orte_rsh_agent"):
            agent = extra[i + 2]
    return agent.split(":")[0].strip() or "ssh"


LINGER_S = 20.0
"""Seconds mpirun may outlive the last of its ranks before :class:`LauncherWatch` ends it."""


def process_table() -> dict[int, tuple[str, int, int]]:
    """``{pid: (state, parent pid, session id)}`` of every process ``/proc`` shows (empty where
    there is no ``/proc``)."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):  # gone meanwhile
                continue
            table[int(entry)] = (fields[0].decode(), int(fields[1]), int(fields[3]))
    return table


def live_descendants(pid: int, table: dict | None = None) -> set[int]:
    """The processes below ``pid`` (children, their children, ...) that are not zombies."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for child, (_, parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {p for p in found if table[p][0] != "Z"}


class LauncherWatch:
    """Tells when a launcher (``mpirun``) has outlived every process it started by ``linger``
    seconds -- Open MPI 4.1's runtime can hang so after an ``MPI_Abort`` (see the module's
    docstring).  :meth:`lingers` is polled while the launcher runs; it is false until the
    launcher has had children once, so a launch that is still starting is never taken for one."""

    def __init__(self, pid: int, linger: float = LINGER_S):
        self.pid, self.linger = pid, linger
        self._started = False
        self._alone_since: float | None = None
        self._usable = os.path.isdir("/proc")

    def lingers(self) -> bool:
        """Whether the launcher has outlived its last live descendant by more than ``linger`` seconds; always
        False without ``/proc``, and before the launcher has had a child."""
        if not self._usable:
            return False
        if live_descendants(self.pid):
            self._started, self._alone_since = True, None
            return False
        if not self._started:
            return False
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        return now - self._alone_since > self.linger

    def message(self, name: str = "mpirun") -> str:
        """The line that says the launcher ``name`` (its pid) was ended for outliving its ranks."""
        return (f"{name} (pid {self.pid}) was still running {self.linger:g} s after the last "
                f"of its ranks had ended (Open MPI's runtime hangs so at times after an MPI_Abort); "
                f"ended it, exit status 1")


def wait_for_launcher(child: subprocess.Popen, linger: float = LINGER_S, poll: float = 0.5) -> int:
    """Waits for ``child`` (mpirun) to exit and returns its status; ends it (SIGTERM, then
    SIGKILL) and returns 1 when it outlives its ranks by ``linger`` seconds (:class:`LauncherWatch`)."""
    watch = LauncherWatch(child.pid, linger)
    while True:
        try:
            return child.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            pass
        if watch.lingers():
            print(f"tfsparse-run: {watch.message()}", file=sys.stderr, flush=True)
            child.terminate()
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            return 1


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Launcher:
    """Runs mpirun command lines one after the other in the foreground, passing Ctrl-C, SIGTERM
    and SIGHUP on to the one running; remembers whether such a signal came (no restart then)."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.interrupted = False
        self._signal = signal.SIGINT  # the last signal that came
        self._told: subprocess.Popen | None = None  # the last child a signal was passed on to
        self._starting = False

    def _forward(self, signum, _frame):
        self.interrupted, self._signal = True, signum
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signum)
            self._told = child
        elif child is None and not self._starting:
            raise KeyboardInterrupt

    def _start(self, cmd: list[str], env: dict, **kwargs) -> subprocess.Popen:
        """Starts ``cmd``; a signal that came while it started (the previous job ended, this one
        not yet running) is passed on to it at once, so that a Ctrl-C between two restarts ends
        the new job rather than being lost."""
        self._starting = True
        try:
            self.child = child = subprocess.Popen(cmd, env=env, **kwargs)
        finally:
            self._starting = False
        if self.interrupted and self._told is not child:
            child.send_signal(self._signal)
            self._told = child
        return child

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._forward) for sig in _FORWARDED}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def run(self, cmd: list[str], env: dict) -> int:
        """Runs ``cmd``; its exit status (128 + N for a job ended by signal N; 130 without
        running it once interrupted)."""
        if self.interrupted:
            return 130
        if not filtered_stderr(env):
            code = wait_for_launcher(self._start(cmd, env))
            return 128 - code if code < 0 else code
        read, write = os.pipe()
        try:
            self._start(cmd, env, stderr=write)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        thread = start_pump(read, 2)  # where the job's standard error went before; it closes read
        try:
            code = wait_for_launcher(self.child)
        finally:
            thread.join(timeout=2)  # a process left holding the pipe cannot keep the launcher
        return 128 - code if code < 0 else code


def run_with_restarts(launch, max_restarts: int, interrupted=lambda: False) -> int:
    """Calls ``launch()`` (one whole job; returns its exit status) and again, up to
    ``max_restarts`` times, while it fails and ``interrupted()`` is false; prints one line per
    restart on stderr; returns the last exit status."""
    restarts = 0
    while True:
        code = launch()
        if code == 0 or restarts >= max_restarts or interrupted():
            return code
        restarts += 1
        print(f"tfsparse-run: the job failed (exit status {code}); restart {restarts} of {max_restarts}",
              file=sys.stderr, flush=True)


def run_locally(cmd: list[str], env: dict, max_restarts: int = 0) -> int:
    """Runs the mpirun command line ``cmd`` in the foreground, relaunched up to ``max_restarts``
    times while it fails (:func:`run_with_restarts`); returns the last exit status."""
    with _Launcher() as launcher:
        return run_with_restarts(lambda: launcher.run(cmd, env), max_restarts, lambda: launcher.interrupted)


def run_on_network(np_: int, spec: NetSpec, command: list[str], mpi_args: str = "", mpi_flags=(),
                   max_restarts: int = 0) -> int:
    """Builds the emulated network, runs mpirun in it (relaunched up to ``max_restarts`` times
    while it fails, on the same network), removes it; returns the last mpirun's exit status.

    Signals are passed on to mpirun (which stops the ranks) and the network is removed after
    it exits, whatever the outcome.
    """
    with _Launcher() as launcher, EmulatedNetwork(np_, spec) as net:
        cmd, env = build_command(np_, command, mpi_args, network=net, mpi_flags=mpi_flags)
        print(f"tfsparse-run: {np_} ranks on an emulated network, {spec} per rank link "
              f"(both directions), subnet {net.subnet}", file=sys.stderr, flush=True)
        return run_with_restarts(lambda: launcher.run(cmd, env), max_restarts, lambda: launcher.interrupted)


def run_on_hosts(np_: int, hosts: int, spec: NetSpec | None, command: list[str], host_list: str | None = None,
                 mpi_args: str = "", mpi_flags=(), max_restarts: int = 0) -> int:
    """Builds ``hosts`` emulated hosts (:class:`~tfsparse.network.EmulatedHosts`), runs mpirun
    across them over ssh -- after the same check of every host as on a cluster -- and removes
    them, whatever the outcome; returns the last mpirun's exit status."""
    extra = [*mpi_flags, *shlex.split(mpi_args)]
    with _Launcher() as launcher, EmulatedHosts(hosts, spec) as cluster:
        if host_list is None and job_hosts(None, extra) is None:
            host_list = cluster.host_list(np_)
        cmd, env = build_command(np_, command, mpi_args, host_list, network=cluster, mpi_flags=mpi_flags)
        problems = check_job_hosts(host_list, extra + cluster.mpirun_args(), command, env)
        if problems:
            raise RuntimeError("; ".join(problems))
        print(f"tfsparse-run: {np_} ranks on {hosts} emulated hosts ({host_list or 'the hostfile'}), "
              f"{spec or 'unshaped'} links between hosts, subnet {cluster.subnet}", file=sys.stderr, flush=True)
        return run_with_restarts(lambda: launcher.run(cmd, env), max_restarts, lambda: launcher.interrupted)


#: variables a batch system's allocation sets, from which Open MPI reads the job's hosts and slots
#: (Slurm, PBS/Torque, LSF, Grid Engine)
BATCH_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "PBS_NODEFILE", "LSB_JOBID", "PE_HOSTFILE")


def batch_allocation(env) -> str | None:
    """The first of :data:`BATCH_VARIABLES` set in ``env``: the job runs inside a batch system's
    allocation (its hosts and slots are Open MPI's to read); None outside one."""
    return next((name for name in BATCH_VARIABLES if env.get(name)), None)


def check_job_hosts(hosts: str | None, extra: list[str], command: list[str], env: dict) -> list[str]:
    """One line per host of the job, other than this machine, that cannot start its ranks
    (:func:`tfsparse.cluster.check_hosts`, all hosts at once, within seconds); empty when every
    one can, when the job runs on this machine only, or with ``TFSPARSE_HOST_CHECK=0``."""
    placement = job_hosts(hosts, extra)
    remote = remote_hosts(placement) if placement is not None else []
    if not remote:
        return []
    agent = ssh_agent(extra, env)
    if Path(shlex.split(agent)[0]).name != "ssh" or env.get("TFSPARSE_HOST_CHECK") == "0":
        return []  # another agent (rsh, a batch system's): its own options, not checked here; or turned off
    return check_hosts(remote, resolve_program(command[0]), agent=agent)


def make_parser() -> argparse.ArgumentParser:
    """The parser of ``tfsparse-run``'s own options (mpirun's flags and the program are split off first,
    :func:`split_argv`)."""
    parser = argparse.ArgumentParser(
        prog="tfsparse-run", usage="tfsparse-run -np N [options] [mpirun flags] [--] program [args...]",
        description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False, allow_abbrev=False)
    for flags, kwargs in _OPTIONS:
        parser.add_argument(*flags, **kwargs)
    return parser


def main(argv=None) -> int:
    """``tfsparse-run``'s entry point: ``argv`` (default ``sys.argv[1:]``) split into its own options,
    mpirun's flags and the program, and the job run in the foreground -- on this machine or the hosts
    given, on an emulated network (``--net``) or on emulated hosts (``--emulate-hosts``); ``--dry-run``
    prints the mpirun command line instead.  Returns the exit status: the last job's; 1 when a host
    cannot start its ranks or the emulation fails; 130 after Ctrl-C.  Invalid arguments exit through
    argparse (status 2)."""
    parser = make_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        own, mpi_flags, command = split_argv(argv)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(own)
    try:
        spec = NetSpec.parse(args.net) if args.net is not None else None
        hostfile = _flag_value(mpi_flags + shlex.split(args.mpi_args),
                               ("hostfile", "machinefile", "default-hostfile"))
        if spec is not None and args.emulate_hosts is None and (args.hosts or hostfile):
            given = f"-H {args.hosts}" if args.hosts else f"--hostfile {hostfile}"
            raise ValueError(f"--net with {given}: the emulated network lives on this "
                             f"machine; accepted: one of them, or {given.split()[0]} with --emulate-hosts")
        if args.emulate_hosts is not None and not 1 <= args.emulate_hosts <= 64:
            raise ValueError(f"--emulate-hosts {args.emulate_hosts}: accepted: 1 to 64 hosts")
        cmd, env = build_command(args.np, command, args.mpi_args, args.hosts, mpi_flags=mpi_flags)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if args.emulate_hosts is not None and not args.dry_run:
        try:
            return run_on_hosts(args.np, args.emulate_hosts, spec, command, args.hosts, args.mpi_args, mpi_flags,
                                args.max_restarts)
        except (RuntimeError, PermissionError, ValueError) as e:
            print(f"tfsparse-run: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if spec is not None and not args.dry_run:
        try:
            return run_on_network(args.np, spec, command, args.mpi_args, mpi_flags, args.max_restarts)
        except (RuntimeError, PermissionError, ValueError) as e:
            print(f"tfsparse-run: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if args.dry_run:
        print(shlex.join(cmd))
        if spec is not None or args.emulate_hosts is not None:
            print("tfsparse-run: --dry-run prints the job's mpirun command alone: --net and --emulate-hosts set up "
                  "their network namespaces (and ssh daemons) when the job runs, and wrap this command then",
                  file=sys.stderr)
        return 0
    problems = check_job_hosts(args.hosts, mpi_flags + shlex.split(args.mpi_args), command, env)
    if problems:
        for line in problems:
            print(f"tfsparse-run: {line}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    try:
        return run_locally(cmd, env, args.max_restarts)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
