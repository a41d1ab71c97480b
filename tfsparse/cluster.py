"""The hosts of a ``tfsparse-run`` job: their slots, and a check over ssh before mpirun starts.

>>> hosts = parse_host_list("node1:4,node2:4")     # [("node1", 4), ("node2", 4)]
>>> total_slots(hosts)                              # 8: -np 8 needs no --oversubscribe
>>> problems = check_hosts(["node2"], "/opt/venv/bin/python")
>>> # [] or one line per host that cannot run the job: not reachable over ssh within seconds,
>>> # asking for a password, or without the program

Open MPI starts the ranks of other hosts through ssh (``plm_rsh_agent``) without a terminal, so a
host that asks for a password or a host-key confirmation, or that cannot be reached, makes
``mpirun`` wait a long time or for ever; the program (the launching machine's absolute path of the
interpreter) must exist on every host.  :func:`check_hosts` asks each
host once, all at the same time, with ``BatchMode`` (no prompts) and a connection timeout.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

#: seconds a host has to answer :func:`check_hosts`
CHECK_TIMEOUT_S = 10.0


def parse_host_list(text: str) -> list[tuple[str, int]]:
    """``-H``'s value as (host, slots) pairs: ``"a:2,b:2"`` -> [("a", 2), ("b", 2)]; a host
    without a count has one slot, and a host named twice has the slots of both (Open MPI's
    reading)."""
    hosts: list[tuple[str, int]] = []
    for part in text.split(","):
        name, sep, count = part.strip().rpartition(":") if ":" in part else (part.strip(), "", "")
        if not name or (sep and not count.isdigit()) or (sep and int(count) < 1):
            raise ValueError(f"-H {text!r}: {part!r} is not a host; accepted: HOST or HOST:SLOTS, separated by "
                             f"commas (e.g. -H node1:4,node2:4)")
        hosts.append((name, int(count) if sep else 1))
    return hosts


def read_hostfile(path: str) -> list[tuple[str, int | None]]:
    """An Open MPI hostfile as (host, slots) pairs; ``None`` where a line gives no ``slots=``
    (Open MPI then counts that host's cores, which only that host knows)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--hostfile {path!r} cannot be read: {e.strerror}") from None
    hosts: list[tuple[str, int | None]] = []
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key in ("slots", "cpu") and value.isdigit():
                slots = int(value)
        hosts.append((words[0], slots))
    return hosts


def total_slots(hosts) -> int | None:
    """The slots of ``hosts`` together; ``None`` when a host's count is unknown."""
    if any(slots is None for _, slots in hosts):
        return None
    return sum(slots for _, slots in hosts)


def local_names() -> set[str]:
    """The names and addresses under which Open MPI treats a host as this machine: its hostname
    (short and qualified), what that resolves to, and the addresses of its interfaces."""
    hostname = socket.gethostname()
    names = {"localhost", "::1", hostname, hostname.split(".")[0]}
    try:
        names.add(socket.getfqdn())
        names.update(info[4][0] for info in socket.getaddrinfo(hostname, None))
    except OSError:
        pass
    try:  # every interface's address (iproute2), where there is one
        listed = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
        names.update(word.split("/")[0] for line in listed.splitlines() for i, word in enumerate(line.split())
                     if i > 0 and line.split()[i - 1] in ("inet", "inet6"))
    except (OSError, subprocess.SubprocessError):
        pass
    return names


def is_local(name: str, here: set[str]) -> bool:
    """Whether the host ``name`` is this machine: one of ``here``, or a loopback address (``127.*``).

    Args:
      name: a host's name or address (without ``user@``).
      here: this machine's names and addresses (:func:`local_names`).

    Returns:
      True when ``name`` is this machine.
    """
    return name in here or name.startswith("127.")


def remote_hosts(hosts) -> list[str]:
    """The distinct hosts of ``hosts`` that are not this machine, in order."""
    here, seen = local_names(), []
    for name, _ in hosts:
        if not is_local(name.rpartition("@")[2], here) and name not in seen:  # user@host: the host's
            seen.append(name)
    return seen


def check_hosts(hosts: list[str], program: str, agent: str = "ssh", timeout: float | None = None) -> list[str]:
    """Asks every host in ``hosts`` at once, over ``agent`` (ssh without prompts, a connection
    timeout), whether it can run ``program``; returns one line per host that cannot (empty: all
    can), within ``timeout`` seconds (default :data:`CHECK_TIMEOUT_S`).  The working directory
    is not checked: Open MPI starts a rank elsewhere when it is missing there, and a script given
    by its absolute path still runs."""
    timeout = CHECK_TIMEOUT_S if timeout is None else float(timeout)
    remote = f"test -x {shlex.quote(program)} || exit 4"
    connect = max(1, int(timeout) - 2)
    asks = {}
    for host in hosts:
        cmd = [*shlex.split(agent), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect}", host, remote]
        try:
            asks[host] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError as e:
            for started in asks.values():
                _end(started)
            return [f"host {host}: {agent!r} cannot be started ({e.strerror}); Open MPI starts the ranks of other "
                    f"hosts through it"]
    deadline = time.monotonic() + timeout
    problems = []
    try:
        for host, ask in asks.items():
            try:
                _, err = ask.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _end(ask)
                problems.append(f"host {host}: no answer over {agent} within {timeout:g} s")
                continue
            problems += _problem(host, ask.returncode, err, program, agent)
    finally:  # interrupted (Ctrl-C): no ssh left behind
        for ask in asks.values():
            if ask.poll() is None:
                _end(ask)
    return problems


def _end(ask: subprocess.Popen) -> None:
    try:
        os.killpg(ask.pid, signal.SIGKILL)  # the agent and anything it started
    except ProcessLookupError:
        pass
    ask.communicate()


def _problem(host: str, code: int, err: str, program: str, agent: str) -> list[str]:
    last = (err or "").strip().splitlines()[-1:] or [""]
    if code == 4:
        return [f"host {host}: has no program {program} (the same Python environment must be at the same path on "
                f"every host)"]
    if code != 0:
        return [f"host {host}: {agent} cannot log in without a prompt ({last[0] or f'exit status {code}'}); "
                f"Open MPI needs key-based ssh to every host, its host key known"]
    return []
