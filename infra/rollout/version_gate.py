"""The policy version stamped by the vLLM server itself, and a weight update drained on the server side.

A client that updates a server's weights can drain only its own requests first; episodes on other
processes (Ray actors on other nodes) would have requests in flight across the update, their tokens
stamped with a version no client can know. :class:`VersionGateMiddleware` runs in the server's API
process (``--middleware``, beside :class:`~infra.rollout.engine_auth.EngineTokenMiddleware`, which
guards these routes too) and makes the server the one source of the version:

- every generation request (``/v1/completions``, ``/v1/chat/completions``) is admitted only while no
  update is in progress, and its response carries :data:`VERSION_HEADER`, the version of the weights
  it was sampled with (admission and completion see the same weights: an update waits for it);
- ``POST /agentrl/pause`` holds new generation requests and returns once none is in flight, from any
  client; ``POST /agentrl/resume?version=N`` records the version the weights are now and admits again.
  A pause not resumed within ``lease_s`` of its drain's end (query parameter, default 900 s) ends by
  itself, so a client killed mid-update does not leave the server holding work forever; if a
  ``/collective_rpc`` came during it, the weights may have changed to a version nobody named, so the
  server answers 503 to generation until a version is set (resume, or the POST below);
- ``GET /agentrl/version`` answers ``{"version", "paused", "in_flight"}``; ``POST /agentrl/version?version=N``
  declares the version of the weights the server holds now (the run's engine does, when it connects).

The version starts at ``$AGENTRL_POLICY_VERSION`` (default 0). The pattern is the client-side gate of
:class:`~infra.rollout.servers.ServerEngine` moved into the server (as SkyRL and AReaL pause generation
on the server before an in-flight weight update).
"""

from __future__ import annotations

import asyncio
import json
import os
from urllib.parse import parse_qs

VERSION_HEADER = "x-agentrl-policy-version"
VERSION_ENV = "AGENTRL_POLICY_VERSION"
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_LEASE_S = 900.0


class VersionGateMiddleware:
    """Pure ASGI middleware: version stamps on generation responses, and the pause/resume/version routes."""

    def __init__(self, app) -> None:
        """Wrap ``app``; the version starts at ``$AGENTRL_POLICY_VERSION``.

        Raises:
            ValueError: the variable is set but not an integer.
        """
        self.app = app
        raw = os.environ.get(VERSION_ENV, "0")
        try:
            self.version = int(raw)
        except ValueError:
            raise ValueError(f"VersionGateMiddleware: ${VERSION_ENV} must be an integer, got {raw!r}") from None
        self.paused, self.in_flight = False, 0
        self.unversioned = False  # weights changed under a lapsed pause: generation refused (503)
        self._weights_touched = False  # a /collective_rpc came during the current pause
        self._cond: asyncio.Condition | None = None  # made in the server's event loop, on first use
        self._lease: asyncio.TimerHandle | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def __call__(self, scope, receive, send) -> None:
        """Serve one request (see the module docstring)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith("/agentrl/"):
            await self._control(path, scope, send)
        elif path in GENERATE_PATHS:
            await self._generate(scope, receive, send)
        else:
            if path == "/collective_rpc" and self.paused:
                self._weights_touched = True  # until a version is set, no sample can be stamped truthfully
            await self.app(scope, receive, send)

    async def _generate(self, scope, receive, send) -> None:
        cond = self._condition()
        async with cond:
            while self.paused:
                await cond.wait()
            if self.unversioned:
                await _json(send, 503, {"error": "an update changed the weights and never said their version "
                                                 "(its client died or failed): no sample until one is set"})
                return
            self.in_flight += 1
            stamp = (VERSION_HEADER.encode(), str(self.version).encode())

        async def send_stamped(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), stamp]}
            await send(message)

        try:
            await self.app(scope, receive, send_stamped)
        finally:
            async with cond:
                self.in_flight -= 1
                cond.notify_all()

    async def _control(self, path: str, scope, send) -> None:
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        method = scope.get("method", "GET")
        cond = self._condition()
        try:
            if path == "/agentrl/pause" and method == "POST":
                lease_s = _number(query, "lease_s", float, DEFAULT_LEASE_S)
                async with cond:
                    self.paused = True
                    self._renew_lease(None)  # the lease runs from the end of the drain, not during it
                    while self.in_flight:
                        await cond.wait()
                    if not self.paused:  # resumed meanwhile by another client: this pause holds nothing
                        await _json(send, 409, {"error": "the pause ended before the drain did", **self._state()})
                        return
                    self._renew_lease(lease_s)
            elif path == "/agentrl/resume" and method == "POST":
                version = _number(query, "version", int)
                async with cond:
                    self.version, self.paused = version, False
                    self.unversioned = self._weights_touched = False
                    self._renew_lease(None)
                    cond.notify_all()
            elif path == "/agentrl/version" and method == "POST":
                version = _number(query, "version", int)
                async with cond:
                    self.version = version  # an update in progress stays in progress
                    self.unversioned = False
            elif path != "/agentrl/version" or method != "GET":
                await _json(send, 404, {"error": f"{method} {path}: not a route of this server"})
                return
        except ValueError as err:
            await _json(send, 400, {"error": f"{path}: {err}"})
            return
        await _json(send, 200, self._state())

    def _state(self) -> dict:
        return {"version": self.version, "paused": self.paused, "in_flight": self.in_flight,
                "unversioned": self.unversioned}

    def _renew_lease(self, lease_s: float | None) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        if lease_s is not None:
            handle: list[asyncio.TimerHandle] = []
            handle.append(asyncio.get_running_loop().call_later(
                lease_s, lambda: asyncio.ensure_future(self._expire(handle[0]))))
            self._lease = handle[0]

    async def _expire(self, lease: asyncio.TimerHandle) -> None:
        cond = self._condition()
        async with cond:
            if self._lease is not lease:  # renewed or ended since this timer was set
                return
            self.paused, self._lease = False, None
            if self._weights_touched:  # weights changed under this pause and no version followed
                self.unversioned, self._weights_touched = True, False
            cond.notify_all()


def _number(query: dict, name: str, kind, default=None):
    """``query[name]`` as ``kind``; ValueError naming the parameter when it is missing (no default) or malformed."""
    if name not in query:
        if default is None:
            raise ValueError(f"needs ?{name}=<{kind.__name__}>")
        return default
    try:
        return kind(query[name])
    except ValueError:
        raise ValueError(f"?{name}={query[name]!r} is not an {kind.__name__}") from None


async def _json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
