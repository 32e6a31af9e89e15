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
import json
import os
import time
from pathlib import Path

from mitmproxy import ctx, http

from infra.egress import mirrors as mirror_sources
from infra.egress.policy import Mirror, Session, cacheable, match_mirror

HEADER = "X-Agentrl-Egress"


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
        line = {"t": round(time.time(), 3), "method": flow.request.method, "host": flow.request.pretty_host,
                "url": flow.request.pretty_url[:300], "status": r.status_code if r else 0,
                "bytes": len(r.raw_content or b"") if r is not None and r.raw_content is not None else 0,
                "source": source, **extra}
        with open(Path(self.config["records_dir"]) / f"{token}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    # ------------------------------------------------------------ hooks

    def http_connect(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        token = _token(flow.request.headers)
        if self._session(token) is None:
            flow.response = self._refuse_auth()
            return
        self.connections[flow.client_conn.id] = token

    def client_disconnected(self, client) -> None:  # noqa: D102 - mitmproxy hook
        self.connections.pop(client.id, None)

    async def request(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        token = self.connections.get(flow.client_conn.id) or _token(flow.request.headers)
        flow.request.headers.pop("Proxy-Authorization", None)
        session = self._session(token)
        if session is None:
            flow.response = self._refuse_auth()
            return
        flow.metadata["agentrl_token"] = token
        host, url = flow.request.pretty_host, flow.request.pretty_url
        if not session.allows(host):
            body = (f"agentrl egress: {flow.request.method} {url} denied: host {host} is not allowed for "
                    f"{session.label} ({session.phase} phase; policy: {session.policy}; allowed: "
                    f"{', '.join(session.allow) or 'none'}). Allow it with tasks.egress.allow or the task's "
                    "allowlist.\n").encode()
            flow.response = http.Response.make(403, body, {"Content-Type": "text/plain", HEADER: "denied"})
            self._record(flow, "denied")
            return
        if (hit := match_mirror(url, self.mirrors)) is not None:
            await self._mirror(flow, *hit)
            if flow.response is not None or flow.metadata.get("agentrl_mirror"):
                return
        if self.config.get("cache_dir") and cacheable(flow.request.method, url, self.config["cache_patterns"]):
            cached = self._cache_get(url)
            if cached is not None:
                body, headers = cached
                flow.response = http.Response.make(200, body, {**headers, HEADER: "cache"})
                self._record(flow, "cache")

    def response(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        if flow.metadata.get("agentrl_recorded") or flow.response is None:
            return
        source = flow.metadata.get("agentrl_mirror") or "upstream"
        url = flow.metadata.get("agentrl_url") or flow.request.pretty_url
        if (source == "upstream" and self.config.get("cache_dir") and flow.response.status_code == 200
                and cacheable(flow.request.method, url, self.config["cache_patterns"])
                and "no-store" not in flow.response.headers.get("Cache-Control", "")
                and flow.response.raw_content is not None):
            self._cache_put(url, flow.response)
        self._record(flow, source)

    def error(self, flow: http.HTTPFlow) -> None:  # noqa: D102 - mitmproxy hook
        self._record(flow, "error", error=str(flow.error)[:200] if flow.error else "")

    # ------------------------------------------------------------ mirrors and cache

    async def _mirror(self, flow: http.HTTPFlow, mirror: Mirror, match: dict[str, str]) -> None:
        url = flow.request.pretty_url
        headers = {"Content-Type": "application/octet-stream", HEADER: f"mirror {mirror.name}"}
        if mirror.kind == "url":
            flow.metadata["agentrl_mirror"] = f"mirror {mirror.name}"
            flow.metadata["agentrl_url"] = url
            flow.request.url = mirror.source.rstrip("/") + "/" + match["path"].lstrip("/")
            return
        try:
            if mirror.kind == "folder":
                body = mirror_sources.folder_file(mirror.source, match["path"])
            else:
                body = await asyncio.to_thread(self._uv, url, match, mirror)
        except (LookupError, OSError) as e:
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

    def _uv(self, url: str, match: dict[str, str], mirror: Mirror) -> bytes:
        pypi = mirror.source or self.config.get("pypi", "https://pypi.org")
        cafile = self.config.get("upstream_ca") or None
        version = mirror_sources.uv_version(match.get("version", ""), pypi, cafile)
        if match["what"] == "installer":
            return mirror_sources.uv_installer_script(version, url)
        key = f"mirror:{url}"
        if self.config.get("cache_dir") and (cached := self._cache_get(key)) is not None:
            return cached[0]
        body = mirror_sources.uv_release_archive(version, match["arch"], match["libc"], pypi, cafile)
        if self.config.get("cache_dir"):
            self._cache_put(key, http.Response.make(200, body, {"Content-Type": "application/gzip"}))
        return body

    def _cache_paths(self, url: str) -> tuple[Path, Path]:
        root = Path(self.config["cache_dir"])
        return root / "index" / f"{hashlib.sha256(url.encode()).hexdigest()}.json", root / "blobs"

    def _cache_get(self, url: str) -> tuple[bytes, dict[str, str]] | None:
        index, blobs = self._cache_paths(url)
        try:
            entry = json.loads(index.read_text())
            return (blobs / entry["sha256"]).read_bytes(), entry.get("headers", {})
        except (OSError, ValueError, KeyError):
            return None

    def _cache_put(self, url: str, response: http.Response) -> None:
        index, blobs = self._cache_paths(url)
        body = response.raw_content if response.raw_content is not None else b""
        if response.headers.get("Content-Encoding"):
            body = response.content or b""
        digest = hashlib.sha256(body).hexdigest()
        headers = {k: response.headers[k] for k in ("Content-Type", "ETag", "Last-Modified") if k in response.headers}
        for path, data in ((blobs / digest, body),
                           (index, json.dumps({"url": url, "sha256": digest, "size": len(body),
                                               "headers": headers}).encode())):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)

    @staticmethod
    def _refuse_auth() -> http.Response:
        return http.Response.make(407, b"agentrl egress: this proxy serves agentrl sandboxes and builds only "
                                  b"(no or unknown session in Proxy-Authorization)\n",
                                  {"Proxy-Authenticate": 'Basic realm="agentrl egress"', "Content-Type": "text/plain"})


addons = [Egress()]
