"""``tfsparse warmup`` fills the kernels' cache ahead of the first job; the first exchange of a
job says on rank 0 when it has to compile them instead (a long silent first step otherwise)."""
import subprocess
import sys
import time

from tfsparse import exchange, exchange_build


def test_warmup_command_readies_the_kernels_and_says_where_they_are_cached():
    done = subprocess.run([sys.executable, "-m", "tfsparse.cli", "warmup"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "the Numba kernels are ready in" in done.stdout and "cached" in done.stdout
    version = subprocess.run([sys.executable, "-m", "tfsparse.cli", "--version"], capture_output=True, text=True,
                             timeout=60)
    assert version.stdout.strip().startswith("tfsparse 0.")


def test_a_slow_warmup_is_announced_on_rank_zero_only(monkeypatch, capsys):
    from tfsparse.ops import cpu

    monkeypatch.setattr(cpu, "warmup", lambda: time.sleep(0.3))
    monkeypatch.setattr(exchange_build, "COMPILE_NOTICE_S", 0.05)
    exchange_build._warm_kernels.__wrapped__(False)  # other ranks: silent
    assert capsys.readouterr().out == ""
    exchange_build._warm_kernels.__wrapped__(True)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tfsparse: compiling the Numba kernels") and "tfsparse warmup" in out[0]
    assert out[1].startswith("tfsparse: kernels compiled in") and len(out) == 2
    monkeypatch.setattr(cpu, "warmup", lambda: None)  # cached: nothing said
    monkeypatch.setattr(exchange_build, "COMPILE_NOTICE_S", 5.0)
    exchange_build._warm_kernels.__wrapped__(True)
    assert capsys.readouterr().out == ""


def test_the_start_up_line_names_what_applies(capsys):
    """Rank 0's start-up line: the density only where something is left out, the memory only
    where it could keep something (dense float32 keeps nothing); auto says it measures first."""
    import numpy as np

    from tfsparse.collectives import InProcessWorld

    def line(**kwargs):
        def fn(comm):
            ex = exchange.GradientExchange(communicator=comm, **kwargs)
            ex.exchange_numpy([np.ones(10, np.float32)])
            ex.close()
        capsys.readouterr()
        InProcessWorld(2).run(fn)
        return [x for x in capsys.readouterr().out.splitlines() if x.startswith("tfsparse 0.")]

    dense = line(algorithm="dense")
    assert len(dense) == 1 and "2 ranks on 1 host" in dense[0], dense
    assert "algorithm='dense' wire=float32, plan=fused" in dense[0]
    assert "algorithm='dense' wire=float16 memory=residual," in line(algorithm="dense", wire_dtype="float16")[0]
    assert "algorithm='gtopk' density=0.05 wire=float32 memory=residual," in line(algorithm="gtopk", density=0.05)[0]
    assert "algorithm='auto' (measures 10 rounds, then chooses)" in line(algorithm="auto")[0]
    # gradient dropping (a sparse algorithm that keeps nothing) says so
    assert "algorithm='topk' density=0.05 wire=float32 memory=none," in line(algorithm="topk", density=0.05,
                                                                             memory="none")[0]
