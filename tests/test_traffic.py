"""tfsparse.traffic: the exchange's memory traffic, counted by the stages that move the bytes."""
import threading

import numpy as np
import pytest

from tfsparse import traffic
from tfsparse.collectives import InProcessWorld
from tfsparse.exchange import GradientExchange

N = 1 << 18


def _passes(algorithm, wire="float32", rounds=2, **kwargs):
    ex = GradientExchange(algorithm, 0.01, wire_dtype=wire, communicator=InProcessWorld(1).comms[0], **kwargs)
    grads = [np.random.default_rng(i).standard_normal(N, dtype=np.float32) for i in range(rounds + 1)]
    ex.exchange_numpy([grads[0]])  # the first round builds the exchange: not counted
    with traffic.recording() as moved:
        for g in grads[1:]:
            ex.exchange_numpy([g])
    return moved.passes(4 * N, rounds)


def test_nothing_is_counted_unless_recording():
    traffic.count("select", read=10)  # no recording: a no-op
    with traffic.recording() as t:
        traffic.count("select", read=10, written=2)
        with traffic.recording() as inner:
            traffic.count("copy", read=4, written=4)
    traffic.count("copy", read=100)
    assert t.read["select"] == 10 and t.written["select"] == 2 and t.bytes() == 20
    assert inner.bytes() == 8 and inner.passes(8)["copy"] == 1.0


def test_counts_from_every_thread():
    with traffic.recording() as t:
        threads = [threading.Thread(target=lambda: [traffic.count("decode", written=1) for _ in range(1000)])
                   for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert t.written["decode"] == 4000


def test_dense_float32_reads_the_gradient_into_the_bucket_and_checks_it_once():
    passes = _passes("dense")
    assert passes["compensate"] == 2.0 and passes["finite"] == 1.0 and passes["total"] == 3.0


@pytest.mark.parametrize("algorithm", ["topk", "gtopk", "oktopk", "dragonn"])
def test_allgather_and_tree_algorithms_make_four_passes(algorithm):
    """Error feedback fused with the finite check and the selection: one pass reads grad and
    residual and writes acc, collecting what the compressor asked for; the dense result is
    written once; the new residual is acc with the sent entries cleared (k-sized, not counted)."""
    passes = _passes(algorithm)
    assert passes == {"compensate": 3.0, "finite": 0.0, "select": 0.0, "encode": 0.0, "decode": 1.0,
                      "update": 0.0, "copy": 0.0, "total": 4.0}


def test_unfused_selection_keeps_its_own_passes():
    """A compressor without a prefilter (DGC's adapting threshold) reads acc itself; the finite
    check still rides on error feedback's pass."""
    passes = _passes("dgc")
    assert passes["compensate"] == 3.0 and passes["finite"] == 0.0 and passes["select"] > 1.0


def test_lossy_dense_wire_counts_encoding_decoding_and_the_kept_loss():
    """P = 2 (in-process ranks on two threads: both ranks' traffic lands in one recording)."""
    world = InProcessWorld(2)
    exs = [GradientExchange("dense", wire_dtype="float16", communicator=c) for c in world.comms]
    g = np.random.default_rng(0).standard_normal(N, dtype=np.float32)

    def rounds(ex, count):
        for _ in range(count):
            ex.exchange_numpy([g])

    for count in (1, 2):  # the first round builds the exchanges; the second recording is kept
        with traffic.recording() as moved:
            threads = [threading.Thread(target=rounds, args=(ex, count)) for ex in exs]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
    passes = moved.passes(4 * N, 2 * 2)  # per rank and round
    # error feedback (grad + residual) with the check; half of the vector encoded to the peer and
    # the owner's sum encoded, each writing its loss over the values it read (the new residual,
    # built in place: no update pass); every block decoded
    assert passes["compensate"] == 3.0 and passes["finite"] == 0.0
    assert passes["encode"] > 0 and passes["decode"] > 0 and passes["update"] == 0 and passes["select"] == 0
    assert passes["total"] == round(sum(v for k, v in passes.items() if k != "total"), 2)
