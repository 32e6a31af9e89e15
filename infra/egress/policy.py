"""Egress rules as pure functions: which host a session may reach, what is cached, which mirror serves a URL.

Stdlib only: the proxy's addon (``infra.egress.addon``, in mitmproxy's own venv) imports this module.

Host patterns are ``fnmatch`` patterns matched case-insensitively against the request's host
(``pypi.org``, ``*.pythonhosted.org``); ``*`` alone allows every host. A Harbor task's
``allowed_hosts`` use the same form (``*.cursor.com``), as Harbor does.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

PHASES = ("agent", "verifier", "build")
"""Who made a request: the agent's commands (and a reference solution run as the agent would), the
task's tests, or an image build."""

DEFAULT_CACHE_PATTERNS = (
    "https://files.pythonhosted.org/packages/*",  # PyPI's files: the path holds the file's hash
    "*.whl",  # a wheel's name holds its version and build (PEP 427), re-uploads are refused
    "http://*/pool/*.deb", "https://*/pool/*.deb",  # Debian/Ubuntu pool files: name_version_arch
    "https://astral.sh/uv/[0-9]*/install.sh",
    "https://github.com/*/releases/download/*",  # a release's assets, by tag
    "https://huggingface.co/*/resolve/" + "[0-9a-f]" * 40 + "/*",  # by 40-hex revision
    "https://registry.npmjs.org/*/-/*.tgz",
    "https://static.crates.io/crates/*",
)
"""URLs of versioned artifacts (package files, installers, model files by revision): a response to a GET
of one is the same bytes every time, so it is cached content-addressed across episodes and runs. Not:
index pages (``/simple/<name>/``), apt's ``Release``/``Packages`` lists, branches and ``latest``, a
request with ``Authorization`` (a gated file), nor archives in general (``archive/refs/heads/main.zip``
changes). Redirects are not cached (a release asset's signed, expiring download URL never repeats)."""

_UNVERSIONED = re.compile(r"(?i)(/latest(/|$)|[?&]ref=|/(resolve|raw|archive|blob|tree)/(main|master|HEAD)[/.]|"
                          r"/refs/heads/)")


@dataclass(frozen=True)
class Session:
    """One sandbox's or build's proxy credentials and what they may reach.

    Attributes:
        token: the proxy user name (random; the sandbox's ``HTTP_PROXY`` carries it).
        phase: one of :data:`PHASES`.
        label: what it belongs to (task id), named in a denial.
        allow: host patterns the session may reach; ``("*",)``: every host (but internal addresses, which
            only a pattern naming the host reaches).
        policy: where ``allow`` came from, in words (``task tb/x: any host``, ``task allowlist`` ...).
        intercept: TLS is intercepted (policy per URL, cache, mirrors, record per request); False: its
            client does not trust the proxy's CA (a build from an image we did not make), so its tunnels
            pass through, checked and recorded per ``CONNECT`` host only.
    """

    token: str
    phase: str
    label: str
    allow: tuple[str, ...] = ("*",)
    policy: str = "any host"
    intercept: bool = True

    def allows(self, host: str) -> bool:
        """Whether ``host`` (a name or address, any case) matches one of ``allow``."""
        return host_allowed(host, self.allow)

    def to_json(self) -> dict:
        """As stored for the proxy (``sessions/<token>.json``)."""
        return {"token": self.token, "phase": self.phase, "label": self.label, "allow": list(self.allow),
                "policy": self.policy, "intercept": self.intercept}

    @classmethod
    def from_json(cls, data: dict) -> Session:
        """Parse what :meth:`to_json` wrote."""
        return cls(data["token"], data["phase"], data["label"], tuple(data["allow"]), data.get("policy", ""),
                   data.get("intercept", True))


def host_allowed(host: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether ``host`` matches any of ``patterns`` (fnmatch, case-insensitive; ``*`` matches all)."""
    host = host.lower().rstrip(".")
    return any(fnmatch.fnmatchcase(host, p.lower().rstrip(".")) for p in patterns)


def session_allow(task_hosts: tuple[str, ...] | None, phase: str, run_allow: tuple[str, ...],
                  agent_allow: tuple[str, ...] | None) -> tuple[tuple[str, ...], str]:
    """The hosts a session may reach, and the policy in words.

    Args:
        task_hosts: the task's own setting: None for any host (Terminal-Bench's network, Harbor's
            ``public``), else its allowlist (Harbor's ``network_mode = "allowlist"``, ``allowed_hosts``).
        phase: one of :data:`PHASES`.
        run_allow: ``tasks.egress.allow``, hosts every session may reach besides its task's own.
        agent_allow: ``tasks.egress.agent_allow``: None, or the only hosts (with ``run_allow``) an agent
            whose task allows any host may reach; verification and builds keep the task's access.

    Returns:
        (host patterns, policy in words).
    """
    if task_hosts is None:
        if phase == "agent" and agent_allow is not None:
            return tuple(agent_allow) + tuple(run_allow), "tasks.egress.agent_allow (the task allows any host)"
        return ("*",), "the task allows any host"
    return tuple(task_hosts) + tuple(run_allow), "the task's allowlist and tasks.egress.allow"


def cacheable(method: str, url: str, patterns: tuple[str, ...] | list[str] = DEFAULT_CACHE_PATTERNS) -> bool:
    """Whether a response to ``method url`` is a versioned artifact to cache (a GET matching ``patterns``).

    A URL with a query string is matched without it; one that names ``latest``, a branch or ``ref=`` is not
    versioned and never cached.
    """
    if method.upper() != "GET" or _UNVERSIONED.search(url):
        return False
    bare = url.split("?", 1)[0].split("#", 1)[0]
    return any(fnmatch.fnmatchcase(bare, p) for p in patterns)


@dataclass(frozen=True)
class Mirror:
    """A declared substitute source for some URLs (``tasks.egress.mirrors``).

    Attributes:
        kind: ``uv`` (uv's installer script ``https://astral.sh/uv/<version>/install.sh`` and release
            archives ``https://github.com/astral-sh/uv/releases/download/<version>/uv-<arch>-unknown-linux-<libc>.tar.gz``,
            both made from PyPI's ``uv`` wheel of that version); ``folder`` (URLs under ``prefix``
            answered from the files under ``source``, a local folder); ``url`` (URLs under ``prefix``
            fetched from under ``source``, another base URL); ``exclude-newer`` (a package index's project
            pages, ``<prefix><project>/``, without the files uploaded at or after ``source``, an ISO 8601
            cutoff: uv's ``--exclude-newer`` for every client).
        prefix: the URLs it serves (``https://huggingface.co/``); unused for ``uv``; for ``exclude-newer``
            the index's simple API root (default :data:`PYPI_SIMPLE`).
        source: the folder, base URL or cutoff; unused for ``uv``.
    """

    kind: str
    prefix: str = ""
    source: str = ""

    @property
    def name(self) -> str:
        """How the record and the logs name it (``uv``, ``folder https://huggingface.co/``)."""
        if self.kind == "exclude-newer":
            return f"exclude-newer {self.source}"
        return self.kind if self.kind == "uv" else f"{self.kind} {self.prefix}"


PYPI_SIMPLE = "https://pypi.org/simple/"
UV_INSTALLER = re.compile(r"^https?://astral\.sh/uv/(?:(?P<version>[0-9][A-Za-z0-9.+-]*)/)?install\.sh$")
UV_RELEASE = re.compile(r"^https?://github\.com/astral-sh/uv/releases/download/(?P<version>[0-9][A-Za-z0-9.+-]*)/"
                        r"uv-(?P<arch>x86_64|aarch64)-unknown-linux-(?P<libc>gnu|musl)\.tar\.gz$")


def match_mirror(url: str, mirrors: tuple[Mirror, ...] | list[Mirror]) -> tuple[Mirror, dict[str, str]] | None:
    """The first mirror that serves ``url`` and what it matched (``version``, ``arch``, ``libc``, ``path``)."""
    bare = url.split("?", 1)[0]
    for m in mirrors:
        if m.kind == "uv":
            for pattern, what in ((UV_INSTALLER, "installer"), (UV_RELEASE, "release")):
                if hit := pattern.match(bare):
                    return m, {"what": what, **{k: v for k, v in hit.groupdict().items() if v}}
        elif m.kind == "exclude-newer":
            root = (m.prefix or PYPI_SIMPLE).rstrip("/") + "/"
            if bare.startswith(root) and re.fullmatch(r"[A-Za-z0-9._-]+/?", bare[len(root):]):
                return m, {"what": "project", "project": bare[len(root):].rstrip("/")}
        elif bare.startswith(m.prefix if m.prefix.endswith("/") else f"{m.prefix}/"):
            return m, {"path": bare[len(m.prefix):]}
    return None


@dataclass
class EgressSummary:
    """What one session (one phase of an episode, or a build) sent out, from the proxy's record.

    Attributes:
        requests: requests made (denied ones included).
        bytes: response body bytes received, from whatever source.
        upstream_bytes: of ``bytes``, those fetched from outside (not the cache, not a mirror's local files).
        hosts: hosts asked for, in order of first request.
        denied: ``host`` of each denied request (policy), in order, without repeats.
        failed: ``host status`` of requests the outside refused or could not answer (HTTP >= 400 from
            upstream, a connection or TLS failure as 502), without repeats.
        cached: requests answered from the cache.
        mirrored: ``mirror name: url`` of each request a mirror answered.
    """

    requests: int = 0
    bytes: int = 0
    upstream_bytes: int = 0
    hosts: list[str] = field(default_factory=list)
    denied: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cached: int = 0
    mirrored: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, records: list[dict]) -> EgressSummary:
        """Summarize the proxy's record lines (``infra.egress.addon``: host, url, status, bytes, source)."""
        s = cls()
        for r in records:
            s.requests += 1
            s.bytes += r.get("bytes", 0)
            host = r.get("host", "")
            if host and host not in s.hosts:
                s.hosts.append(host)
            source = r.get("source", "upstream")
            if source == "denied":
                if host not in s.denied:
                    s.denied.append(host)
            elif source == "cache":
                s.cached += 1
            elif source.startswith("mirror"):
                s.mirrored.append(f"{source.removeprefix('mirror ')}: {r.get('url', '')}")
                if source.startswith(("mirror url", "mirror exclude-newer")):  # fetched from outside
                    s.upstream_bytes += r.get("bytes", 0)
            else:
                s.upstream_bytes += r.get("bytes", 0)
                status = int(r.get("status", 0) or 0)
                if status >= 400 or source == "error":
                    what = f"{host} {status or r.get('error', 'error')}"
                    if what not in s.failed:
                        s.failed.append(what)
        return s

    def lines(self) -> list[str]:
        """The summary as log lines (``egress: 3 requests, 1.2 MB ...``, one per denial, failure, mirror)."""
        out = [f"egress: {self.requests} requests to {', '.join(self.hosts) or 'no host'}, "
               f"{self.bytes / 1e6:.2f} MB ({self.upstream_bytes / 1e6:.2f} MB from outside), {self.cached} from cache"]
        out += [f"egress denied by policy: {h}" for h in self.denied]
        out += [f"egress failed upstream: {f}" for f in self.failed]
        out += [f"egress served by mirror {m}" for m in self.mirrored]
        return out


def record_lines(record: dict[str, dict]) -> list[str]:
    """A sandbox's egress record (phase -> :class:`EgressSummary` fields) as log lines; silent phases left out."""
    out: list[str] = []
    for phase, fields_ in record.items():
        summary = EgressSummary(**fields_)
        if summary.requests:
            out += [f"[{phase}] {line}" for line in summary.lines()]
    return out
