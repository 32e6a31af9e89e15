"""The egress proxy process (mitmdump with ``infra.egress.addon``) and its sessions.

``EgressProxy.start`` installs mitmproxy in its own venv once (``envs.harnesses.venv``: pinned,
outside the checkout), makes the CA once (``infra.egress.ca``) and starts ``mitmdump`` bound to
``listen_host`` (the ``agentrl-egress`` bridge's address: the only address a sandbox on that network
reaches; builds use it over the host network) on the first free port of ``PORTS`` (the range the
network's firewall opens). It is started lazily, on the first session, and stopped by ``close``.

A session is a token (the proxy user name), its phase and allowed hosts, written to
``sessions/<token>.json`` before the client gets it; the proxy appends one JSON line per request to
``records/<token>.jsonl``, read back by :meth:`EgressProxy.summary`.
"""

from __future__ import annotations

import errno
import json
import logging
import secrets
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.egress.ca import egress_home, ensure_bundle, ensure_ca, host_bundle
from infra.egress.policy import DEFAULT_CACHE_PATTERNS, EgressSummary, Mirror, Session, session_allow
from infra.reaper import owner_mark

log = logging.getLogger(__name__)

MITMPROXY = "mitmproxy==11.0.2"
"""The newest mitmproxy that runs on Python 3.11 (12.x needs 3.12)."""
EGRESS_NETWORK = "agentrl-egress"
"""The Docker network of sandboxes behind the proxy (``infra.services`` creates it: internal, no route out)."""
EGRESS_SUBNET = "172.31.251.0/24"
EGRESS_GATEWAY = "172.31.251.1"
"""The network's bridge address on the host: where the proxy listens."""
EGRESS_BRIDGE = "agentrl-egr0"
PORTS = range(39000, 39100)
"""Ports the proxy may listen on: the egress network's firewall lets sandboxes reach these on its bridge."""
CONTAINER_CA = "/etc/agentrl/egress-ca-bundle.pem"
"""Where a sandbox behind the proxy finds the CA bundle it trusts (the machine's plus the proxy's)."""
_START_TIMEOUT_S = 180.0  # mitmproxy's imports take 2 s on an idle machine, over a minute on 2 busy cores


@dataclass(frozen=True)
class EgressSettings:
    """The run's egress settings (``tasks.egress``, ``infra.config.EgressConfig``), as the proxy uses them.

    Attributes:
        allow: host patterns every session may reach besides its task's own.
        agent_allow: None, or the only hosts (with ``allow``) an agent whose task allows any host reaches.
        cache: cache versioned artifacts across episodes and runs (in ``egress_home()/cache``).
        cache_patterns: URLs that are versioned artifacts (``infra.egress.policy.cacheable``).
        mirrors: declared substitute sources.
        cache_dir: where the cache lives; empty: ``egress_home()/cache``, shared by the machine's runs.
    """

    allow: tuple[str, ...] = ()
    agent_allow: tuple[str, ...] | None = None
    cache: bool = True
    cache_patterns: tuple[str, ...] = DEFAULT_CACHE_PATTERNS
    mirrors: tuple[Mirror, ...] = field(default_factory=tuple)
    cache_dir: str = ""


class EgressProxy:
    """One mitmdump process and the sessions it serves (thread-safe; see the module docstring).

    Raises (``start``, and the first ``session``):
        RuntimeError: mitmproxy could not be installed, or the proxy did not start listening.
    """

    def __init__(self, listen_host: str, settings: EgressSettings | None = None, home: Path | None = None) -> None:
        self.listen_host = listen_host
        self.settings = settings or EgressSettings()
        self.home = home or egress_home()
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def running(self) -> bool:
        """Whether the proxy process is up."""
        return self._proc is not None and self._proc.poll() is None

    def ca_bundle(self) -> Path:
        """The bundle a client of this proxy trusts (the machine's CAs plus the proxy's)."""
        return ensure_bundle(self.home)

    def start(self) -> None:
        """Start the proxy unless it runs (see the module docstring)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        """:meth:`start` under the lock its caller holds."""
        if self._closed:
            raise RuntimeError("egress proxy: closed (its run ended)")
        if self.running:
            return
        from envs.harnesses.venv import harness_python

        python = harness_python("mitmproxy-11.0.2", [MITMPROXY])
        confdir = ensure_ca(self.home).parent
        if self._dir is not None:  # it died: its sessions and records stay, sandboxes keep their port
            log.warning("egress proxy on %s:%d exited (%s); starting it again: %s", self.listen_host, self.port,
                        self._proc.returncode if self._proc else "?", self.log_tail()[-500:])
        else:
            self._dir = tempfile.TemporaryDirectory(prefix="agentrl-egress-")
            for sub in ("sessions", "records"):
                (Path(self._dir.name) / sub).mkdir()
        state = Path(self._dir.name)
        upstream_ca = host_bundle()
        s = self.settings
        config = {"sessions_dir": str(state / "sessions"), "records_dir": str(state / "records"),
                  "cache_dir": (s.cache_dir or str(self.home / "cache")) if s.cache else "",
                  "cache_patterns": list(s.cache_patterns), "upstream_ca": str(upstream_ca or ""),
                  "mirrors": [m.__dict__ for m in s.mirrors]}
        (state / "config.json").write_text(json.dumps(config))
        repo = Path(__file__).resolve().parents[2]
        self.port = self.port or _free_port(self.listen_host)
        # rawtcp off: a tunnel that does not speak HTTP (ssh to port 443) is an error, never passed through
        argv = [str(python.parent / "mitmdump"), "-q", "--listen-host", self.listen_host, "-p", str(self.port),
                "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy", "--set", "rawtcp=false",
                "--set", f"agentrl_config={state / 'config.json'}",
                "-s", str(Path(__file__).with_name("addon.py"))]
        if upstream_ca:
            argv += ["--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}"]
        log_file = open(state / "mitmdump.log", "w")  # noqa: SIM115 - the process writes it until close
        self._proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                      env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo),
                                           "HOME": str(self.home), **owner_mark()}, start_new_session=True)
        log_file.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                text = (state / "mitmdump.log").read_text()[-1500:]
                code = self._proc.returncode
                self._stop()
                raise RuntimeError(f"egress proxy exited at start ({code}): {text}")
            try:
                socket.create_connection((self.listen_host, self.port), timeout=1).close()
                log.info("egress proxy on %s:%d (mitmproxy, state %s)", self.listen_host, self.port, state)
                return
            except OSError:
                time.sleep(0.2)
        self._stop()
        raise RuntimeError(f"egress proxy did not listen on {self.listen_host}:{self.port} within "
                           f"{_START_TIMEOUT_S:.0f} s")

    def session(self, phase: str, label: str, task_hosts: tuple[str, ...] | None, intercept: bool = True) -> Session:
        """A new session for one sandbox phase or build (the proxy is started if it is not running).

        Args:
            phase: ``agent``, ``verifier`` or ``build``.
            label: the task id (named in denials).
            task_hosts: None for a task that allows any host, else its allowlist.
            intercept: the client trusts the proxy's CA (see ``Session.intercept``).

        Raises:
            RuntimeError: the proxy is closed, or could not start.
        """
        allow, policy = session_allow(task_hosts, phase, self.settings.allow, self.settings.agent_allow)
        s = Session(secrets.token_hex(16), phase, label, allow, policy, intercept)
        with self._lock:
            self._start()
            assert self._dir is not None
            path = Path(self._dir.name) / "sessions" / f"{s.token}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(s.to_json()))
            tmp.replace(path)
        return s

    def proxy_url(self, session: Session, host: str | None = None) -> str:
        """``http://<token>:x@host:port`` for the client's ``HTTP(S)_PROXY`` (host: ``listen_host``)."""
        return f"http://{session.token}:x@{host or self.listen_host}:{self.port}"

    def env(self, session: Session, ca_path: str = CONTAINER_CA) -> dict[str, str]:
        """The environment a client behind the proxy needs: the proxy variables and the CA bundle's path."""
        url = self.proxy_url(session)
        env = {k: url for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")}
        env.update(NO_PROXY="localhost,127.0.0.1,::1", no_proxy="localhost,127.0.0.1,::1")
        env.update({k: ca_path for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE",
                                         "GIT_SSL_CAINFO", "NODE_EXTRA_CA_CERTS", "UV_NATIVE_TLS_CA_FILE")})
        return env

    def records(self, session: Session) -> list[dict]:
        """The proxy's record of ``session``'s requests so far (one dict per request)."""
        if self._dir is None:
            return []
        path = Path(self._dir.name) / "records" / f"{session.token}.jsonl"
        try:
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def summary(self, session: Session) -> EgressSummary:
        """What ``session`` sent out (:class:`infra.egress.policy.EgressSummary`)."""
        return EgressSummary.of(self.records(session))

    def log_tail(self) -> str:
        """The last lines mitmdump wrote (for errors)."""
        if self._dir is None:
            return ""
        try:
            return (Path(self._dir.name) / "mitmdump.log").read_text()[-2000:]
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the proxy and remove its sessions and records; idempotent."""
        with self._lock:
            self._closed = True
            self._stop()

    def _stop(self) -> None:
        """:meth:`close` under the lock its caller holds."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def _free_port(host: str) -> int:
    """The first port of :data:`PORTS` free on ``host`` (mitmdump binds it itself).

    Raises:
        RuntimeError: see :func:`bind_in_range`.
    """
    with bind_in_range(host, "egress proxy") as s:
        return s.getsockname()[1]


def bind_in_range(host: str, what: str) -> socket.socket:
    """A TCP socket bound to ``host`` on the first free port of :data:`PORTS`.

    These are the ports sandboxes on ``agentrl-egress`` reach: the egress proxy's, and the gateway's
    channel for installed agents.

    Raises:
        RuntimeError: ``host`` is no address of this machine (the bridge is missing), or every port is taken.
    """
    for port in PORTS:
        s = socket.socket()
        try:
            s.bind((host, port))
            return s
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRNOTAVAIL:
                raise RuntimeError(f"{what}: {host} is no address of this machine: the agentrl-egress "
                                   "network's bridge is missing (run `python -m infra.services up`)") from e
    raise RuntimeError(f"{what}: no free port in {PORTS.start}-{PORTS.stop - 1} on {host}")
