"""``tfsparse-run --net``: ranks in their own network namespaces behind shaped links.

The launched jobs need root (or CAP_NET_ADMIN) and are skipped without it; argument checks run
everywhere.
"""
import ipaddress
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mpi_harness import interrupt_when_up, job_env, load_result, run_job
from tfsparse import network
from tfsparse.network import EmulatedNetwork, NetSpec

needs_net_admin = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and network.has_net_admin()),
    reason="needs root / CAP_NET_ADMIN for network namespaces")
WORKER = Path(__file__).parent / "workers" / "network.py"


def launcher(np_, net, *command):
    return [sys.executable, "-m", "tfsparse.run", "-np", str(np_), "--net", net, *command]


def our_namespaces(pid=None):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.startswith(network.NS_PREFIX)]
    return [n for n in names if pid is None or n.startswith(f"{network.NS_PREFIX}{pid}-")]


def test_net_spec_parsing():
    assert NetSpec.parse("1gbit") == NetSpec(10**9, 0.0)
    spec = NetSpec.parse("100mbit,latency=50us")
    assert spec.rate == 10**8 and spec.latency == pytest.approx(5e-05)
    assert NetSpec.parse("2.5Gbit").rate == 2_500_000_000
    assert str(NetSpec.parse("10gbit")) == "10gbit"


@pytest.mark.parametrize("rate, depth", [("1gbit", 128 * 1024), ("100mbit", 128 * 1024), ("10gbit", 1_250_000),
                                         ("2.5gbit", 312_500)])
def test_token_bucket_holds_one_millisecond_and_at_least_128_kib(rate, depth):
    assert EmulatedNetwork(2, NetSpec.parse(rate), owner=1).burst_bytes == NetSpec.parse(rate).burst == depth


@pytest.mark.parametrize("text, named", [("1gbyte", "rate='1gbyte'"), ("fast", "rate='fast'"),
                                         ("1gbit,delay=3", "'delay=3'"),
                                         ("1gbit,latency=soon", "latency='soon'"),
                                         ("10bit", "minimum")])
def test_bad_net_specs_name_the_value_and_what_is_accepted(text, named):
    with pytest.raises(ValueError, match="accepted|minimum") as info:
        NetSpec.parse(text)
    assert named in str(info.value)


def test_bad_net_spec_stops_the_launcher_before_anything_starts():
    done = subprocess.run(launcher(2, "1gbyte", sys.executable, "-c", "pass"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "rate='1gbyte'" in done.stderr
    done = subprocess.run([sys.executable, "-m", "tfsparse.run", "-np", "2", "-H", "a,b", "--net", "1gbit",
                           sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--net with -H a,b" in done.stderr
    done = subprocess.run([sys.executable, "-m", "tfsparse.run", "-np", "2", "--net", "1gbit", "--hostfile",
                           "hosts.txt", sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--net with --hostfile hosts.txt" in done.stderr


def test_the_subnet_avoids_every_network_in_use():
    used = [ipaddress.ip_network("10.77.0.0/24"), ipaddress.ip_network("10.77.1.128/25"),
            ipaddress.ip_network("192.168.0.0/16")]
    assert str(network.free_subnet(used)) == "10.77.2.0/24"
    with pytest.raises(RuntimeError, match="no free"):
        network.free_subnet([ipaddress.ip_network("10.0.0.0/8")])


@needs_net_admin
@pytest.mark.parametrize("np_, rate", [(2, 40), (3, 80)])
def test_ranks_talk_over_their_own_shaped_links(np_, rate):
    """Each rank has its own address in one subnet, a token bucket at the asked rate on its
    link, Open MPI uses TCP only, and a transfer cannot beat the rate (a lower bound on time:
    shaping can only make it slower)."""
    nbytes = 1_000_000
    with tempfile.TemporaryDirectory() as out:
        code, text = run_job(launcher(np_, f"{rate}mbit", sys.executable, str(WORKER), str(nbytes)),
                             {"TFSPARSE_TEST_OUT": out}, timeout=120)
        assert code == 0, text
        assert f"{np_} ranks on an emulated network, {rate}mbit per rank link" in text
        results = [load_result(out, r) for r in range(np_)]
    addresses = []
    for rank, res in enumerate(results):
        inet = [line.split()[3] for line in res["addresses"].splitlines() if " eth0 " in f" {line} "]
        assert len(inet) == 1, res["addresses"]     # lo and the rank's one link, nothing else
        assert "127.0.0.1" in res["addresses"] and len(res["addresses"].splitlines()) == 2
        addresses.append(ipaddress.ip_interface(inet[0]))
        assert "tbf 1: root refcnt" in res["qdisc"] and f"rate {rate}Mbit" in res["qdisc"], res["qdisc"]
        assert res["btl"] == "tcp,self"
        assert res["checksum"] == nbytes
    assert len({a.ip for a in addresses}) == np_ and len({a.network for a in addresses}) == 1
    assert addresses[0].network.subnet_of(ipaddress.ip_network("10.77.0.0/16"))
    wire_seconds = nbytes * 8 / (rate * 1e6)
    assert all(t > 0.8 * wire_seconds for t in results[0]["seconds"]), (results[0]["seconds"], wire_seconds)
    assert not our_namespaces()


@needs_net_admin
def test_a_failing_rank_fails_the_launch_and_the_network_is_removed():
    code, text = run_job(launcher(3, "100mbit", sys.executable, "-c",
                                  "import os, sys; sys.exit(3 if os.environ['OMPI_COMM_WORLD_RANK'] == '1' else 0)"),
                         timeout=120)
    assert code != 0
    assert not our_namespaces()


@needs_net_admin
def test_ctrl_c_stops_the_ranks_and_removes_the_network(tmp_path):
    marker = tmp_path / "up"
    script = ("import os, sys, time; from pathlib import Path; "
              f"Path('{marker}' + os.environ['OMPI_COMM_WORLD_RANK']).touch(); time.sleep(300)")
    def network_up(pid):
        assert len(our_namespaces(pid)) == 3  # two ranks and the switch

    code, pid = interrupt_when_up(launcher(2, "100mbit", sys.executable, "-c", script), marker, 2, network_up)
    assert code != 0
    assert not our_namespaces(pid)
    assert not Path(f"/sys/class/net/tn{pid}x").exists()


@needs_net_admin
def test_namespaces_of_a_killed_launcher_are_removed_by_the_next_launch():
    stale = network.EmulatedNetwork(2, NetSpec.parse("100mbit"), owner=_dead_pid())
    stale.subnet = network.free_subnet()
    stale._build()                                   # as if its launcher had been SIGKILLed
    assert len(our_namespaces(stale.owner)) == 3
    code, text = run_job(launcher(2, "100mbit", sys.executable, "-c", "pass"), timeout=120)
    assert code == 0, text
    assert not our_namespaces(stale.owner)
    assert not Path(f"/sys/class/net/{stale.host_link}").exists()


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@needs_net_admin
def test_without_net_admin_the_launcher_stops_with_a_clear_error():
    done = subprocess.run(["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin",
                           *launcher(2, "1gbit", sys.executable, "-c", "pass")],
                          capture_output=True, text=True, timeout=60, env=job_env())
    assert done.returncode == 1
    assert "needs root or CAP_NET_ADMIN" in done.stderr


@needs_net_admin
def test_latency_needs_netem():
    """latency= is applied where the kernel has netem; where it lacks it (this project's
    machines) the launch stops with that reason and leaves nothing behind."""
    probe = f"{network.NS_PREFIX}{os.getpid()}-probe"
    subprocess.run(["ip", "netns", "add", probe], check=True)
    try:
        has_netem = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                                    "netem", "delay", "1ms"], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe])
    code, text = run_job(launcher(2, "1gbit,latency=1ms", sys.executable, "-c", "pass"), timeout=120)
    if has_netem:
        assert code == 0, text
    else:
        assert code == 1 and "netem" in text
    assert not our_namespaces()
