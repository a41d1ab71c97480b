"""``tfsparse-run``: mpirun's own flags pass through, the program keeps its arguments, the help
shows examples, and launchers are found next to the running Python (a venv need not be active).

Building a command line needs no MPI job; one real launch (under the MPI lock) checks that a
``-x`` given to tfsparse-run reaches every rank."""
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from mpi_harness import launcher, run_locked
from tfsparse import run


def dry_run(capsys, *argv):
    """The mpirun command line ``tfsparse-run --dry-run argv...`` would execute."""
    assert run.main(["--dry-run", *argv]) == 0
    return shlex.split(capsys.readouterr().out)


def test_dry_run_with_an_emulated_network_says_what_it_leaves_out(capsys):
    """--dry-run prints the mpirun command alone; with --net or --emulate-hosts it says on stderr
    that the emulation wraps that command when the job runs."""
    for extra in (["--net", "1gbit"], ["--emulate-hosts", "2"], []):
        assert run.main(["--dry-run", "-np", "2", *extra, "python", "t.py"]) == 0
        out, err = capsys.readouterr()
        assert shlex.split(out)[-1] == "t.py"
        assert ("--net and --emulate-hosts set up their network namespaces" in err) == bool(extra)


def usage_error(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        run.main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


def contains(seq, part):
    return any(seq[i:i + len(part)] == part for i in range(len(seq)))


def test_mpirun_flags_before_the_program_reach_mpirun(capsys):
    cmd = dry_run(capsys, "-np", "2", "-x", "FOO=1", "--mca", "btl", "self,vader,tcp",
                  "--map-by", "slot", "--tag-output", "-x", "BAR", "python", "train.py")
    program = cmd.index("train.py") - 1
    assert cmd[program] == shutil.which("python") and cmd[program + 1:] == ["train.py"]
    flags = cmd[:program]
    for part in (["-x", "FOO=1"], ["--mca", "btl", "self,vader,tcp"], ["--map-by", "slot"],
                 ["--tag-output"], ["-x", "BAR"]):
        assert contains(flags, part), (part, flags)
    assert flags[1:3] == ["-np", "2"] and "--bind-to" in flags  # tfsparse-run's own flags stay


def test_everything_from_the_program_on_belongs_to_the_program(capsys):
    cmd = dry_run(capsys, "-np", "3", "-x", "A=1", sys.executable, "train.py", "-x", "B", "--mca",
                  "--net", "1gbit", "-np", "9", "--dry-run")
    program = cmd.index(sys.executable)
    assert cmd[program:] == [sys.executable, "train.py", "-x", "B", "--mca", "--net", "1gbit", "-np", "9",
                             "--dry-run"]
    assert cmd[:program].count("-np") == 1 and cmd[cmd.index("-np") + 1] == "3"
    assert "/bin/sh" not in cmd  # the program's --net is not tfsparse-run's


def test_split_argv_separates_own_options_mpirun_flags_and_program():
    own, mpi, prog = run.split_argv(["-np", "4", "--net=1gbit", "-H", "a:2,b:2", "--mca", "pml", "ob1",
                                     "-x", "V=-1", "--timeout", "60", "--oversubscribe", "prog", "-np", "2"])
    assert own == ["-np", "4", "--net=1gbit", "-H", "a:2,b:2"]
    assert mpi == ["--mca", "pml", "ob1", "-x", "V=-1", "--timeout", "60", "--oversubscribe"]
    assert prog == ["prog", "-np", "2"]
    # Open MPI's single-dash spellings of long flags and --flag=value forms are known too
    assert run.split_argv(["-np", "2", "-mca", "btl", "tcp", "--map-by=node", "p"]) == (
        ["-np", "2"], ["-mca", "btl", "tcp", "--map-by=node"], ["p"])


def test_an_unknown_flag_needs_a_double_dash_and_then_passes_through(capsys):
    err = usage_error(capsys, "-np", "2", "--brand-new", "v", "python", "train.py")
    assert "'--brand-new'" in err and "'v'" in err  # names the flag and the word it cannot place
    assert "--brand-new=VALUE" in err and "-- python train.py" in err  # and what is accepted
    cmd = dry_run(capsys, "-np", "2", "--brand-new", "v", "-x", "A=1", "--", "python", "train.py", "--", "x")
    program = cmd.index("train.py") - 1
    assert cmd[program - 4:program] == ["--brand-new", "v", "-x", "A=1"] and cmd.count("--") == 1
    assert cmd[program + 1:] == ["train.py", "--", "x"]
    cmd = dry_run(capsys, "-np", "2", "--brand-new=v", "python", "t.py")  # --flag=value needs no --
    assert cmd[-3:-1] == ["--brand-new=v", shutil.which("python")]


@pytest.mark.parametrize("argv, words", [
    (["-np", "2", "-x"], ["'-x' takes 1 value", "got []", "-x FOO=1"]),
    (["-np", "2", "--mca", "btl"], ["'--mca' takes 2 values", "got ['btl']"]),
    (["-np", "2", "-x", "--tag-output", "python"], ["'-x' takes 1 value", "got ['--tag-output']"]),
    (["-np", "2", "-x", "A=1"], ["no command given"]),
    (["-np", "0", "python"], ["-np 0", ">= 1"]),
])
def test_bad_command_lines_stop_with_a_usage_error_naming_the_problem(capsys, argv, words):
    err = usage_error(capsys, *argv)
    for word in words:
        assert word in err, err


def test_mpi_args_string_still_works_and_callers_flags_replace_the_defaults(capsys):
    cmd = dry_run(capsys, "-np", "2", "--mpi-args", "-x A=2 --mca btl self,tcp", "python", "t.py")
    assert "A=2" in cmd and cmd[cmd.index("btl") + 1] == "self,tcp"
    assert cmd[cmd.index("--bind-to") + 1] == "none" and "--oversubscribe" in cmd
    cmd = dry_run(capsys, "-np", "2", "--bind-to", "core", "--nooversubscribe", "python", "t.py")
    assert cmd.count("--bind-to") == 1 and cmd[cmd.index("--bind-to") + 1] == "core"
    assert "--oversubscribe" not in cmd and "--nooversubscribe" in cmd
    cmd = dry_run(capsys, "-np", "2", "--host", "a:1,b:1", "python", "t.py")  # mpirun's spelling, ours
    assert cmd[cmd.index("-H") + 1] == "a:1,b:1" and "--host" not in cmd


def test_help_shows_examples_in_plain_text():
    done = subprocess.run([sys.executable, "-m", "tfsparse.run", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "``" not in text and ":mod:" not in text  # no reST markup
    assert "examples:" in text
    for example in ("tfsparse-run -np 4 python train.py", "tfsparse-run -np 4 --net 1gbit python train.py",
                    "tfsparse-run -np 2 -x FOO=1 --mca btl self,vader,tcp python train.py",
                    "-- python train.py"):
        assert example in text, example
    # RawDescriptionHelpFormatter keeps the examples' lines as written
    assert "\n  tfsparse-run -np 4 --net 1gbit python train.py\n" in text


def _fake_program(folder, name):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_launchers_are_found_next_to_the_running_python_before_path(tmp_path, monkeypatch):
    """``make test PYTHON=venv/bin/python`` without activating the venv: horovodrun, mpirun and
    tfsparse-run live in venv/bin, which is not on PATH."""
    venv_bin, other_bin = tmp_path / "venv" / "bin", tmp_path / "elsewhere"
    beside = _fake_program(venv_bin, "horovodrun")
    on_path = _fake_program(other_bin, "horovodrun")
    only_on_path = _fake_program(other_bin, "only-on-path")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(other_bin))
    assert launcher("horovodrun") == str(beside) != str(on_path)
    assert launcher("only-on-path") == str(only_on_path)
    with pytest.raises(FileNotFoundError, match="not-installed is neither next to"):
        launcher("not-installed")
    mpirun = _fake_program(venv_bin, "mpirun")  # tfsparse-run picks its mpirun the same way
    assert run.build_command(2, ["/bin/true"])[0][0] == str(mpirun)


@pytest.mark.mpi
def test_a_pass_through_x_reaches_every_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("TFSPARSE_TEST_FOO", raising=False)
    script = tmp_path / "env.py"
    script.write_text("import os, sys\nfrom mpi4py import MPI\nr = MPI.COMM_WORLD.rank\n"
                      "open(f'{sys.argv[1]}/rank{r}.txt', 'w').write(os.environ.get('TFSPARSE_TEST_FOO', 'unset'))\n")
    run_locked([launcher("tfsparse-run"), "-np", "2", "-x", "TFSPARSE_TEST_FOO=from-x", "--tag-output",
                sys.executable, str(script), str(tmp_path)], timeout=120)
    assert sorted(p.read_text() for p in tmp_path.glob("rank*.txt")) == ["from-x", "from-x"]


# -- --max-restarts: relaunch the whole job when it fails ------------------------------------

def test_max_restarts_is_tfsparse_runs_own_option_not_mpiruns(capsys):
    assert run.split_argv(["-np", "2", "--max-restarts", "3", "--tag-output", "p", "--max-restarts", "1"]) == (
        ["-np", "2", "--max-restarts", "3"], ["--tag-output"], ["p", "--max-restarts", "1"])
    assert "max-restarts" not in run.MPIRUN_FLAGS  # mpirun's unrelated flag is not passed through
    assert run.make_parser().parse_args(["-np", "2", "--max-restarts=2"]).max_restarts == 2
    assert run.make_parser().parse_args(["-np", "2"]).max_restarts == 0
    cmd = dry_run(capsys, "-np", "2", "--max-restarts", "3", "python", "t.py", "--max-restarts", "1")
    assert cmd.count("--max-restarts") == 1 and cmd[-3:] == ["t.py", "--max-restarts", "1"]  # the program's
    cmd = dry_run(capsys, "-np", "2", "--mpi-args", "--max-restarts 2", "python", "t.py")  # mpirun's own
    assert contains(cmd, ["--max-restarts", "2", shutil.which("python")])


@pytest.mark.parametrize("value", ["-1", "two", "1.5", ""])
def test_a_bad_max_restarts_is_a_usage_error_naming_the_value(capsys, value):
    err = usage_error(capsys, "-np", "2", "--max-restarts", value, "python", "t.py")
    assert f"--max-restarts: {value!r} is not valid; accepted: an integer >= 0" in err, err


@pytest.mark.parametrize("codes, max_restarts, calls, result", [
    ([0], 3, 1, 0),  # success: launched once
    ([3, 0], 3, 2, 0),  # one failure, then success
    ([3, 137, 5], 2, 3, 5),  # every launch fails: N restarts, the last status
    ([3], 0, 1, 3),  # the default: no restart
])
def test_run_with_restarts_relaunches_a_failed_job_up_to_n_times(capsys, codes, max_restarts, calls, result):
    done = []

    def launch():
        done.append(codes[len(done)])
        return done[-1]

    assert run.run_with_restarts(launch, max_restarts) == result and len(done) == calls
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"tfsparse-run: the job failed (exit status {codes[i]}); restart {i + 1} of {max_restarts}"
                     for i in range(calls - 1)]


def test_an_interrupted_job_is_not_relaunched(capsys):
    assert run.run_with_restarts(lambda: 130, 5, interrupted=lambda: True) == 130
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("banner", ["once", "all"])
def test_a_signal_while_a_restart_starts_ends_the_new_job(monkeypatch, banner):
    """Ctrl-C (here SIGTERM) after the previous job ended, while the next one starts: passed on to
    the new job as soon as it runs, which ends at once (before, it ran to its end unsignalled)."""
    job = run._Launcher()
    job.child = subprocess.Popen(["true"])  # the previous job, ended
    job.child.wait()
    real = subprocess.Popen

    def popen(*args, **kwargs):  # the signal lands after run()'s check, before the new child exists
        job._forward(signal.SIGTERM, None)
        return real(*args, **kwargs)

    monkeypatch.setattr(run.subprocess, "Popen", popen)
    start = time.monotonic()
    code = job.run(["sleep", "60"], {**os.environ, "TFSPARSE_TF_BANNER": banner})
    assert code == 128 + signal.SIGTERM and time.monotonic() - start < 30
    assert job.interrupted and job.run(["sleep", "60"], dict(os.environ)) == 130  # no restart


def _failing_mpirun(folder, fails):
    """A fake mpirun next to the running Python: exits 3 the first ``fails`` times, then 0; each
    launch appends a line to $FAKE_MPIRUN_LOG."""
    path = _fake_program(folder, "mpirun")
    path.write_text('#!/bin/sh\necho launch >> "$FAKE_MPIRUN_LOG"\n'
                    f'[ "$(wc -l < "$FAKE_MPIRUN_LOG")" -gt {fails} ] && exit 0\nexit 3\n')
    return path


class _Network:
    """Stands in for tfsparse.network.EmulatedNetwork (a real one needs root): records that it was
    built and removed, adds nothing to the command line."""
    built: list = []
    subnet = "10.77.0.0/24"

    def __init__(self, np_, spec):
        self.built.append(str(spec))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.built.append("removed")

    def mpirun_args(self):
        return []

    def environment(self):
        return {}

    def wrap(self, command):
        return command


@pytest.mark.parametrize("net", [False, True])
@pytest.mark.parametrize("fails, max_restarts, status", [(1, 1, 0), (2, 1, 3), (1, 0, 3), (0, 2, 0)])
def test_tfsparse_run_relaunches_mpirun_with_and_without_net(tmp_path, monkeypatch, capsys, net, fails,
                                                             max_restarts, status):
    """The whole mpirun command relaunched (a fake mpirun that fails ``fails`` times); with --net
    on the same emulated network, built once and removed once."""
    _failing_mpirun(tmp_path / "venv" / "bin", fails)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    log = tmp_path / "launches.log"
    monkeypatch.setenv("FAKE_MPIRUN_LOG", str(log))
    monkeypatch.setattr(_Network, "built", [])
    monkeypatch.setattr(run, "EmulatedNetwork", _Network)
    argv = ["-np", "2", *(["--net", "1gbit"] if net else []), "--max-restarts", str(max_restarts), "/bin/true"]
    code = run.main(argv)
    assert code == status
    launches = min(fails, max_restarts) + 1
    assert log.read_text().count("launch") == launches
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "restart" in line] == [
        f"tfsparse-run: the job failed (exit status 3); restart {i} of {max_restarts}" for i in range(1, launches)]
    assert _Network.built == (["1gbit", "removed"] if net else [])


def test_an_mpirun_that_outlives_its_ranks_is_ended(capsys):
    """Open MPI 4.1's mpirun can hang after every rank has ended (an MPI_Abort whose help message
    its runtime fails to unpack): tfsparse-run ends a launcher that outlives all its children by
    the linger time and returns 1, saying so; a launcher that never had children (still starting)
    or exits by itself is left alone."""
    import time

    lingering = subprocess.Popen(["sh", "-c", "sleep 1; exec sleep 60"])  # a child, then alone
    started = time.monotonic()
    assert run.wait_for_launcher(lingering, linger=1.0, poll=0.1) == 1
    assert time.monotonic() - started < 10 and lingering.poll() is not None
    assert "was still running 1 s after the last of its ranks had ended" in capsys.readouterr().err

    alone = subprocess.Popen(["sh", "-c", "exec sleep 2"])  # never has children: not ended
    assert run.wait_for_launcher(alone, linger=0.5, poll=0.1) == 0
    finishing = subprocess.Popen(["sh", "-c", "sleep 1; exit 3"])
    assert run.wait_for_launcher(finishing, linger=0.5, poll=0.1) == 3
    assert capsys.readouterr().err == ""


# -- hosts: slots, forwarded variables, the check over ssh --------------------------------------

@pytest.fixture
def outside_allocation(monkeypatch):
    """No batch system's allocation in the environment (the tests may run inside one)."""
    for name in run.BATCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_oversubscribe_only_beyond_the_hosts_slots(capsys, tmp_path, outside_allocation):
    """On this machine alone every job may oversubscribe; with -H or a hostfile only a job with
    more ranks than the hosts' slots (the slots, not this machine's cores, decide)."""
    assert "--oversubscribe" in dry_run(capsys, "-np", "2", "python", "t.py")
    assert "--oversubscribe" not in dry_run(capsys, "-np", "8", "-H", "n1:4,n2:4", "python", "t.py")
    assert "--oversubscribe" in dry_run(capsys, "-np", "9", "-H", "n1:4,n2:4", "python", "t.py")
    assert "--oversubscribe" not in dry_run(capsys, "-np", "2", "-H", "n1,n2", "python", "t.py")  # 1 slot each
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nn1 slots=2\nn2 slots=2 max_slots=4\n\n")
    assert "--oversubscribe" not in dry_run(capsys, "-np", "4", "--hostfile", str(hostfile), "python", "t.py")
    assert "--oversubscribe" in dry_run(capsys, "-np", "5", "--hostfile", str(hostfile), "python", "t.py")
    hostfile.write_text("n1\nn2\n")  # no slots=: Open MPI counts each host's cores; tfsparse-run adds nothing
    assert "--oversubscribe" not in dry_run(capsys, "-np", "64", "--hostfile", str(hostfile), "python", "t.py")
    err = usage_error(capsys, "-np", "2", "-H", "n1:x", "python", "t.py")
    assert "-H 'n1:x': 'n1:x' is not a host; accepted: HOST or HOST:SLOTS" in err
    err = usage_error(capsys, "-np", "2", "--hostfile", str(tmp_path / "missing"), "python", "t.py")
    assert "--hostfile" in err and "cannot be read" in err


def test_inside_a_batch_allocation_the_allocations_slots_decide(capsys, outside_allocation):
    """Under Slurm (or PBS, LSF, Grid Engine) with no host list Open MPI reads the allocation's
    hosts and slots: no --oversubscribe, so a job larger than the allocation is refused."""
    monkeypatch = outside_allocation
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    assert "--oversubscribe" not in dry_run(capsys, "-np", "8", "python", "t.py")
    assert "--oversubscribe" in dry_run(capsys, "-np", "9", "-H", "n1:4,n2:4", "python", "t.py")  # -H decides
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    monkeypatch.setenv("PBS_NODEFILE", "/var/spool/pbs/aux/1.server")
    assert "--oversubscribe" not in dry_run(capsys, "-np", "8", "python", "t.py")


def test_tfsparse_numba_and_search_path_variables_reach_every_rank(capsys, monkeypatch):
    monkeypatch.setenv("TFSPARSE_STALL_SECONDS", "30")
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/tmp/numba-cache")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/lib")
    cmd = dry_run(capsys, "-np", "2", "-H", "n1:1,n2:1", "-x", "MINE=1", "python", "t.py")
    for var in ("PATH", "LD_LIBRARY_PATH", "TFSPARSE_STALL_SECONDS", "NUMBA_CACHE_DIR", "MINE=1"):
        assert contains(cmd, ["-x", var]), (var, cmd)


FAKE_SSH = """#!/bin/sh
# ssh as Open MPI would run it: options, the host, the remote command (run here, in sh)
while [ "$1" = "-o" ]; do shift 2; done
host=$1; shift
case $host in
  down*) sleep 60 ;;
  locked*) echo "me@$host: Permission denied (publickey,password)." >&2; exit 255 ;;
  *) exec sh -c "$1" ;;
esac
"""


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    ssh = folder / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{__import__('os').environ['PATH']}")
    return ssh


def test_hosts_that_cannot_start_ranks_are_named_within_seconds(fake_ssh, tmp_path):
    import time

    from tfsparse import cluster

    t0 = time.monotonic()
    problems = cluster.check_hosts(["good", "down1", "locked1"], sys.executable, timeout=3)
    assert time.monotonic() - t0 < 6  # every host asked at once
    assert problems == [
        "host down1: no answer over ssh within 3 s",
        "host locked1: ssh cannot log in without a prompt (me@locked1: Permission denied (publickey,password).); "
        "Open MPI needs key-based ssh to every host, its host key known"]
    assert cluster.check_hosts(["good"], str(tmp_path / "nopython"), timeout=3) == [
        f"host good: has no program {tmp_path / 'nopython'} (the same Python environment must be at the same path "
        f"on every host)"]


def test_the_launcher_stops_before_mpirun_when_a_host_cannot_start_its_ranks(fake_ssh, capsys, monkeypatch):
    """tfsparse-run asks the job's other hosts first (not localhost, not this machine's name) and
    does not start mpirun when one cannot: one line per host on stderr, exit status 1."""
    monkeypatch.setattr(run, "run_locally", lambda *a, **k: pytest.fail("mpirun started"))
    monkeypatch.setattr("tfsparse.cluster.CHECK_TIMEOUT_S", 3.0)
    assert run.main(["-np", "3", "-H", "localhost:1,locked9:1,good:1", sys.executable, "t.py"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "tfsparse-run: host locked9: ssh cannot log in without a prompt (me@locked9: Permission denied "
        "(publickey,password).); Open MPI needs key-based ssh to every host, its host key known"]
    # another agent than ssh is not second-guessed; TFSPARSE_HOST_CHECK=0 skips the check; this
    # machine under any of its names or addresses is not asked
    assert run.check_job_hosts("locked9:1", ["--mca", "plm_rsh_agent", "rsh"], ["python"], {}) == []
    assert run.check_job_hosts("locked9:1", [], ["python"], {"TFSPARSE_HOST_CHECK": "0"}) == []
    import socket

    from tfsparse import cluster
    here = socket.gethostbyname(socket.gethostname())
    assert cluster.remote_hosts([(here, 1), ("127.0.1.1", 1), ("me@localhost", 1), ("me@n2", 1)]) == ["me@n2"]


BANNER = [b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
          b"I0000 00:00:1795900094.722911    3428 port.cc:153] oneDNN custom operations are on. You may see ...\n"]


def test_tensorflows_start_up_notices_pass_once_and_everything_else_as_it_came():
    from tfsparse.banner import BannerFilter

    again = [b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
             b"I0000 00:00:1795900097.214427    3429 port.cc:153] oneDNN custom operations are on. You may see ...\n"]
    other = [b"I0000 00:00:1795900097.3    3429 other.cc:1] an INFO line of another file\n", b"rank 1: epoch 1\n"]
    banner = BannerFilter()
    stream = b"".join(BANNER + again + other + BANNER + other)
    # in pieces cut anywhere, even inside a line: the same result
    out = b"".join(banner.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + banner.flush()
    assert out == b"".join(BANNER + other + other)
    # an unfinished line passes at once -- a prompt, a progress bar redrawn after a carriage
    # return -- unless it could still become a notice: that is held until its newline or a flush
    assert banner.feed(b"Password:") == b"Password:" and banner.flush() == b""
    assert banner.feed(b" 10%|#    |\r 20%|##") == b" 10%|#    |\r 20%|##"
    assert banner.feed(b"\n" + BANNER[1][:-1]) == b"\n" and banner.flush() == b""  # a repeat, held
    assert banner.feed(b"WARNING: All log") == b"" and banner.feed(b" messages are off\n") == \
        b"WARNING: All log messages are off\n"


def test_the_pump_filters_a_pipe_to_its_end(tmp_path):
    import os

    from tfsparse.banner import filtered_stderr, start_pump

    read, write = os.pipe()
    with open(tmp_path / "err", "wb") as sink:
        thread = start_pump(read, sink.fileno())
        for piece in [*BANNER, b"epoch 1\n", *BANNER, b"no newline"]:
            os.write(write, piece)
        os.close(write)
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert (tmp_path / "err").read_bytes() == b"".join(BANNER) + b"epoch 1\nno newline"
    assert filtered_stderr({}) and not filtered_stderr({"TFSPARSE_TF_BANNER": "all"})
    # a reader that went away (tfsparse-run ... | head): the pump reads on to the end, so no rank
    # blocks on a full pipe, and closes its end
    read, write = os.pipe()
    gone_r, gone_w = os.pipe()
    os.close(gone_r)
    thread = start_pump(read, gone_w)
    for _ in range(64):
        os.write(write, b"x" * 4095 + b"\n")  # 256 KiB: more than a pipe holds
    os.close(write)
    thread.join(timeout=10)
    os.close(gone_w)
    assert not thread.is_alive()
    with pytest.raises(OSError):
        os.fstat(read)  # closed by the pump
