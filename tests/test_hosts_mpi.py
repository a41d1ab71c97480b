"""``tfsparse-run --emulate-hosts``: hosts emulated on this machine (each a network and hostname
namespace with its own sshd), Open MPI starting the remote ranks through ssh as on a cluster.

P = 4 as 2 hosts x 2 ranks and 3 hosts x 1 rank, 1 Gbit/s between hosts: each rank on its host
(hostname, Horovod's local and cross ranks), a ``TFSPARSE_*`` variable of the launching shell in
every rank (sshd gives remote ranks a clean environment: only what tfsparse-run forwards
arrives), a SparseStrategy fit (gTop-k, Adam, an Embedding) ending with identical weights, flat
and two-level (``hierarchical=True``); the two-level exchange against the flat numpy reference
over the hosts' sums at 2x2, 3x1 and 3 hosts x 2 ranks; and the namespaces and daemons gone after
success, a failing rank and Ctrl-C.  Needs root and
openssh-server (tools/install.sh installs it); skipped without them."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exchange_ref import reference_run, tree_sum
from mpi_harness import REPO, interrupt_when_up, load_result, run_job
from tfsparse import network

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    not (sys.platform.startswith("linux") and network.has_net_admin() and os.path.exists(network.SSHD)),
    reason="needs root / CAP_NET_ADMIN and openssh-server (tools/install.sh)")]


def launcher(np_, hosts, *command, net="1gbit", flags=()):
    return [sys.executable, "-m", "tfsparse.run", "-np", str(np_), "--emulate-hosts", str(hosts), "--net", net,
            *flags, *command]


def leftovers(pid=None):
    """The namespaces of launcher ``pid`` -- or, without one, of launchers that have ended -- and
    the sshds of emulated hosts whose run has ended (their keys' folder gone): what a launch left
    behind, whatever else runs on the machine meanwhile."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.startswith(network.NS_PREFIX)]
    if pid is not None:
        names = [n for n in names if n.startswith(f"{network.NS_PREFIX}{pid}-")]
    else:
        names = [n for names_ in network.leftover_namespaces().values() for n in names_]
    daemons = [line for line in subprocess.run(["pgrep", "-af", "sshd .*tfsparse-hosts-"], capture_output=True,
                                               text=True).stdout.splitlines()
               if not Path(line.split(" -f ")[-1].split()[0]).parent.is_dir()]
    return names + daemons


@pytest.mark.parametrize("P, hosts", [(4, 2), (3, 3)])
def test_ranks_on_emulated_hosts_started_over_ssh_train_to_identical_weights(tmp_path, P, hosts):
    env = {"TFSPARSE_TEST_OUT": str(tmp_path), "TFSPARSE_PROBE": "forwarded"}
    code, text = run_job(launcher(P, hosts, sys.executable, str(REPO / "tests" / "workers" / "hosts.py")),
                         env=env, timeout=300)
    assert code == 0, text
    per_host = P // hosts
    assert f"{P} ranks on {hosts} emulated hosts" in text
    # TensorFlow's start-up notices (twice in every rank's TensorFlow) once per job
    assert text.count("oneDNN custom operations are on") <= 1 and text.count("before absl::InitializeLog") <= 1
    results = [load_result(tmp_path, r) for r in range(P)]
    for r, res in enumerate(results):
        assert res["host"] == f"h{r // per_host + 1}"  # each host's ranks consecutive
        assert res["topology"] == [r % per_host, per_host, r // per_host, hosts]
        assert res["probe"] == "forwarded"
        np.testing.assert_array_equal(res["weights"], results[0]["weights"])
        assert res["losses"][-1] < res["losses"][0]
        for case in ("two_level", "two_level_pipelined", "auto"):
            np.testing.assert_array_equal(res[f"{case}_weights"], results[0][f"{case}_weights"], err_msg=case)
            assert res[f"{case}_losses"][-1] < res[f"{case}_losses"][0], case
        assert res["auto_two_level"]  # the hosts' groups formed at the (forced) decision, mid-fit
    check_two_level(results)
    assert not leftovers()


def check_two_level(results):
    """tests/workers/two_level.py's rounds: bit-identical on every rank, equal to the flat
    reference run over the hosts' sums (each host's ranks added up a binomial tree), residuals on the
    hosts' leaders, no bytes across hosts from the other ranks."""
    from test_exchange_pipeline import DENSITY, OPTIONS, STEPS, flat, grads_of
    from workers.two_level import CASES

    hosts = [res["host"] for res in results]
    leaders = [hosts.index(h) for h in dict.fromkeys(hosts)]
    sums = [[tree_sum([flat(grads_of(r, s)) for r, x in enumerate(hosts) if x == h]) for h in dict.fromkeys(hosts)]
            for s in range(STEPS)]
    for name, (algorithm, wire) in CASES.items():
        buckets = [tuple(b) for b in results[0][f"{name}/buckets"]]
        want = reference_run(algorithm, wire, buckets, sums, DENSITY, None, OPTIONS.get(algorithm))
        for s in range(STEPS):
            result, residuals = want[s]
            for r, res in enumerate(results):
                got = res[f"{name}/out{s}"]
                np.testing.assert_array_equal(got, results[0][f"{name}/out{s}"], err_msg=f"{name}: ranks differ")
                np.testing.assert_allclose(got, result, rtol=2e-5, atol=2e-5, err_msg=name)
                if r in leaders:
                    if residuals is not None:
                        np.testing.assert_allclose(res[f"{name}/res{s}"], residuals[leaders.index(r)], rtol=2e-5,
                                                   atol=2e-5, err_msg=name)
                else:
                    assert res[f"{name}/bytes{s}"] == 0, name


def test_two_level_exchange_on_three_hosts_of_two_ranks(tmp_path):
    code, text = run_job(launcher(6, 3, sys.executable, str(REPO / "tests" / "workers" / "two_level.py")),
                         env={"TFSPARSE_TEST_OUT": str(tmp_path)}, timeout=300)
    assert code == 0, text
    results = [load_result(tmp_path, r) for r in range(6)]
    assert [res["host"] for res in results] == ["h1", "h1", "h2", "h2", "h3", "h3"]
    check_two_level(results)
    assert not leftovers()


def test_a_failing_rank_fails_the_job_and_the_hosts_are_removed():
    code, text = run_job(launcher(4, 2, sys.executable, "-c",
                                  "import os, sys; sys.exit(3 if os.environ['OMPI_COMM_WORLD_RANK'] == '2' else 0)"),
                         timeout=120)
    assert code != 0, text
    assert not leftovers()


def test_ctrl_c_stops_the_remote_ranks_and_removes_the_hosts(tmp_path):
    marker = tmp_path / "up"
    script = ("import os, time; from pathlib import Path; "
              f"Path('{marker}' + os.environ['OMPI_COMM_WORLD_RANK']).touch(); time.sleep(300)")
    def hosts_up(pid):
        assert len(leftovers(pid)) >= 3  # two hosts and the switch (and the sshds)

    code, _ = interrupt_when_up(launcher(4, 2, sys.executable, "-c", script), marker, 4, hosts_up)
    assert code != 0
    assert not leftovers()
    assert subprocess.run(["pgrep", "-f", f"{marker}"], capture_output=True).returncode != 0  # no rank left


def test_a_host_list_or_a_hostfile_places_the_ranks_as_on_a_cluster(tmp_path):
    """``-H h1:1,h2:3`` and an Open MPI hostfile name the emulated hosts as a cluster's."""
    where = ("import socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
             "names = c.gather(socket.gethostname()); c.rank == 0 and print('hosts:', ','.join(names))")
    code, text = run_job(launcher(4, 2, sys.executable, "-c", where, flags=["-H", "h1:1,h2:3"]), timeout=120)
    assert code == 0 and "hosts: h1,h2,h2,h2" in text, text
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 slots=2\nh2 slots=1\n")
    code, text = run_job(launcher(3, 2, sys.executable, "-c", where, flags=["--hostfile", str(hostfile)]),
                         timeout=120)
    assert code == 0 and "hosts: h1,h1,h2" in text, text
    assert not leftovers()
