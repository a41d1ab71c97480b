"""``measure_alpha_beta`` on real ``mpirun`` ranks (P = 2 and the non-power-of-two 3): a
ping-pong fit between ranks 0 and 1, broadcast to every rank.  Timing values are not asserted
(they depend on the machine); what is: a positive latency and bandwidth, the same result on
every rank, ``time()`` consistent with them, no bytes on the caller's communicator, and a bad
argument raising ValueError on every rank without a hang."""
import numpy as np
import pytest

from mpi_harness import mpirun

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("P", [2, 3])
def test_measure_alpha_beta_on_mpi(P):
    results, _ = mpirun(P, "alphabeta.py", timeout=180)
    assert len(results) == P
    r0 = results[0]
    for r in results:
        assert r["size"] == P
        assert r["alpha"] > 0 and r["beta"] > 0
        assert np.isfinite(r["alpha"]) and np.isfinite(r["beta"])
        # identical on every rank, bit for bit (rank 0 fits, the broadcast carries it)
        assert (r["alpha"], r["beta"]) == (r0["alpha"], r0["beta"])
        assert (r["alpha2"], r["beta2"]) == (r0["alpha2"], r0["beta2"])
        # time(n) = alpha + n / beta, growing with n
        np.testing.assert_allclose(r["times"], r["alpha"] + r["probe"] / r["beta"], rtol=1e-12)
        assert r["times"][0] == pytest.approx(r["alpha"])
        assert np.all(np.diff(r["times"]) > 0)
        # the ping-pong runs on a duplicate: the caller's byte counter does not move
        assert r["bytes_delta"] == 0
        # repeats=0 was refused on every rank, naming the argument and the accepted values
        assert "repeats=0" in r["bad"] and "accepted" in r["bad"]
