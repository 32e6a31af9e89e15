"""Loopback networking helpers shared by the engine servers, the Prefect server and the trainer."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound and released; another process may take it before the caller)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
