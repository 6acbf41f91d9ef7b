"""Two hosts on one machine for the tests: two network namespaces joined by a veth pair, a Ray head node in the
first and a Ray worker node in the second.

Each namespace has only its loopback and its end of the veth pair, addressed inside a private /30 chosen at
random from 10.213.0.0/16 (one that no route of this machine covers), so every packet between the two "hosts"
crosses that link and nothing leaves it. Ray runs in the foreground of ``ray start --block`` in each namespace,
each node with its own temporary folder. Teardown ends every process inside the two namespaces (signal, then
kill: everything there was started here) and deletes them; it never runs ``ray stop``, which ends every Ray
process of the machine by name, not only these. Runs as root in the test process; commands for a host are
prefixed with :meth:`Host.exec`. A test that takes the second host away (its raylet killed, its link down) can
bring it back with :func:`revive_worker`: its processes ended, its link up, a fresh Ray worker node joined; a
driver process inside the first namespace does so from :meth:`TwoHosts.to_dict`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY_PORT = 6379
START_TIMEOUT_S = 90.0
RAY_ENV = {  # a small cluster: no usage reports, no prestarted workers, a dead node noticed within seconds
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # a cluster that exists only inside the test (the token file is machine-wide)
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_DEDUP_LOGS": "0",
    "OMP_NUM_THREADS": "1",
    "WANMESH_WORKER_THREADS": "1",
}
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum is 75 MiB


def unavailable_reason() -> str | None:
    """Why two hosts cannot be made here (not root, no ``ip``, no Ray), or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is missing"
    if shutil.which("ray") is None:
        return "Ray is not installed (pip install 'ray[default]')"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


def _routed_networks() -> list[ipaddress.IPv4Network]:
    out = _run("ip", "-4", "route", "show", "table", "all").stdout
    networks = []
    for line in out.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            first = line.split()[1]
        with contextlib.suppress(ValueError):
            networks.append(ipaddress.ip_network("0.0.0.0/0" if first == "default" else first, strict=False))
    return networks


def free_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    """A /30 in 10.213.0.0/16 that no route of this machine (default routes aside) covers or overlaps."""
    taken = [n for n in _routed_networks() if n.prefixlen > 0]
    for _ in range(200):
        candidate = ipaddress.ip_network(f"10.213.{rng.randrange(256)}.{rng.randrange(64) * 4}/30")
        if not any(candidate.overlaps(n) for n in taken):
            return candidate
    raise RuntimeError("no free /30 in 10.213.0.0/16")


@dataclass
class Host:
    """One namespace: its name, its veth end and address, the Ray node it runs."""

    netns: str
    device: str
    address: str
    temp_dir: str
    ray: subprocess.Popen | None = None
    log: Path | None = None

    def exec(self, *args: str) -> list[str]:
        """``args`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *args]

    def pids(self) -> list[int]:
        out = _run("ip", "netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def raylet_pid(self) -> int | None:
        for pid in self.pids():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    return pid
        return None


@dataclass
class TwoHosts:
    head: Host
    worker: Host
    subnet: ipaddress.IPv4Network
    env: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """The Ray cluster's address as users name it (the head's GCS)."""
        return f"{self.head.address}:{RAY_PORT}"

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.head, self.worker

    def to_dict(self) -> dict:
        """What another process needs to act on these hosts (``from_dict``); not the Ray processes."""
        fields = ("netns", "device", "address", "temp_dir")
        return {"head": {f: getattr(self.head, f) for f in fields}, "worker": {f: getattr(self.worker, f) for f in fields},
                "subnet": str(self.subnet), "env": self.env}

    @classmethod
    def from_dict(cls, data: dict) -> "TwoHosts":
        return cls(Host(**data["head"]), Host(**data["worker"]), ipaddress.ip_network(data["subnet"]), dict(data["env"]))


def set_link(host: Host, up: bool) -> None:
    """Take ``host``'s end of the veth pair down (every packet to the other host lost) or up again."""
    _run(*host.exec("ip", "link", "set", host.device, "up" if up else "down"))


def revive_worker(hosts: TwoHosts) -> None:
    """Bring the second host back after a test took it away: every process there ended, its link up, a fresh
    Ray worker node started and joined (the head then counts two live nodes again)."""
    end_processes(hosts.worker)
    set_link(hosts.worker, True)
    hosts.worker.temp_dir = tempfile.mkdtemp(prefix="b", dir=Path(hosts.worker.temp_dir).parent)  # no stale socket
    _start_ray(hosts, hosts.worker, "--address", hosts.address)
    _wait_for_nodes(hosts, 2)


def _make_namespaces(hosts: TwoHosts) -> None:
    head, worker = hosts.hosts
    for host in hosts.hosts:
        _run("ip", "netns", "add", host.netns)
    _run("ip", "link", "add", head.device, "netns", head.netns, "type", "veth", "peer", "name", worker.device,
         "netns", worker.netns)
    for host in hosts.hosts:
        ns = ("ip", "netns", "exec", host.netns)
        _run(*ns, "ip", "link", "set", "lo", "up")
        _run(*ns, "ip", "addr", "add", f"{host.address}/{hosts.subnet.prefixlen}", "dev", host.device)
        _run(*ns, "ip", "link", "set", host.device, "up")


def _start_ray(hosts: TwoHosts, host: Host, *extra: str) -> None:
    host.log = Path(host.temp_dir) / "ray_start.log"
    with open(host.log, "w") as log:
        host.ray = subprocess.Popen(
            host.exec("ray", "start", "--block", "--node-ip-address", host.address, "--num-cpus", "2",
                      "--num-gpus", "0", "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats",
                      "--temp-dir", host.temp_dir, *extra),
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **hosts.env}, start_new_session=True)


def _wait_for_nodes(hosts: TwoHosts, count: int) -> None:
    """Until the head reports ``count`` live nodes with 2 CPUs each, asked from inside the head's namespace."""
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(sum(1 for n in ray.nodes() if n['Alive'])); ray.shutdown()")
    deadline = time.monotonic() + START_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        for host in hosts.hosts:
            if host.ray is not None and host.ray.poll() is not None:
                raise RuntimeError(f"ray start in {host.netns} ended: {host.log.read_text()[-2000:]}")
        try:
            done = subprocess.run(hosts.head.exec(sys.executable, "-c", probe, hosts.address), capture_output=True,
                                  text=True, timeout=60, env={**os.environ, **hosts.env})
            last = done.stdout.strip() + done.stderr[-1000:]
            if done.returncode == 0 and done.stdout.strip().splitlines()[-1] == str(count):
                return
        except subprocess.TimeoutExpired:
            last = "the probe did not finish within 60 s"
        time.sleep(1.0)
    raise RuntimeError(f"the two-host Ray cluster did not come up within {START_TIMEOUT_S:g} s: {last}")


def end_processes(host: Host, grace_s: float = 5.0) -> list[int]:
    """TERM, then KILL every process inside ``host``'s namespace; the pids that were still there to KILL."""
    for pid in host.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while host.pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    stubborn = host.pids()
    for pid in stubborn:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while host.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    if host.ray is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            host.ray.wait(timeout=grace_s)
    return stubborn


def remove_abandoned() -> list[str]:
    """Namespaces of earlier runs whose process is gone (killed before its teardown ran): their processes are
    ended and the namespaces deleted. A namespace is named ``wmA<pid>-<n>`` / ``wmB<pid>-<n>`` after its creator."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if len(name) < 4 or name[:3] not in ("wmA", "wmB") or "-" not in name:
            continue
        owner = name[3:].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            end_processes(Host(name, "", "", ""))
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for folder in Path(tempfile.gettempdir()).glob("wm2h*-*"):
        owner = folder.name[4:].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            shutil.rmtree(folder, ignore_errors=True)
    return removed


@contextlib.contextmanager
def two_hosts(seed: int | None = None):
    """The two-host Ray cluster, torn down on exit whatever happened."""
    remove_abandoned()
    rng = random.Random(seed)
    pid, number = os.getpid(), rng.randrange(1000)
    subnet = free_subnet(rng)
    first, second = list(subnet.hosts())
    root = tempfile.mkdtemp(prefix=f"wm2h{pid}-")  # short: Ray's socket paths must stay under 108 characters
    hosts = TwoHosts(Host(f"wmA{pid}-{number}", f"wma{pid}-{number}", str(first), f"{root}/a"),
                     Host(f"wmB{pid}-{number}", f"wmb{pid}-{number}", str(second), f"{root}/b"), subnet,
                     env=dict(RAY_ENV))
    for host in hosts.hosts:
        os.makedirs(host.temp_dir)
    try:
        _make_namespaces(hosts)
        _start_ray(hosts, hosts.head, "--head", "--port", str(RAY_PORT), "--include-dashboard", "false")
        _wait_for_nodes(hosts, 1)
        _start_ray(hosts, hosts.worker, "--address", hosts.address)
        _wait_for_nodes(hosts, 2)
        yield hosts
    finally:
        for host in hosts.hosts:
            if os.path.exists(f"/run/netns/{host.netns}"):
                end_processes(host)
        for host in hosts.hosts:
            _run("ip", "netns", "del", host.netns, check=False)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # a manual check: bring the two hosts up, list the nodes, tear them down
    with two_hosts() as cluster:
        print(cluster.address, cluster.subnet, [h.pids() for h in cluster.hosts])
