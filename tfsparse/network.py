"""An emulated cluster on one machine: one Linux network namespace per rank, a shaped link each.

``tfsparse-run -np 4 --net 1gbit python train.py`` (see :mod:`tfsparse.run`) builds this::

      root namespace                 switch namespace            rank namespaces
      tn<pid>x 10.77.S.1 ---veth--- tn<pid>y ┐
                                             ├ br0 (bridge)
                          tn<pid>r0 ---veth--- eth0 10.77.S.10   (tfsnet<pid>-0, tbf both ways)
                          tn<pid>r1 ---veth--- eth0 10.77.S.11   (tfsnet<pid>-1, tbf both ways)
                                               ...

* every rank runs in its own namespace ``tfsnet<pid>-<rank>`` (entered through ``ip netns exec``
  keyed on ``OMPI_COMM_WORLD_RANK``), so two ranks can only talk over their links;
* each rank's link is shaped in **both** directions by a token bucket (``tc qdisc ... tbf``): on
  the rank's ``eth0`` (what it sends) and on its switch port (what it receives), so a rank sends
  *and* receives at most ``rate`` -- a full-duplex NIC of that speed;
* the root-namespace veth (unshaped) lets ``mpirun``'s PMIx server and out-of-band channel reach
  the ranks; Open MPI is restricted to TCP over the subnet (``--mca btl tcp,self``, no shared
  memory), so every byte of a collective crosses a shaped link;
* the subnet ``10.77.S.0/24`` is the first one no interface of the machine uses, so traffic stays
  on addresses inside the emulated network; namespaces and links are removed on every exit of
  the launcher (success, failure, Ctrl-C, SIGTERM), and ones left by a launcher that was killed
  (SIGKILL) are removed by the next launch (their owner's pid is in their name).

Latency: ``--net 1gbit,latency=50us`` needs the ``netem`` qdisc; kernels without it (this
project's CI machines) make the launcher stop before anything is created, with that message.
A veth pair itself adds some tens of microseconds per hop.  The α-β model (:mod:`tfsparse.collectives.simulate`)
covers latency-bound regimes instead.

Needs root or CAP_NET_ADMIN, ``ip`` and ``tc`` (iproute2).
"""
from __future__ import annotations

import ipaddress
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .collectives.alphabeta import parse_rate, parse_time

NS_PREFIX = "tfsnet"
MAX_RANKS = 240          # addresses .10 .. .249 of one /24
CAP_NET_ADMIN = 12


@dataclass(frozen=True)
class NetSpec:
    """What ``--net RATE[,latency=DELAY]`` asks for: per-rank link rate (bit/s), one-way delay (s)."""
    rate: int
    latency: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "NetSpec":
        """The spec ``--net`` asks for with ``text`` (``RATE[,latency=DELAY]``, e.g. ``"1gbit,latency=50us"``);
        ValueError for an option other than ``latency=``, or a rate below 8 kbit/s."""
        head, *options = [part.strip() for part in str(text).split(",")]
        latency = 0.0
        for option in options:
            key, _, value = option.partition("=")
            if key != "latency" or not value:
                raise ValueError(f"--net option {option!r} is not understood; accepted: "
                                 f"latency=DELAY (e.g. --net 1gbit,latency=50us)")
            latency = parse_time(value)
        bits = int(round(8 * parse_rate(head, "rate")))
        if bits < 8000:
            raise ValueError(f"rate={head!r} is below the accepted minimum of 8kbit")
        return cls(bits, latency)

    @property
    def burst(self) -> int:
        """Token-bucket depth: what the link carries in a millisecond, at least 128 KiB.  Smaller buckets lose
        rate; larger ones let whole sparse messages pass at the veth's speed, which no real link
        of that rate does.  The α-β model is told it (``AlphaBeta(burst=...)``)."""
        # Measured: at 1 Gbit/s 648 Mbit/s through a 16 KiB bucket, 966 through 128 KiB; at
        # 100 Mbit/s and 16 KiB full rate for two ranks, but Ok-Topk's exchange 1.5-1.7x the α-β
        # model's time with 3 or 4 ranks on 2 busy cores; at 128 KiB and 100 Mbit/s a 320 KB
        # allgather after an idle moment already took 16.6 ms, not the rate's 25.6.
        return max(128 * 1024, self.rate // 8 // 1000)

    def __str__(self):
        text = f"{self.rate / 1e9:g}gbit" if self.rate >= 10**9 else f"{self.rate / 1e6:g}mbit"
        return text + (f", latency {self.latency * 1e6:g}us" if self.latency else "")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip() or done.returncode}")
    return done


def has_net_admin() -> bool:
    """CAP_NET_ADMIN in this process's effective set (root in a container may lack it)."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except (OSError, StopIteration, ValueError):
        return hasattr(os, "geteuid") and os.geteuid() == 0


def check_can_emulate() -> None:
    """Raises a clear error where this machine cannot build the emulated network."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"--net needs Linux network namespaces; this is {sys.platform}")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"--net needs the '{tool}' command (iproute2); install it "
                               f"(apt-get install iproute2) or run without --net")
    if not has_net_admin():
        raise PermissionError("--net creates network namespaces and shapes links, which needs root "
                              "or CAP_NET_ADMIN; run as root (e.g. sudo) or without --net")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_namespaces() -> dict[int, list[str]]:
    """Namespaces named ``tfsnet<pid>-...`` whose launcher process ``pid`` no longer exists."""
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    stale: dict[int, list[str]] = {}
    for line in listed:
        m = re.match(rf"({NS_PREFIX}(\d+)-(?:sw|probe|\d+))\b", line.strip())
        if m and not _pid_alive(int(m.group(2))):
            stale.setdefault(int(m.group(2)), []).append(m.group(1))
    return stale


def _used_networks() -> list:
    nets = []
    for line in _run("ip", "-o", "-4", "addr", "show", check=False).stdout.split("\n"):
        m = re.search(r"\binet (\S+)", line)
        if m:
            nets.append(ipaddress.ip_interface(m.group(1)).network)
    return nets


def free_subnet(used=None) -> ipaddress.IPv4Network:
    """The first ``10.77.S.0/24`` no interface in the root namespace overlaps."""
    used = _used_networks() if used is None else used
    for s in range(256):
        net = ipaddress.ip_network(f"10.77.{s}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.77.S.0/24 subnet for the emulated network")


class EmulatedNetwork:
    """Context manager building (``__enter__``) and removing (``__exit__``) the emulated network.

    >>> with EmulatedNetwork(4, NetSpec.parse("1gbit")) as net:
    ...     subprocess.run(["mpirun", *net.mpirun_args(), *net.wrap(["python", "train.py"])])

    :meth:`mpirun_args` restricts Open MPI to TCP over the emulated subnet, :meth:`environment`
    adds what its PMIx server needs, :meth:`wrap` puts each rank into its own namespace.
    """

    def __init__(self, nprocs: int, spec: NetSpec, owner: int | None = None):
        if not 1 <= nprocs <= MAX_RANKS:
            raise ValueError(f"-np {nprocs}: --net emulates 1 to {MAX_RANKS} ranks")
        self.nprocs = nprocs
        self.spec = spec
        self.owner = os.getpid() if owner is None else owner
        self.subnet = None
        self._namespaces: list[str] = []
        self._links: list[str] = []

    # names ---------------------------------------------------------------
    def namespace(self, rank) -> str:
        """The name of ``rank``'s network namespace, ``tfsnet<pid>-<rank>`` (``"sw"``: the switch's)."""
        return f"{NS_PREFIX}{self.owner}-{rank}"

    @property
    def switch(self) -> str:
        """The switch's namespace (``tfsnet<pid>-sw``), which holds the bridge ``br0``."""
        return self.namespace("sw")

    @property
    def host_link(self) -> str:
        """The root namespace's veth into the bridge (``tn<pid>x``; interface names <= 15 chars)."""
        return f"tn{self.owner}x"

    def address(self, rank: int) -> str:
        """The IPv4 address of ``rank``'s ``eth0``: the subnet's ``.10`` + ``rank`` (the subnet is chosen on entry)."""
        return str(self.subnet.network_address + 10 + rank)

    @property
    def burst_bytes(self) -> int:
        """Each link's token-bucket depth (:attr:`NetSpec.burst`)."""
        return self.spec.burst

    # launch glue -----------------------------------------------------------
    def mpirun_args(self) -> list[str]:
        """mpirun's flags for the emulated subnet: Open MPI restricted to TCP (``btl tcp,self``), its TCP and
        out-of-band channels to the subnet, and :meth:`environment`'s PMIx setting exported to the ranks."""
        cidr = str(self.subnet)
        return ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", cidr,
                "--mca", "oob_tcp_if_include", cidr, "-x", "PMIX_MCA_ptl_tcp_if_include"]

    def environment(self) -> dict:
        """What mpirun's environment needs: ``PMIX_MCA_ptl_tcp_if_include``, the PMIx server on the subnet."""
        return {"PMIX_MCA_ptl_tcp_if_include": str(self.subnet)}

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` run inside the namespace of rank ``$OMPI_COMM_WORLD_RANK``."""
        enter = (f'exec ip netns exec "{NS_PREFIX}{self.owner}-${{OMPI_COMM_WORLD_RANK:?'
                 f'not started by mpirun}}" "$0" "$@"')
        return ["/bin/sh", "-c", enter, *command]

    # set-up / tear-down ----------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        check_can_emulate()
        if self.spec is not None and self.spec.latency:
            self._check_netem()
        for pid, names in leftover_namespaces().items():
            _remove(names, [f"tn{pid}x"])
        self.subnet = free_subnet()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        """Removes the namespaces and links built so far (ending what still runs in the namespaces); never
        raises, and a second call does nothing."""
        _remove(self._namespaces, self._links)
        self._namespaces, self._links = [], []

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, device: str) -> None:
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
             "handle", "1:", "tbf", "rate", f"{self.spec.rate}bit", "burst", str(self.burst_bytes),
             "latency", "100ms")
        if self.spec.latency:
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device,
                 "parent", "1:1", "handle", "10:", "netem", "delay", f"{self.spec.latency * 1e6:.0f}us")

    def _build(self) -> None:
        sw, prefix = self.switch, self.subnet.prefixlen
        self._netns(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        host, host_peer = self.host_link, f"tn{self.owner}y"
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", host_peer)
        self._links.append(host)
        _run("ip", "link", "set", host_peer, "netns", sw)
        _run("ip", "-n", sw, "link", "set", host_peer, "master", "br0", "up")
        _run("ip", "addr", "add", f"{self.subnet.network_address + 1}/{prefix}", "dev", host)
        _run("ip", "link", "set", host, "up")
        for rank in range(self.nprocs):
            ns, end, port = self.namespace(rank), f"tn{self.owner}r{rank}", f"tn{self.owner}s{rank}"
            self._netns(ns)
            _run("ip", "link", "add", end, "type", "veth", "peer", "name", port)
            self._links.append(end)
            _run("ip", "link", "set", end, "netns", ns)
            _run("ip", "link", "set", port, "netns", sw)
            _run("ip", "-n", ns, "link", "set", end, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/{prefix}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
            self._shape(ns, "eth0")      # what the rank sends
            self._shape(sw, port)        # what the rank receives

    @staticmethod
    def _check_netem() -> None:
        probe = f"{NS_PREFIX}{os.getpid()}-probe"
        _run("ip", "netns", "add", probe)
        try:
            done = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                        "netem", "delay", "1ms", check=False)
        finally:
            _run("ip", "netns", "del", probe, check=False)
        if done.returncode != 0:
            raise RuntimeError("latency= needs the netem qdisc, which this kernel lacks ("
                               f"tc: {done.stderr.strip()}); drop latency= (links then add only "
                               "the veth's ~10-30 us) or use a kernel with sch_netem")


def _remove(namespaces, links) -> None:
    """Ends what still runs in the namespaces (an emulated host's sshd and its sessions), deletes
    them (their veths go with them) and the root-namespace links; never raises."""
    for name in namespaces:
        for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", name, check=False)
    for link in links:
        if os.path.exists(f"/sys/class/net/{link}"):
            _run("ip", "link", "del", link, check=False)


SSHD = "/usr/sbin/sshd"


class EmulatedHosts(EmulatedNetwork):
    """``hosts`` emulated hosts on this machine, reached over ssh as a cluster's are.

    >>> with EmulatedHosts(2, NetSpec.parse("1gbit")) as cluster:
    ...     cluster.host_list(4)        # "h1:2,h2:2"
    ...     subprocess.run(["mpirun", "-H", cluster.host_list(4), *cluster.mpirun_args(), "python", "train.py"])

    Each host is a network namespace and a hostname (UTS) namespace, ``h1`` ... ``hH``, linked to
    the emulated switch at ``spec``'s rate (or unshaped, ``spec=None``), with its own ``sshd``
    (Debian's openssh-server) accepting a key made for this run.  Open MPI sees distinct nodes
    and starts their ranks through ssh (:meth:`agent`, an ssh configuration that names the
    hosts), exactly as on a cluster; the ranks of one host share its memory (Open MPI's ``vader``)
    and reach other hosts over the emulated links.  Leaving the context ends the sshds and
    whatever they started, and removes the namespaces and keys.
    """

    def __init__(self, hosts: int, spec: NetSpec | None = None, owner: int | None = None):
        if not 1 <= hosts <= 64:
            raise ValueError(f"--emulate-hosts {hosts}: accepted: 1 to 64 hosts")
        super().__init__(hosts, spec, owner)
        self.hosts = hosts
        self.folder: str | None = None
        self._daemons: list[subprocess.Popen] = []

    def name(self, host: int) -> str:
        """The hostname of 0-based ``host``: ``h1``, ``h2``, ..."""
        return f"h{host + 1}"

    def host_list(self, nprocs: int) -> str:
        """``-H`` for ``nprocs`` ranks spread evenly over the hosts, the first hosts taking one
        more where they do not divide evenly, each host's ranks consecutive."""
        counts = [nprocs // self.hosts + (1 if h < nprocs % self.hosts else 0) for h in range(self.hosts)]
        return ",".join(f"{self.name(h)}:{c}" for h, c in enumerate(counts) if c)

    @property
    def agent(self) -> str:
        """What Open MPI starts remote ranks through (``plm_rsh_agent``): ssh with this run's
        configuration (the hosts' names and addresses, the key, no host-key prompts)."""
        return f"ssh -F {self.folder}/ssh_config"

    def mpirun_args(self) -> list[str]:
        """mpirun's flags for the emulated hosts: remote ranks started through ssh (:attr:`agent`), shared memory
        (``vader``) between the ranks of one host, TCP over the emulated subnet between hosts."""
        cidr = str(self.subnet)
        return ["--mca", "plm_rsh_agent", self.agent, "--mca", "btl", "tcp,vader,self",
                "--mca", "btl_tcp_if_include", cidr, "--mca", "oob_tcp_if_include", cidr,
                "-x", "PMIX_MCA_ptl_tcp_if_include"]

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` as it is: each rank starts inside its host's namespaces, through the host's sshd."""
        return list(command)  # the ranks start inside their host, through its sshd

    def _shape(self, namespace: str, device: str) -> None:
        if self.spec is not None:
            super()._shape(namespace, device)

    def __enter__(self) -> "EmulatedHosts":
        if not os.path.exists(SSHD):
            raise RuntimeError(f"--emulate-hosts needs {SSHD} (Debian's openssh-server: apt-get install "
                               f"openssh-server)")
        super().__enter__()
        try:
            self._start_daemons()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Ends the hosts' sshds (and, with the namespaces, whatever they started), removes the namespaces and
        links, and deletes the run's keys and ssh configuration."""
        for daemon in self._daemons:
            if daemon.poll() is None:
                daemon.kill()
            daemon.wait()
        self._daemons = []
        super().close()  # also ends what the daemons started
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def _start_daemons(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="tfsparse-hosts-")
        key, host_key = f"{self.folder}/id", f"{self.folder}/host_key"
        for path in (key, host_key):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tfsparse-run --emulate-hosts", "-f", path)
        shutil.copy(f"{key}.pub", f"{self.folder}/authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        user = pwd.getpwuid(os.getuid()).pw_name
        lines = [f"Host {self.name(h)}\n  HostName {self.address(h)}\n" for h in range(self.hosts)]
        lines.append(f"Host *\n  User {user}\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
                     f"  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
        with open(f"{self.folder}/ssh_config", "w") as f:
            f.write("".join(lines))
        for h in range(self.hosts):
            config = f"{self.folder}/sshd_{self.name(h)}"
            with open(config, "w") as f:
                f.write(f"ListenAddress {self.address(h)}\nHostKey {host_key}\n"
                        f"AuthorizedKeysFile {self.folder}/authorized_keys\nPermitRootLogin prohibit-password\n"
                        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                        f"StrictModes no\nPidFile none\n")
            with open(f"{config}.log", "w") as log:  # sshd's own log (-e), read when it fails
                self._daemons.append(subprocess.Popen(
                    ["ip", "netns", "exec", self.namespace(h), "unshare", "--uts", "sh", "-c",
                     f"hostname {self.name(h)} && exec {SSHD} -D -e -f {config}"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 15
        for h in range(self.hosts):  # each sshd listening: a login that runs `true`
            while True:
                if self._daemons[h].poll() is not None:
                    with open(f"{self.folder}/sshd_{self.name(h)}.log") as log:
                        raise RuntimeError(f"the sshd of emulated host {self.name(h)} ended: {log.read().strip()[-400:]}")
                done = _run(*self.agent.split(), "-o", "BatchMode=yes", "-o", "ConnectTimeout=2", self.name(h),
                            "true", check=False)
                if done.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"emulated host {self.name(h)} did not accept ssh within 15 s: "
                                       f"{done.stderr.strip()[-400:]}")
                time.sleep(0.2)
