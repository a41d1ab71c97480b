"""``tfsparse-run``: mpirun's own flags pass through, the program keeps its arguments, the help
shows examples, and launchers are found next to the running Python (a venv need not be active).

Building a command line needs no MPI job; one real launch (under the MPI lock) checks that a
``-x`` given to tfsparse-run reaches every rank."""
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from mpi_harness import launcher, run_locked
from tfsparse import run


def dry_run(capsys, *argv):
    """The mpirun command line ``tfsparse-run --dry-run argv...`` would execute."""
    assert run.main(["--dry-run", *argv]) == 0
    return shlex.split(capsys.readouterr().out)


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
