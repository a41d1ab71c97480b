"""Unit tests of the transport layer on the in-process world (threads), incl. byte accounting."""
import numpy as np
import pytest

from tfsparse.collectives import InProcessWorld, split_counts
from tfsparse.collectives.communicator import binomial_children


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_allreduce_sum_is_identical_and_counts_ring_volume(P):
    world = InProcessWorld(P)
    data = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) for r in range(P)]

    def fn(comm):
        return comm.allreduce(data[comm.rank]), comm.bytes_sent

    out = world.run(fn)
    ref = np.sum(np.stack(data).astype(np.float64), axis=0)
    for res, nbytes in out:
        np.testing.assert_allclose(res, ref, rtol=1e-5, atol=1e-5)
        assert np.array_equal(res, out[0][0])
        assert nbytes == (2 * 1001 * 4 * (P - 1) // P if P > 1 else 0)


@pytest.mark.parametrize("op,fn_ref", [("max", np.max), ("min", np.min)])
def test_allreduce_max_min(op, fn_ref):
    world = InProcessWorld(3)
    out = world.run(lambda c: c.allreduce(np.array([c.rank, -c.rank], dtype=np.int64), op=op))
    ref = fn_ref(np.array([[r, -r] for r in range(3)]), axis=0)
    for o in out:
        assert np.array_equal(o, ref)


def test_allreduce_rejects_unknown_op():
    world = InProcessWorld(1)
    with pytest.raises(ValueError, match="op='prod'"):
        world.comms[0].allreduce(np.ones(2), op="prod")


def test_allreduce_keeps_scalar_shape():
    out = InProcessWorld(2).run(lambda c: c.allreduce(np.float64(c.rank + 1)))
    assert all(o.shape == () and o == 3.0 for o in out)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_allgather_variable_sizes_and_volume(P):
    world = InProcessWorld(P)
    sizes = [3 * r + 1 for r in range(P)]

    def fn(comm):
        return comm.allgather(np.full(sizes[comm.rank], comm.rank, dtype=np.float32)), comm.bytes_sent

    for rank, (parts, nbytes) in enumerate(world.run(fn)):
        assert [p.size for p in parts] == sizes
        assert all(np.all(p == r) for r, p in enumerate(parts))
        assert nbytes == 4 * (sum(sizes) - sizes[(rank + 1) % P])


@pytest.mark.parametrize("P,root", [(2, 0), (3, 1), (5, 4), (8, 0)])
def test_bcast_and_binomial_volume(P, root):
    world = InProcessWorld(P)
    payload = np.arange(10, dtype=np.float64)

    def fn(comm):
        x = payload if comm.rank == root else None
        return comm.bcast(x, root=root, shape=(10,), dtype=np.float64), comm.bytes_sent

    out = world.run(fn)
    for res, _ in out:
        assert np.array_equal(res, payload)
    total = sum(nbytes for _, nbytes in out)
    assert total == 80 * (P - 1)  # a tree: every non-root rank receives exactly once
    assert sum(binomial_children(r, P, root) for r in range(P)) == P - 1


def test_bcast_needs_shape_on_non_root():
    world = InProcessWorld(2)
    with pytest.raises(ValueError, match="shape= and dtype="):
        world.comms[1].bcast(None, root=0)
    with pytest.raises(ValueError, match="root=5"):
        world.comms[0].bcast(np.ones(1), root=5)


def test_alltoall_and_point_to_point():
    P = 3
    world = InProcessWorld(P)

    def fn(comm):
        blocks = [np.full(j + 1, 10 * comm.rank + j, dtype=np.int64) for j in range(P)]
        got = comm.alltoall(blocks)
        peer = (comm.rank + 1) % P
        req = comm.isend(np.array([comm.rank], dtype=np.int64), peer, tag=7)
        back = comm.recv((comm.rank - 1) % P, tag=7, dtype=np.int64)
        req.wait()
        return got, back

    for rank, (got, back) in enumerate(world.run(fn)):
        assert [g.tolist() for g in got] == [[10 * src + rank] * (rank + 1) for src in range(P)]
        assert back.tolist() == [(rank - 1) % P]


def test_point_to_point_validates_peer():
    comm = InProcessWorld(2).comms[0]
    with pytest.raises(ValueError, match="dest=0"):
        comm.send(np.ones(1), 0)
    with pytest.raises(ValueError, match="source=3"):
        comm.recv(3)


def test_split_counts():
    assert split_counts(10, 3).tolist() == [4, 3, 3]
    assert split_counts(2, 4).tolist() == [1, 1, 0, 0]


def test_sendrecv_pairs():
    out = InProcessWorld(2).run(lambda c: c.sendrecv(np.array([c.rank + 0.5]), 1 - c.rank))
    assert [o.tolist() for o in out] == [[1.5], [0.5]]


def test_agreement_passes_when_ranks_agree_and_names_the_odd_rank_otherwise():
    from tfsparse.collectives.agreement import ConfigurationMismatch, check_agreement

    same = InProcessWorld(3).run(lambda c: check_agreement(c, "the test", {"a": 1, "f": np.sum}))
    assert same == [None, None, None]

    def odd(c):
        try:
            check_agreement(c, "the test", {"a": 1, "shape": [8, 5 if c.rank == 2 else 4]}, "hint here")
        except ConfigurationMismatch as e:
            return str(e)
    messages = InProcessWorld(3).run(odd)
    assert len(set(messages)) == 1  # the same error on every rank
    assert messages[0].startswith("ranks disagree on the test: rank 2 differs from rank 0")
    assert "rank 2 vs rank 0: shape: [8, 5] vs [8, 4]" in messages[0] and messages[0].endswith("hint here")


def test_irecv_of_at_most_count_returns_what_was_sent():
    """``exact=False``: a receive posted before the length is known exactly (a float16 block may
    carry a scale byte) returns the elements sent; more than ``count`` is an error, as is a
    different length with ``exact=True``."""
    import threading

    world = InProcessWorld(2)
    a, b = world.comms
    got = {}

    def receive():
        got["short"] = b.irecv(0, 8, tag=3, dtype=np.uint8, exact=False).wait()
        try:
            b.irecv(0, 8, tag=4, dtype=np.uint8).wait()
        except RuntimeError as e:
            got["exact"] = str(e)
        try:
            b.irecv(0, 2, tag=5, dtype=np.uint8, exact=False).wait()
        except RuntimeError as e:
            got["long"] = str(e)

    t = threading.Thread(target=receive)
    t.start()
    for tag in (3, 4, 5):
        a.send(np.arange(5, dtype=np.uint8), 1, tag)
    t.join(10)
    np.testing.assert_array_equal(got["short"], np.arange(5, dtype=np.uint8))
    assert "expected 8 elements" in got["exact"] and "at most 2" in got["long"]


def test_a_quiet_wait_tests_and_sleeps_until_done(monkeypatch):
    """MPICommunicator.wait_quietly: a request's wait calls MPI_Test (one turn of Open MPI's
    progress engine) and sleeps ``pause`` between tests instead of spinning in MPI_Wait."""
    import tfsparse.collectives.mpi as M

    class Req:
        def __init__(self):
            self.tests, self.waits = [], 0

        def Test(self, status=None):
            self.tests.append(status)
            return len(self.tests) == 3

        def Wait(self, status=None):
            self.waits += 1

    slept = []
    monkeypatch.setattr(M.time, "sleep", slept.append)
    req, status = Req(), object()
    M._wait(req, None, 1e-4, status)
    assert req.tests == [status] * 3 and slept == [1e-4, 1e-4] and req.waits == 0
    M._wait(req, None)  # no pause: MPI_Wait itself
    assert req.waits == 1 and len(req.tests) == 3


def test_a_communication_thread_takes_precedence_over_the_others():
    """CommThread.take_precedence, in a process of its own (it renices the process's threads):
    every other thread -- and one started later by a reniced thread -- runs PRECEDENCE_NICE above
    the communication thread, whose jobs run at the process's nice; a communication thread
    created afterwards to run ahead, by a reniced thread, still starts at the process's nice (its
    starter thread kept it), so that it can take precedence without privilege, while one created
    for a synchronous exchange starts level with its reniced creator (the training's threads); a
    second call changes nothing."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice is Linux's")
    code = """
import os, threading
from tfsparse.collectives.thread import CommThread, PRECEDENCE_NICE, allow_precedence
nice = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
start = nice()
assert not CommThread().take_precedence()  # not before init(thread_priority=True) allows it
allow_precedence(True)
go = threading.Event()
before = threading.Thread(target=go.wait)
before.start()
comm = CommThread()
assert comm.take_precedence() and comm.take_precedence()
later = []
started = threading.Thread(target=lambda: later.append(nice()))
started.start(); started.join()
second = CommThread(ahead=True)  # created by this (reniced) thread
fresh = second.submit(nice).result()
assert second.take_precedence()
level = CommThread()  # a synchronous exchange's, created by this thread too
print(nice() - start, os.getpriority(os.PRIO_PROCESS, before.native_id) - start, later[0] - start,
      comm.submit(nice).result() - start, fresh - start, second.submit(nice).result() - start,
      level.submit(nice).result() - start, PRECEDENCE_NICE)
go.set(); comm.close(); second.close(); level.close()
"""
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])  # this checkout's tfsparse
    assert done.returncode == 0, done.stderr
    main, other, later, ahead, fresh, second, level, offset = map(int, done.stdout.split())
    assert (main, other, later, ahead, fresh, second, level) == (offset, offset, offset, 0, 0, 0, offset)
    assert offset > 0
