"""The mitmproxy addon of the egress proxy: sessions, policy, cache, mirrors and the per-session record.

Loaded by ``mitmdump -s`` in mitmproxy's own venv (``infra.egress.proxy`` starts it), with the repository
root on ``PYTHONPATH``; it imports only mitmproxy, the stdlib and ``infra.egress.policy``/``mirrors``.
Its one option, ``agentrl_config``, names a JSON file: ``sessions_dir``, ``records_dir``, ``cache_dir``
(empty: no cache), ``cache_patterns``, ``mirrors`` (``Mirror`` fields), ``upstream_ca``, ``pypi``.

A client authenticates with its session's token as the proxy user (``http://<token>:x@proxy:port``,
which curl, pip, uv, requests, apt, git and wget all send as ``Proxy-Authorization: Basic``); a
request without a known token gets ``407``. For https the token comes with ``CONNECT`` and holds for
the connection. Each request, in order: the policy (a host the session may not reach gets ``403`` with
a body naming the session's policy), a mirror, the cache, then the outside. The proxy connects
upstream lazily (``connection_strategy=lazy``), so a host that does not resolve can still be denied
or mirrored. Every request is one JSON line in ``records_dir/<token>.jsonl``. The proxy shuts itself down
when the process that started it is gone.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import ipaddress
import json
import os
import socket
import time
import urllib.error
import uuid
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from mitmproxy import ctx, http

from infra.egress import mirrors as mirror_sources
from infra.egress.policy import Mirror, Session, cacheable, host_allowed, match_mirror

HEADER = "X-Agentrl-Egress"
WEB_PORTS = (80, 443)
"""Ports a ``CONNECT`` may name: a tunnel elsewhere (ssh on 22, a database) is refused."""


_INTERNAL_NETS = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "::/128", "::1/128", "fc00::/7", "fe80::/10", "ff00::/8"))
"""Loopback, RFC 1918 and carrier-grade NAT ranges, link-local (cloud metadata), multicast, reserved. Not the
documentation ranges, which some networks route (a gateway that answers every name, as this project's CI)."""


def _internal(address: str) -> bool:
    """Whether ``address`` (an IP) is internal (:data:`_INTERNAL_NETS`) or one of this machine's own."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in net for net in _INTERNAL_NETS if net.version == ip.version):
        return True
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as s:  # binding works only to an address of this machine
        try:
            s.bind((str(ip), 0))
            return True
        except OSError:
            return False


def _named(host: str, session: Session) -> bool:
    """Whether the session's allowlist names ``host`` itself (not through ``*``): internal addresses need that."""
    return host_allowed(host, tuple(p for p in session.allow if p != "*"))


class _Tee:
    """A response's stream callable: passes chunks on and counts them.

    For a cacheable GET it also writes them to a temporary file, committed to the cache when the body
    ended whole (``Content-Length`` bytes, if given).
    """

    def __init__(self, addon: Egress, flow: http.HTTPFlow, cache_url: str | None) -> None:
        self.addon, self.flow, self.cache_url, self.n = addon, flow, cache_url, 0
        self.tmp = None
        if cache_url is not None:
            blobs = Path(addon.config["cache_dir"]) / "blobs"
            blobs.mkdir(parents=True, exist_ok=True)
            self.path = blobs / f".{uuid.uuid4().hex}.tmp"
            self.tmp = open(self.path, "wb")  # noqa: SIM115 - closed at the end of the body
            self.sha = hashlib.sha256()

    def __call__(self, chunk: bytes) -> bytes:
        if chunk:
            self.n += len(chunk)
            if self.tmp is not None:
                self.tmp.write(chunk)
                self.sha.update(chunk)
        elif self.tmp is not None:  # end of the body
            self.tmp.close()
            self.tmp = None
            expected = self.flow.response.headers.get("Content-Length") if self.flow.response else None
            if expected is None or (expected.isdigit() and int(expected) == self.n):
                try:
                    self.addon._cache_commit(self.cache_url, self.path, self.sha.hexdigest(), self.n,
                                             self.flow.response.headers)
                except OSError as e:  # a full disk: the client still gets its body, the cache does not
                    ctx.log.warn(f"agentrl egress: caching {self.cache_url} failed: {e}")
            self.path.unlink(missing_ok=True)
        self.flow.metadata["agentrl_bytes"] = self.n
        return chunk


def _token(headers: http.Headers) -> str:
    value = headers.get("Proxy-Authorization", "")
    if not value.lower().startswith("basic "):
        return ""
    try:
        user = base64.b64decode(value[6:].strip()).decode(errors="replace")
    except (binascii.Error, ValueError):
        return ""
    return user.split(":", 1)[0]


class Egress:
    """Session lookup, policy, mirrors, content-addressed cache and the record (see the module docstring)."""

    def __init__(self) -> None:
        self.config: dict = {}
        self.sessions: dict[str, Session] = {}
        self.connections: dict[str, str] = {}  # client connection id -> token (from CONNECT)
        self.mirrors: list[Mirror] = []
        self.mirror_hosts: set[str | None] = set()

    def running(self) -> None:  # noqa: D102 - mitmproxy hook
        self._parent = os.getppid()
        self._watch = asyncio.get_running_loop().create_task(self._exit_with_parent())

    async def _exit_with_parent(self) -> None:
        """Shut down once the process that started the proxy is gone (killed runs leave no proxy behind)."""
        while os.getppid() == self._parent:
            await asyncio.sleep(1.0)
        ctx.master.shutdown()

    def load(self, loader) -> None:  # noqa: D102 - mitmproxy hook
        loader.add_option("agentrl_config", str, "", "agentrl egress config (JSON file)")

    def configure(self, updated) -> None:  # noqa: D102 - mitmproxy hook
        if "agentrl_config" in updated and ctx.options.agentrl_config:
            self.config = json.loads(Path(ctx.options.agentrl_config).read_text())
            self.mirrors = [Mirror(**m) for m in self.config.get("mirrors", [])]
            # a url mirror's source is the run's own declaration: reached whatever the session's policy
            self.mirror_hosts = {urlsplit(m.source).hostname for m in self.mirrors if m.kind == "url"}

    # ------------------------------------------------------------ sessions and records

    def _session(self, token: str) -> Session | None:
        if not token or "/" in token or token.startswith("."):
            return None
        if token not in self.sessions:
            path = Path(self.config["sessions_dir"]) / f"{token}.json"
            if not path.is_file():
                return None
            self.sessions[token] = Session.from_json(json.loads(path.read_text()))
        return self.sessions[token]

    def _record(self, flow: http.HTTPFlow, source: str, **extra) -> None:
        if flow.metadata.get("agentrl_recorded"):
            return
        flow.metadata["agentrl_recorded"] = True
        token = flow.metadata.get("agentrl_token", "")
        if not token:
            return
        r = flow.response
        size = flow.metadata.get("agentrl_bytes")
        if size is None:
            size = len(r.raw_content or b"") if r is not None and r.raw_content is not None else 0
        line = {"t": round(time.time(), 3), "method": flow.request.method, "host": flow.request.host,
                "url": (flow.metadata.get("agentrl_url") or flow.request.url)[:300],
                "status": r.status_code if r else 0,
                "bytes": size, "source": source, **extra}
        with open(Path(self.config["records_dir"]) / f"{token}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    # ------------------------------------------------------------ hooks

    def http_connect(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        token = _token(flow.request.headers)
        session = self._session(token)
        if session is None:
            flow.response = self._refuse_auth()
            return
        self.connections[flow.client_conn.id] = token
        flow.metadata["agentrl_token"] = token
        if flow.request.port not in WEB_PORTS:
            self._deny(flow, session, f"CONNECT to port {flow.request.port} (only {WEB_PORTS} are tunnelled)")
        elif not session.allows(flow.request.host):
            self._deny(flow, session)

    def tls_clienthello(self, data) -> None:  # noqa: D102 - mitmproxy hook
        session = self._session(self.connections.get(data.context.client.id, ""))
        if session is not None and not session.intercept:
            data.ignore_connection = True  # its client does not trust our CA: passed through, CONNECT-checked

    async def server_connect(self, data) -> None:  # noqa: D102 - mitmproxy hook
        """The last check before any byte leaves, on the real destination.

        The session's policy, and no internal address (the host's own ports, private networks) unless the
        allowlist names that host. (The check resolves the name; a name that resolves differently a moment
        later, DNS rebinding, is not defended.)
        """
        session = self._session(self.connections.get(data.client.id, ""))
        host, port = data.server.address
        if session is None:
            data.server.error = "agentrl egress: no session for this connection"
            return
        if host in self.mirror_hosts:
            return
        if not session.allows(host):
            data.server.error = f"agentrl egress: {host} is not allowed for {session.label}"
            return
        if _named(host, session):
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            data.server.error = f"agentrl egress: cannot resolve {host}: {e}"
            return
        internal = sorted({info[4][0] for info in infos if _internal(info[4][0])})
        if internal:
            data.server.error = (f"agentrl egress: {host} is an internal address ({', '.join(internal)}); "
                                 "name it in the task's allowlist or tasks.egress.allow to reach it")

    def client_disconnected(self, client) -> None:  # noqa: D102 - mitmproxy hook
        self.connections.pop(client.id, None)

    async def request(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        token = self.connections.get(flow.client_conn.id) or _token(flow.request.headers)
        flow.request.headers.pop("Proxy-Authorization", None)
        session = self._session(token)
        if session is None:
            flow.response = self._refuse_auth()
            return
        self.connections.setdefault(flow.client_conn.id, token)  # plain http: server_connect looks it up
        flow.metadata["agentrl_token"] = token
        # the real destination (the CONNECT target in a tunnel, the absolute URL's host otherwise), never the
        # Host header, which the client chooses: policy, mirrors, cache keys and the record all use it
        host, url = flow.request.host, flow.request.url
        if not session.allows(host):
            self._deny(flow, session)
            return
        if (hit := match_mirror(url, self.mirrors)) is not None:
            await self._mirror(flow, *hit)
            if flow.response is not None or flow.metadata.get("agentrl_mirror"):
                return
        if (self.config.get("cache_dir") and "Range" not in flow.request.headers
                and cacheable(flow.request.method, url, self.config["cache_patterns"])):
            cached = self._cache_get(url)  # (a range request goes out: a whole body is not what it asked for)
            if cached is not None:
                flow.response = self._replay(*cached, "cache")
                self._record(flow, "cache")

    def responseheaders(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        """Stream every upstream body, counted and, for a versioned artifact, written to the cache as it passes.

        Nothing is buffered, so a client's read timeout never sees the proxy wait for a whole body.
        """
        if flow.metadata.get("agentrl_recorded") or flow.response is None or "agentrl_token" not in flow.metadata:
            return
        url = flow.metadata.get("agentrl_url") or flow.request.url
        cache = (not flow.metadata.get("agentrl_mirror") and self.config.get("cache_dir")
                 and flow.response.status_code == 200 and "Authorization" not in flow.request.headers
                 and cacheable(flow.request.method, url, self.config["cache_patterns"])
                 and "no-store" not in flow.response.headers.get("Cache-Control", ""))
        flow.response.stream = _Tee(self, flow, url if cache else None)

    def response(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        if flow.metadata.get("agentrl_recorded") or flow.response is None:
            return
        self._record(flow, flow.metadata.get("agentrl_mirror") or "upstream")

    def error(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        self._record(flow, "error", error=str(flow.error)[:200] if flow.error else "")

    # ------------------------------------------------------------ mirrors and cache

    async def _mirror(self, flow: http.HTTPFlow, mirror: Mirror, match: dict[str, str]) -> None:
        url = flow.request.url
        headers = {"Content-Type": "application/octet-stream", HEADER: f"mirror {mirror.name}"}
        if mirror.kind == "url":
            if ".." in PurePosixPath(unquote(match["path"])).parts:
                flow.response = http.Response.make(400, f"agentrl egress: {url}: a path with '..' is not mirrored\n"
                                                   .encode(), {"Content-Type": "text/plain", HEADER: "mirror-error"})
                self._record(flow, f"mirror {mirror.name}")
                return
            flow.metadata["agentrl_mirror"] = f"mirror {mirror.name}"
            flow.metadata["agentrl_url"] = url
            query = f"?{flow.request.url.split('?', 1)[1]}" if "?" in flow.request.url else ""
            flow.request.url = mirror.source.rstrip("/") + "/" + match["path"].lstrip("/") + query
            return
        if mirror.kind == "exclude-newer":
            await self._exclude_newer(flow, mirror)
            return
        try:
            if mirror.kind == "folder":
                body = mirror_sources.folder_file(mirror.source, match["path"])
            else:
                body = await asyncio.to_thread(self._uv, url, match, mirror)
        except (LookupError, OSError, ValueError) as e:
            text = f"agentrl egress: mirror {mirror.name} cannot serve {url}: {e}\n".encode()
            flow.response = http.Response.make(502, text, {"Content-Type": "text/plain", HEADER: "mirror-error"})
            self._record(flow, f"mirror {mirror.name}", error=str(e)[:200])
            return
        if body is None:
            text = f"agentrl egress: mirror {mirror.name} has no file for {url}\n".encode()
            flow.response = http.Response.make(404, text, {"Content-Type": "text/plain", HEADER: "mirror-miss"})
        else:
            if match.get("what") == "installer":
                headers["Content-Type"] = "text/x-shellscript"
            flow.response = http.Response.make(200, body, headers)
        self._record(flow, f"mirror {mirror.name}")

    async def _exclude_newer(self, flow: http.HTTPFlow, mirror: Mirror) -> None:
        """A project page without the files uploaded at or after the mirror's cutoff.

        (``mirrors.index_page_before``); the index's own error status (a missing project's ``404``) is passed on.
        """
        url, name = flow.request.url, f"mirror {mirror.name}"
        accept = flow.request.headers.get("Accept", "text/html")
        try:
            body, content_type, dropped = await asyncio.to_thread(
                mirror_sources.index_page_before, url, mirror_sources.parse_cutoff(mirror.source), accept,
                self.config.get("upstream_ca") or None)
        except urllib.error.HTTPError as e:
            flow.response = http.Response.make(e.code, f"agentrl egress: {url}: the index answered {e.code}\n"
                                               .encode(), {"Content-Type": "text/plain", HEADER: name})
            self._record(flow, name)
            return
        except (OSError, ValueError) as e:
            text = f"agentrl egress: mirror {mirror.name} cannot serve {url}: {e}\n".encode()
            flow.response = http.Response.make(502, text, {"Content-Type": "text/plain", HEADER: "mirror-error"})
            self._record(flow, name, error=str(e)[:200])
            return
        flow.response = http.Response.make(200, body, {"Content-Type": content_type, HEADER: name})
        self._record(flow, name, dropped=dropped)

    def _uv(self, url: str, match: dict[str, str], mirror: Mirror) -> bytes:
        pypi = mirror.source or self.config.get("pypi", "https://pypi.org")
        cafile = self.config.get("upstream_ca") or None
        version = mirror_sources.uv_version(match.get("version", ""), pypi, cafile)
        if match["what"] == "installer":
            return mirror_sources.uv_installer_script(version, url)
        key = f"mirror:{url}"
        if self.config.get("cache_dir") and (cached := self._cache_get(key)) is not None:
            return cached[0]  # (stored unencoded)
        body = mirror_sources.uv_release_archive(version, match["arch"], match["libc"], pypi, cafile)
        if self.config.get("cache_dir"):
            self._cache_put(key, http.Response.make(200, body, {"Content-Type": "application/gzip"}))
        return body

    def _cache_paths(self, url: str) -> tuple[Path, Path]:
        root = Path(self.config["cache_dir"])
        return root / "index" / f"{hashlib.sha256(url.encode()).hexdigest()}.json", root / "blobs"

    def _cache_get(self, url: str) -> tuple[bytes, dict[str, str]] | None:
        """The body as it was received (encoded as its ``Content-Encoding`` says) and the headers to replay."""
        index, blobs = self._cache_paths(url)
        try:
            entry = json.loads(index.read_text())
            return (blobs / entry["sha256"]).read_bytes(), entry.get("headers", {})
        except (OSError, ValueError, KeyError):
            return None

    def _cache_commit(self, url: str, body_file: Path, digest: str, size: int, headers) -> None:
        """Store a received body (``body_file``, renamed into place) under its sha256, and ``url``'s index entry."""
        index, blobs = self._cache_paths(url)
        kept = {k: headers[k] for k in ("Content-Type", "Content-Encoding", "ETag", "Last-Modified") if k in headers}
        body_file.replace(blobs / digest)
        self._write(index, json.dumps({"url": url, "sha256": digest, "size": size, "headers": kept}).encode())

    def _cache_put(self, url: str, response: http.Response) -> None:
        index, blobs = self._cache_paths(url)
        body = response.raw_content if response.raw_content is not None else b""
        digest = hashlib.sha256(body).hexdigest()
        headers = {k: response.headers[k] for k in ("Content-Type", "Content-Encoding") if k in response.headers}
        self._write(blobs / digest, body)
        self._write(index, json.dumps({"url": url, "sha256": digest, "size": len(body), "headers": headers}).encode())

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)

    @staticmethod
    def _replay(body: bytes, headers: dict[str, str], source: str) -> http.Response:
        """A response carrying ``body`` exactly as stored (no re-encoding) with its headers."""
        r = http.Response.make(200, b"", {**headers, HEADER: source})
        r.raw_content = body
        r.headers["Content-Length"] = str(len(body))
        return r

    def _deny(self, flow: http.HTTPFlow, session: Session, what: str = "") -> None:
        host = flow.request.host
        why = what or f"host {host} is not allowed"
        body = (f"agentrl egress: {flow.request.method} {flow.request.url} denied: {why} for {session.label} "
                f"({session.phase} phase; policy: {session.policy}; allowed: {', '.join(session.allow) or 'none'}). "
                "Allow it with tasks.egress.allow or the task's allowlist.\n").encode()
        flow.response = http.Response.make(403, body, {"Content-Type": "text/plain", HEADER: "denied"})
        self._record(flow, "denied")

    @staticmethod
    def _refuse_auth() -> http.Response:
        return http.Response.make(407, b"agentrl egress: this proxy serves agentrl sandboxes and builds only "
                                  b"(no or unknown session in Proxy-Authorization)\n",
                                  {"Proxy-Authenticate": 'Basic realm="agentrl egress"', "Content-Type": "text/plain"})


addons = [Egress()]
