"""Runs real ``mpirun`` jobs from tests: one lock (no two MPI jobs at once on a small
machine), a hard timeout on every run (a hang fails the test, it never blocks CI),
and per-rank results collected from files the workers write.

Workers write ``np.savez`` / JSON results into ``$TFSPARSE_TEST_OUT`` with
:func:`save_result`; the test reads them with the returned list.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpi_jobs import kill_session, mpi_lock, session_processes
from tfsparse.run import LauncherWatch, build_command, find_program

REPO = Path(__file__).resolve().parents[1]


class MPIJobError(AssertionError):
    pass


def launcher(name: str) -> str:
    """The absolute path of a launcher (``horovodrun``, ``mpirun``, ``tfsparse-run``): the one
    next to the Python running the tests first -- a virtual environment's bin/, activated or
    not (``make test PYTHON=venv/bin/python``) -- then the one on PATH."""
    path = find_program(name)
    if path is None:
        raise FileNotFoundError(f"{name} is neither next to {sys.executable} nor on PATH; "
                                "install it (bash tools/install.sh --horovod)")
    return path


def mpirun(nproc: int, script: str | Path, *args, timeout: float = 300, env: dict | None = None,
           expect_fail: bool = False):
    """Runs ``python script args`` on ``nproc`` ranks; returns (per-rank results, output text)."""
    script = Path(script)
    if not script.is_absolute():
        script = REPO / "tests" / "workers" / script
    what = f"mpirun -np {nproc} {script.name} {args}"
    with tempfile.TemporaryDirectory(prefix="tfsparse-mpi-") as out:
        cmd, launch_env = build_command(nproc, [sys.executable, str(script), *map(str, args)])
        # the launcher's environment (run-as-root, Open MPI's help aggregation off: see
        # tfsparse.run.build_command), then the tests' own settings
        job_env = {**launch_env, "TFSPARSE_TEST_OUT": out, "TF_CPP_MIN_LOG_LEVEL": "3",
                   "OMPI_MCA_btl": "self,vader,tcp", "OMPI_MCA_rmaps_base_oversubscribe": "1", **(env or {})}
        code, text = run_job(cmd, job_env, timeout, what)
        if expect_fail and code == 0:
            raise MPIJobError(f"expected {what} to fail, it succeeded:\n{_tail(text)}")
        if not expect_fail and code != 0:
            raise MPIJobError(f"{what} failed ({code}):\n{_tail(text)}")
        return [load_result(out, r) for r in range(nproc)], text


def run_locked(cmd: list[str], timeout: float = 120, env: dict | None = None) -> str:
    """Runs any launcher command line (horovodrun, tfsparse-run) under the MPI lock and a timeout."""
    code, text = run_job(cmd, env or {}, timeout, str(cmd))
    if code != 0:
        raise MPIJobError(f"{cmd} failed ({code}):\n{_tail(text)}")
    return text


def job_env(env: dict | None = None) -> dict:
    """The environment of a launched job: run-as-root flags, the repo and tests/ importable."""
    full_env = dict(os.environ)
    for var in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        full_env.setdefault(var, "1")
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"),
                                              full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return full_env


def run_job(cmd, env: dict | None = None, timeout: float = 120, what: str = ""):
    """Holds the lock, runs ``cmd`` in a session of its own; kills every process of the session
    on timeout (the ranks too: Open MPI gives each a process group of its own).  A launcher
    still there :data:`tfsparse.run.LINGER_S` seconds after all its ranks ended is ended the
    way tfsparse-run ends one (:class:`tfsparse.run.LauncherWatch`): exit status 1, and a line
    saying so at the end of the output.  Returns (exit status, output)."""
    full_env = job_env(env)
    with mpi_lock(), _logged(what or str(cmd)):
        proc = subprocess.Popen(cmd, env=full_env, cwd=str(REPO), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        watch = LauncherWatch(proc.pid)  # an mpirun left alone after its ranks ended (Open MPI 4.1)
        while True:
            try:
                text, _ = proc.communicate(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                return proc.returncode, text
            except subprocess.TimeoutExpired:
                if watch.lingers():
                    kill_session(proc.pid)
                    text, _ = proc.communicate()
                    return 1, f"{text}\ntests: {watch.message(Path(cmd[0]).name)}\n"
                if time.monotonic() >= deadline:
                    break
        running = session_processes(proc.pid)  # timed out: a hang
        left = kill_session(proc.pid)
        text, _ = proc.communicate()
        listing = "".join(f"\n  {pid} {line[:200]}" for pid, line in running.items())
        raise MPIJobError(f"{what or cmd} timed out after {timeout}s (a hang); still running then "
                          f"(pid, state, command):{listing}\n"
                          + (f"still there after SIGKILL: {sorted(left)}\n" if left else "")
                          + _tail(text))


@contextlib.contextmanager
def _logged(what: str):
    """With ``TFSPARSE_TEST_LAUNCH_LOG=path``: appends one JSON line per launch -- the test, the
    command, its seconds -- where the suite's time goes, launch by launch (docs/tests.md)."""
    log = os.environ.get("TFSPARSE_TEST_LAUNCH_LOG")
    start = time.monotonic()
    try:
        yield
    finally:
        if log:
            line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "what": what[:300],
                    "seconds": round(time.monotonic() - start, 2)}
            try:
                with open(log, "a") as f:
                    f.write(json.dumps(line) + "\n")
            except OSError:
                pass  # a log that cannot be written never hides the launch's own outcome


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def save_result(rank: int, **values) -> None:
    """Called by workers: stores arrays (npz) and plain values (json) for the test."""
    out = Path(os.environ["TFSPARSE_TEST_OUT"])
    arrays = {k: np.asarray(v) for k, v in values.items() if isinstance(v, np.ndarray)}
    plain = {k: v for k, v in values.items() if not isinstance(v, np.ndarray)}
    np.savez(out / f"rank{rank}.npz", **arrays)
    (out / f"rank{rank}.json").write_text(json.dumps(plain))


def interrupt_when_up(cmd, marker, ranks: int, check=None, timeout: float = 60) -> tuple[int, int]:
    """Starts launcher command ``cmd`` (holding the MPI lock) whose ranks each touch
    ``<marker><rank>`` once up, then wait; once all ``ranks`` have, runs ``check(pid)`` (the
    launcher's pid) and sends it SIGINT (Ctrl-C).  Returns ``(exit code, pid)``; a job that ends
    or does not come up within ``timeout`` seconds fails the test with its output."""
    import signal

    with mpi_lock(), _logged(str(cmd)):
        proc = subprocess.Popen(cmd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout
            while not all(Path(f"{marker}{r}").exists() for r in range(ranks)):
                if time.monotonic() > deadline or proc.poll() is not None:
                    proc.kill()
                    raise MPIJobError(f"the job did not come up:\n{_tail(proc.communicate(timeout=30)[0])}")
                time.sleep(0.2)
            if check is not None:
                check(proc.pid)
            proc.send_signal(signal.SIGINT)
            return proc.wait(timeout=timeout), proc.pid
        finally:
            if proc.poll() is None:
                proc.kill()


def error_of(fn) -> str:
    """For workers: ``"Type: message"`` of the ValueError or AttributeError ``fn()`` raises, or ""."""
    try:
        fn()
    except (ValueError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def load_result(out, rank: int):
    out = Path(out)
    res = {}
    if (out / f"rank{rank}.json").exists():
        res.update(json.loads((out / f"rank{rank}.json").read_text()))
    if (out / f"rank{rank}.npz").exists():
        with np.load(out / f"rank{rank}.npz") as z:
            res.update({k: z[k] for k in z.files})
    return res
