"""Loopback networking helpers shared by the engine servers, the Prefect server and the trainer."""

from __future__ import annotations

import socket


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (bound and released; another process may take it before the caller).

    Check on the address the service will bind: a port bound on another address (a bridge's) looks free on
    loopback.
    """
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def interface_toward(peer: str) -> str:
    """The name of the local network interface this machine reaches ``peer`` (an IPv4 address) through.

    The kernel's route choice (a UDP socket connected to the peer sends nothing) gives the local
    address; the interface is the one holding it. For gloo (``GLOO_SOCKET_IFNAME``), which otherwise binds
    to whatever the hostname resolves to, an address a node in another network may not reach.

    Raises:
        OSError: no route to ``peer``, or no interface holds the address the route uses.
    """
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        local = s.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    raise OSError(f"no interface holds {local}, the local address of the route to {peer}")
