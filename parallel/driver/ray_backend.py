"""The Ray backend: the same workers as Ray actors on an existing cluster, one per GPU (or CPU slot).

The driver connects with ``ray.init(address=config.ray_address or "auto")`` unless Ray is already initialised
(tests start a local Ray themselves). The address is used exactly as given; a ``host:port`` address is first
probed with a plain TCP connect, and ``ray.init`` (which has no timeout of its own) runs in a thread that is
abandoned after ``RAY_CONNECT_TIMEOUT_S``, so an address that does not answer is an error naming it, not a hang.
Each actor runs the same rank session as a local worker (``worker/session.py``): only how requests arrive
and replies leave differs. It sends heartbeats through the progress queue while it runs a request. Rank 0's actor
hosts the process-group store; the ranks join with NCCL
on GPUs and gloo on CPUs. Requests go out once through the object store and every actor runs them; rank 0's
actor answers and reports progress through a Ray queue; a cancel is a concurrent actor call (actors run two
threads). Tensors travel as raw-byte numpy arrays, which Ray keeps in shared memory on each node.

The actor class is defined inside a function so that Ray ships it by value: the driver may know this pack
under any module name, while on the actors it is registered as ``wanmesh`` from the same folder (or from a
``wanmesh`` installed with pip on that node).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from .. import protocol as P
from ..config import ParallelConfig
from ..errors import RankDied
from .local import PACK_DIR
from ..transport import pack_for_ray, unpack_from_ray



RAY_CONNECT_TIMEOUT_S = 30.0
log = logging.getLogger("wanmesh.pool")


IDLE_PING_TIMEOUT_S = 5.0  # the idle liveness check's wait for an actor's answer
LOST_HOST_WAIT_S = 30.0  # after a failure, how long to wait for Ray to say whether a host of the pool is gone
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_towards(host: str) -> str | None:
    """The name of this machine's network interface that the route to ``host`` leaves from (``lo`` for this
    machine's own loopback), found by the source address a UDP socket connected there gets (no packet is sent);
    None when no interface has that address. gloo and NCCL otherwise bind to whatever the host name resolves to,
    which on many clusters is not the interface the other hosts reach."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        source = probe.getsockname()[0]
    for name, addresses in _interface_addresses().items():
        if source in addresses:
            return name
    return None


def _interface_addresses() -> dict[str, list[str]]:
    """Each interface's addresses: psutil's where it is installed, else each interface's IPv4 address asked from
    the kernel (Linux ``SIOCGIFADDR``; nodes need not have psutil)."""
    try:
        import psutil
    except ImportError:
        import fcntl
        import struct

        found: dict[str, list[str]] = {}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                except OSError:
                    continue  # no IPv4 address
                found[name] = [socket.inet_ntoa(packed[20:24])]
        return found
    return {name: [a.address.split("%")[0] for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addresses in psutil.net_if_addrs().items()}


def order_by_host(nodes: list[tuple[str, str]], driver_ip: str | None = None) -> list[int]:
    """Actor indices in rank order, given each actor's (node id, node IP): the actors of one host get consecutive
    ranks (tensor parallel groups are consecutive ranks, then Ulysses / ring, so the fastest-talking groups stay
    inside a host), hosts with more actors first, the driver's host first among equals, then by address."""
    members: dict[str, list[int]] = {}
    for index, (node_id, _) in enumerate(nodes):
        members.setdefault(node_id, []).append(index)
    ip_of = {node_id: ip for node_id, ip in nodes}
    order = sorted(members, key=lambda n: (-len(members[n]), ip_of[n] != driver_ip, ip_of[n], n))
    return [index for node_id in order for index in members[node_id]]


def slots_by_host(nodes: list[dict], resource: str) -> dict[str, float]:
    """``resource`` slots (CPU or GPU) of each live Ray node, by node address (from ``ray.nodes()``)."""
    slots: dict[str, float] = {}
    for node in nodes:
        if node.get("Alive"):
            ip = node.get("NodeManagerAddress", "?")
            slots[ip] = slots.get(ip, 0) + node.get("Resources", {}).get(resource, 0)
    return slots


def check_slots(world: int, resource: str, nodes: list[dict], address: str) -> None:
    """Bad input before any actor starts: a cluster with fewer ``resource`` slots than ``world``, in one line
    naming the slots each host has (and the hosts that left the cluster)."""
    slots = slots_by_host(nodes, resource)
    if sum(slots.values()) >= world:
        return
    found = ", ".join(f"{ip}: {count:g}" for ip, count in sorted(slots.items())) or "no live host"
    alive = set(slots)
    gone = sorted({n.get("NodeManagerAddress", "?") for n in nodes if not n.get("Alive")} - alive)
    left = f"; hosts that left the cluster: {', '.join(gone)}" if gone else ""
    raise ValueError(f"world={world} needs {world} {resource} slots but the Ray cluster at {address} has "
                     f"{sum(slots.values()):g} ({found}){left}; valid: a world of at most {sum(slots.values()):g}, "
                     "or more nodes (ray start --address on each)")


def _unreachable(address: str, why: str) -> P.WorkerError:
    return P.WorkerError(None, "RayUnreachable", f"the Ray cluster at {address!r} {why}; check the address "
                         "(host:port of the head node's GCS, e.g. 10.0.0.5:6379) and that the cluster is up")


def probe_address(address: str | None, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """TCP-connect to a ``host:port`` (or ``ray://host:port``) address as given; 'auto' and empty are not probed."""
    if not address or address in ("auto", "local"):
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"ray_address {address!r} is not valid; use host:port, ray://host:port or leave it empty (auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except socket.timeout:
        raise _unreachable(address, f"did not answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise _unreachable(address, f"cannot be reached ({exc.strerror or exc})") from None


def run_abandonable(fn: Callable[[], Any], timeout_s: float, address: str) -> Any:
    """Run ``fn`` (``ray.init``, which has no timeout argument) in a daemon thread; give up after ``timeout_s``."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="wanmesh-ray-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _unreachable(address, f"did not accept a connection within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def connect_ray(ray, address: str | None, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """``ray.init`` on ``address`` as given (None: 'auto'), bounded by ``timeout_s``."""
    if ray.is_initialized():
        return
    given = address or "auto"
    probe_address(given, timeout_s)
    run_abandonable(lambda: ray.init(address=given), timeout_s, given)


def _require_ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("backend='ray' needs Ray on the driver and every node: pip install 'ray[default]'") from None
    return ray


def check_ray_devices(config: ParallelConfig) -> None:
    if len(config.devices) > 1 or config.devices[0] not in ("auto", "cpu", "cuda"):
        raise ValueError(f"devices={','.join(config.devices)}: with backend='ray' use 'auto', 'cpu' or 'cuda' "
                         "(Ray places one actor per GPU)")


def check_ray_can_start(config: ParallelConfig) -> None:
    """What fails at once, checked before a live pool is replaced: Ray missing, devices Ray cannot place, an
    address that does not answer."""
    ray = _require_ray()
    check_ray_devices(config)
    if not ray.is_initialized():
        probe_address(config.ray_address or "auto")


def _actor_class(ray):
    class RayWorker:
        """One rank. Everything it needs is imported inside, under the package name ``wanmesh``."""

        def __init__(self, pack_dir: str, settings: dict, progress_queue):
            import importlib.util
            import sys
            import types

            if "wanmesh" not in sys.modules:
                if os.path.isdir(pack_dir):
                    locations = [pack_dir]
                else:
                    spec = importlib.util.find_spec("wanmesh")
                    if spec is None:
                        raise RuntimeError(f"the wanmesh pack is neither at {pack_dir} nor installed on this node")
                    locations = list(spec.submodule_search_locations)
                pack = types.ModuleType("wanmesh")
                pack.__path__ = locations
                sys.modules["wanmesh"] = pack
            self.rank = -1  # given by setup, once the driver has ordered the actors by host
            self.settings = settings
            self.queue = progress_queue
            self.session = None

        def node(self) -> tuple[str, str]:
            """(node id, node IP address) of the Ray node this actor runs on."""
            return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

        def rendezvous_address(self) -> tuple[str, int]:
            import socket

            host = ray.util.get_node_ip_address()
            with socket.socket() as probe:
                probe.bind((host, 0))
                return host, probe.getsockname()[1]

        def setup(self, rank: int, host: str, port: int) -> dict:
            """Join the process group as ``rank`` and start the rank's session (``worker/session.py``, as a local
            worker). gloo and NCCL bind to the interface of the route to rank 0's address unless the user named one."""
            import datetime
            import importlib

            import torch
            import torch.distributed as dist

            self.rank = rank
            backend = importlib.import_module("wanmesh.parallel.driver.ray_backend")
            interface = backend.interface_towards(host)
            for name in backend.SOCKET_IFNAME_VARIABLES:
                if interface:
                    os.environ.setdefault(name, interface)
            session_module = importlib.import_module("wanmesh.parallel.worker.session")
            config = importlib.import_module("wanmesh.parallel.config").ParallelConfig.from_dict(self.settings["config"])
            store = dist.TCPStore(host, port, config.world, is_master=self.rank == 0,
                                  timeout=datetime.timedelta(seconds=self.settings["pg_timeout_s"]))
            self.session = session_module.WorkerSession(
                config, self.rank, torch.device("cuda:0" if self.settings["gpu"] else "cpu"), store,
                pg_timeout_s=self.settings["pg_timeout_s"], collective_timeout_s=config.worker_timeout,
                diagnostics=self.settings.get("diagnostics"))
            self.session.start_heartbeats(lambda fields: self.queue.put_nowait({"kind": "heartbeat", "rank": self.rank,
                                                                                **fields}))
            self.session.preload_model_code()
            return {name: os.environ.get(name) for name in backend.SOCKET_IFNAME_VARIABLES}

        def execute(self, request_id: int, body: dict) -> dict:
            import importlib

            transport = importlib.import_module("wanmesh.parallel.transport")
            protocol = importlib.import_module("wanmesh.parallel.protocol")
            return self.session.run(
                body, request_id, transport.unpack_from_ray,
                lambda reply: protocol.encode_message(reply, transport.pack_for_ray),
                lambda fields: self.queue.put_nowait({"kind": "progress", "id": request_id, **fields}))

        def cancel(self, request_id: int) -> None:
            if self.session is not None:
                self.session.cancel(request_id)

        def live_input(self, request_id: int, fields: dict) -> None:
            if self.session is not None:
                self.session.live_input(request_id, fields)

        def pid(self) -> int:
            return os.getpid()

    return ray.remote(max_concurrency=2)(RayWorker)


class RayWorkers:
    """Actors of one pool generation; ``kill`` ends them all."""

    def __init__(self, config: ParallelConfig, pg_timeout_s: float, diagnostics: str | None):
        self.ray = _require_ray()
        check_ray_devices(config)
        self.config = config
        self.pg_timeout_s = pg_timeout_s
        self.diagnostics = os.path.abspath(diagnostics) if diagnostics else None
        self.actors: list[Any] = []
        self.nodes: list[tuple[str, str]] = []  # each rank's (Ray node id, node address)
        self.interfaces: list[dict] = []  # each rank's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
        self.store_address = ""
        self.driver_host = ""
        self.queue = None
        self._pending: dict[Any, int] = {}
        self._checked_loss = False

    def _use_gpus(self) -> bool:
        gpus = self.ray.cluster_resources().get("GPU", 0)
        wanted = self.config.devices[0]
        if wanted == "cuda" and gpus < self.config.world:
            raise ValueError(f"world={self.config.world} ranks need {self.config.world} GPUs, the Ray cluster has {gpus:g}")
        return wanted == "cuda" or (wanted == "auto" and gpus >= self.config.world)

    def start(self, timeout_s: float, should_cancel=None) -> None:
        """Check the cluster's slots, start one actor per rank, order them by host, join the process group."""
        ray = self.ray
        connect_ray(ray, self.config.ray_address)
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        gpu = self._use_gpus()
        check_slots(self.config.world, "GPU" if gpu else "CPU", ray.nodes(), self.config.ray_address or "auto")
        here = ray.get_runtime_context().get_node_id()  # the queue lives on the driver's host, not on one that may go
        self.driver_host = ray.util.get_node_ip_address()
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy":
                                          NodeAffinitySchedulingStrategy(here, soft=False)})
        settings = {"config": self.config.to_dict(), "gpu": gpu, "pg_timeout_s": self.pg_timeout_s,
                    "diagnostics": self.diagnostics}
        actor = _actor_class(ray).options(num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1)
        actors = self.actors = [actor.remote(PACK_DIR, settings, self.queue) for _ in range(self.config.world)]
        nodes = self._get([a.node.remote() for a in actors], timeout_s, "starting")
        order = order_by_host(nodes, self.driver_host)
        self.actors, self.nodes = [actors[i] for i in order], [nodes[i] for i in order]
        host, port = self._get(self.actors[0].rendezvous_address.remote(), timeout_s, "starting")
        hellos = [a.setup.remote(rank, host, port) for rank, a in enumerate(self.actors)]
        self.interfaces = self._get(hellos, timeout_s, "joining the process group")
        self.store_address = f"{host}:{port}"
        log.info("WanMesh Ray pool: %s; store at %s", self.placement_text(), self.store_address)

    def placement_text(self) -> str:
        """'ranks 0-1 on 10.0.0.5 (eth1), ranks 2-3 on 10.0.0.6 (eth1)': where the ranks run, in rank order."""
        parts, start = [], 0
        for rank in range(1, len(self.nodes) + 1):
            if rank == len(self.nodes) or self.hosts[rank] != self.hosts[start]:
                span = f"rank {start}" if rank - start == 1 else f"ranks {start}-{rank - 1}"
                interface = (self.interfaces[start] or {}).get("GLOO_SOCKET_IFNAME") if self.interfaces else None
                parts.append(f"{span} on {self.hosts[start]}" + (f" ({interface})" if interface else ""))
                start = rank
        return ", ".join(parts)

    @property
    def hosts(self) -> list[str]:
        """Each rank's host (its Ray node's address), in rank order."""
        return [ip for _, ip in self.nodes]

    def lost_ranks(self, wait_s: float) -> list[int]:
        """Ranks whose actor or whose host is gone, once Ray has decided about every rank or ``wait_s`` passed:
        a host's death is seen by Ray's health checks of its node, an actor's by a call to it failing."""
        ray = self.ray
        deadline = time.monotonic() + wait_s
        while True:
            dead_nodes = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
            lost = {rank for rank, (node_id, _) in enumerate(self.nodes) if node_id in dead_nodes}
            pings = {actor.pid.remote(): rank for rank, actor in enumerate(self.actors) if rank not in lost}
            ready, unknown = ray.wait(list(pings), num_returns=len(pings), timeout=1.0) if pings else ([], [])
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError:
                    lost.add(pings[ref])
            if not unknown or time.monotonic() > deadline:
                return sorted(lost)

    def lost_line(self, lost: list[int]) -> str:
        """'host 10.0.0.6 was lost with ranks 2, 3 (ranks 0, 1 on 10.0.0.5 remain)' for the lost ranks."""
        by_host: dict[str, list[int]] = {}
        for rank in lost:
            by_host.setdefault(self.hosts[rank], []).append(rank)
        dead_nodes = {n["NodeID"] for n in self.ray.nodes() if not n.get("Alive")}
        parts = []
        for ip, ranks in by_host.items():
            whole = all(self.hosts[r] != ip or r in lost for r in range(len(self.hosts)))
            gone = whole or any(self.nodes[r][0] in dead_nodes for r in ranks)
            listed = ", ".join(map(str, ranks))
            parts.append(f"host {ip} was lost with rank{'s' * (len(ranks) > 1)} {listed}" if gone
                         else f"the Ray actor{'s' * (len(ranks) > 1)} of rank{'s' * (len(ranks) > 1)} {listed} on "
                         f"host {ip} died")
        left = [r for r in range(len(self.hosts)) if r not in lost]
        remain = sorted({self.hosts[r] for r in left})
        many = len(left) > 1
        tail = f" (rank{'s' * many} {', '.join(map(str, left))} on {', '.join(remain)} remain{'s' * (not many)})" if left else ""
        return "; ".join(parts) + tail

    def _raise_if_lost(self) -> None:
        """After a rank failed: when Ray says a host (or actor) of the pool is gone, that is the cause to name."""
        if self._checked_loss:
            return
        self._checked_loss = True
        lost = self.lost_ranks(min(LOST_HOST_WAIT_S, self.config.worker_timeout))
        if lost:
            raise RankDied(lost[0], self.lost_line(lost))

    def _get(self, refs, timeout_s: float, what: str):
        ray = self.ray
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise P.WorkerError(None, "StartTimeout", f"the Ray actors did not finish {what} within {timeout_s:g} s "
                                f"(start_timeout_s); are {self.config.world} CPU/GPU slots free?") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise P.WorkerError(None, type(cause).__name__, f"while {what}: {cause}", str(exc)) from None

    def prepare(self, request: P.Request):
        """The request in the object store, put once for all actors."""
        return self.ray.put(P.encode_message(request, pack_for_ray))

    def send_request(self, request_id: int, body) -> None:
        self._pending = {a.execute.remote(request_id, body): rank for rank, a in enumerate(self.actors)}
        self._checked_loss = False

    def send_cancel(self, request_id: int) -> None:
        for actor in self.actors:
            actor.cancel.remote(request_id)

    def send_live(self, request_id: int, fields: dict) -> None:
        self.actors[0].live_input.remote(request_id, fields)

    def poll(self, timeout_s: float) -> list[tuple[int, dict]]:
        queued = self.queue.get_nowait_batch(self.queue.qsize()) if self.queue.qsize() else []
        messages = [(m.get("rank", 0), m) for m in queued]  # progress comes from rank 0, heartbeats from every rank
        if not self._pending:
            return messages
        ready, _ = self.ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0 if messages else timeout_s)
        for ref in ready:
            rank = self._pending.pop(ref)
            try:
                message = self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                self._raise_if_lost()
                raise RankDied(rank, "its Ray actor died") from None
            if message.get("kind") == "error":
                self._raise_if_lost()  # a peer's host gone shows first as a collective failing on this rank
            messages.append((rank, message))
        return messages

    def check_alive(self) -> None:
        """Raise RankDied for the first actor that is gone (the idle liveness check: one cheap call per actor;
        an actor too busy to answer within the check's time is not taken for dead)."""
        refs = [actor.pid.remote() for actor in self.actors]
        for rank, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=IDLE_PING_TIMEOUT_S)
            except self.ray.exceptions.RayActorError:
                lost = self.lost_ranks(IDLE_PING_TIMEOUT_S) or [rank]
                raise RankDied(lost[0], self.lost_line(lost)) from None
            except self.ray.exceptions.GetTimeoutError:
                continue

    def take_chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        return chunk  # its arrays came through Ray's object store already

    def decode_reply(self, body: dict[str, Any]) -> P.Reply:
        return P.decode_message(body, unpack_from_ray)

    def pids(self) -> list[int]:
        return []

    def actor_pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def shutdown(self, request_id: int) -> None:
        self.kill()

    def kill(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        if self.queue is not None:
            self.queue.shutdown(force=True)
        self.actors, self._pending, self.queue = [], {}, None
