"""Linux network namespaces as test machines: one bridge on a private subnet, one namespace per node.

The host end of the bridge is ``{SUBNET}.1``; node ``i`` (from 0) is ``{SUBNET}.{i + 2}`` in its own
namespace with its own loopback. Traffic stays on the bridge (no route to anything else is added), and
everything is removed on exit, processes left in a namespace included.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from infra.net import free_port

SUBNET = "10.231.7"  # /24, private, created and removed by the test
HOST = f"{SUBNET}.1"  # the flow machine's end of the bridge


@dataclass(frozen=True)
class Node:
    """One namespace: its name, its address on the bridge, and the prefix that runs a command in it."""

    netns: str
    address: str

    @property
    def launcher(self) -> tuple[str, ...]:
        """``ip netns exec <netns>``: prepend to a command to run it on this node."""
        return ("ip", "netns", "exec", self.netns)

    def pids(self) -> list[int]:
        """Processes running in this namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def nodes(count: int, subnet: str = SUBNET):
    """Create ``count`` namespaced nodes on a fresh bridge; yields their :class:`Node` s; removes it all.

    Test files that may run at once (pytest-xdist workers) each use a ``subnet`` (``a.b.c``) of their own.

    Raises:
        RuntimeError: the subnet is already routed on this machine (another test's bridge, or a real network).
    """
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    if f"{subnet}." in routes:
        raise RuntimeError(f"{subnet}.0/24 is already routed here; remove it or change tests.integration.netns.SUBNET")
    tag = uuid.uuid4().hex[:6]
    bridge, made = f"art{tag}", []
    firewall = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]  # Docker's FORWARD policy drops bridged traffic
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        subprocess.run(["iptables", "-I", *firewall], capture_output=True)
        for i in range(count):
            node = Node(f"agentrl-{tag}-{i}", f"{subnet}.{i + 2}")
            host_end, node_end = f"vh{tag}{i}", f"vn{tag}{i}"
            _ip("netns", "add", node.netns)
            made.append(node)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
            _ip("link", "set", node_end, "netns", node.netns)
            _ip("link", "set", host_end, "master", bridge, "up")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node_end)
            _ip("-n", node.netns, "link", "set", node_end, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        yield made
    finally:
        for node in made:
            for pid in node.pids():
                subprocess.run(["kill", "-9", str(pid)], capture_output=True)
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)  # its veth goes with it
        subprocess.run(["iptables", "-D", *firewall], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@contextmanager
def forward(target: tuple[str, int], host: str = HOST):
    """Forward TCP connections to ``host:<port>`` on to ``target`` (a loopback service the nodes cannot reach).

    Bytes pass unchanged (an HTTP ``Host`` header stays the one the client sent). Yields the port.
    """
    server = socket.create_server((host, 0))
    port = server.getsockname()[1]

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def accept() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(target)
            threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()

    threading.Thread(target=accept, name="netns-forward", daemon=True).start()
    try:
        yield port
    finally:
        try:
            server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (Linux)
        except OSError:
            pass
        server.close()


def nsenter(node) -> list[str]:
    """Enter the node's network namespace only (``ip netns exec`` remounts /sys: dockerd then finds no cgroups)."""
    return ["nsenter", f"--net=/var/run/netns/{node.netns}"]


def stop_group(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> None:
    """Signal ``proc``'s process group (it started a session) and wait for ``proc``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def ray_ports() -> list[str]:
    """Free ports for a Ray node's fixed-port services (defaults such as 52365 and 10001 would collide with
    another Ray on this machine, e.g. test_ray's, running at the same time)."""
    names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "node-manager-port", "object-manager-port")
    ports: set[int] = set()
    while len(ports) < len(names):  # free_port can give a port twice (each is free once closed): Ray refuses that
        ports.add(free_port())
    return [f"--{n}={p}" for n, p in zip(names, sorted(ports), strict=True)]


def forget_ray_cluster(address: str) -> None:
    """Remove Ray's record of the cluster ``ray start --head`` made (a plain ray.init() would try to join it)."""
    record = Path("/tmp/ray/ray_current_cluster")
    if record.exists() and address in record.read_text():
        record.unlink()


def node_dockerd(node, root: Path, log: Path, stack: ExitStack):
    """Start a dockerd in ``node``'s namespace (own data root and socket); returns ``(client, DOCKER_HOST)``."""
    import docker

    sock = f"unix://{root}/docker.sock"
    stack.callback(shutil.rmtree, root, ignore_errors=True)
    proc = subprocess.Popen([*nsenter(node), "dockerd", "--data-root", str(root / "data"), "--exec-root",
                             str(root / "exec"), "--pidfile", str(root / "pid"), "-H", sock, "--bridge=none",
                             "--iptables=false", "--ip6tables=false"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    stack.callback(stop_group, proc)
    deadline = time.monotonic() + 60
    while True:
        try:
            client = docker.DockerClient(base_url=sock, timeout=120)  # asks the engine's API version
            stack.callback(client.close)
            return client, sock
        except Exception:  # noqa: BLE001 - not up yet
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.5)


def ray_cluster(host: str, node, head_env: dict, node_env: dict, log_dir: Path, stack: ExitStack,
                node_cpus: int = 2) -> str:
    """A Ray head on ``host`` with no CPUs and a worker node with ``node_cpus`` in ``node``'s namespace.

    ``node_env``: the worker node's environment (``DOCKER_HOST`` of its dockerd, S3, auth), which its
    workers inherit. Both are stopped (SIGKILL) and the head's record forgotten when ``stack`` closes.
    Returns the head's address (``host:port``).
    """
    import sys

    ray = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    head = subprocess.Popen([ray, "start", "--head", f"--node-ip-address={host}", f"--port={port}", "--num-cpus=0",
                             "--include-dashboard=false", "--disable-usage-stats", "--block",
                             f"--object-store-memory={200 * 1024**2}", f"--ray-client-server-port={free_port()}",
                             *ray_ports()], env=head_env,
                            stdout=open(log_dir / "ray-head.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    stack.callback(forget_ray_cluster, f"{host}:{port}")
    stack.callback(stop_group, head, signal.SIGKILL)
    worker = subprocess.Popen([*nsenter(node), ray, "start", f"--address={host}:{port}",
                               f"--node-ip-address={node.address}", f"--num-cpus={node_cpus}", "--disable-usage-stats",
                               "--block", f"--object-store-memory={200 * 1024**2}", *ray_ports()], env=node_env,
                              stdout=open(log_dir / "ray-node.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                              start_new_session=True)
    stack.callback(stop_group, worker, signal.SIGKILL)
    return f"{host}:{port}"
