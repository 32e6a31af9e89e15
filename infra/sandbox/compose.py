"""Multi-service tasks through Docker Compose itself (Debian's ``docker-compose``), as Terminal-Bench runs them.

Upstream's ``DockerComposeManager`` interpolates the task's compose file with ``T_BENCH_*``
variables and runs ``docker compose -p <session> up``; the agent acts in the ``client`` container.
Here the same file runs with an override file written per sandbox (:func:`override`):

- every service uses the image ``build_envs`` built for it (``DockerBackend.build_services``;
  ``up --no-build``), and carries the backend's labels, so the reaper finds it;
- the agent's service gets the isolation of a single-container sandbox (``init``, ``sleep
  infinity``, only ``AGENT_CAPABILITIES``, no-new-privileges, the pids, memory and CPU limits, the
  command-output tmpfs); the other services keep what their file gives them (a server may need
  its capabilities) and are not the agent's;
- every network of the project is ``internal`` (the services reach each other, not the outside),
  and the host drops new connections from their bridges (``infra.services.HOST_BLOCK_RULE``: dockerd
  runs without iptables, so an internal bridge's host side would answer; no rule, no start); with
  ``network`` the services also join ``agentrl-internet`` (the outside, not the host), as
  upstream's bridge gives them the internet, or, with the egress proxy, ``agentrl-egress`` with the
  agent session's proxy variables and the proxy's CA bundle mounted read-only (``infra.egress``);
- the logs folders upstream binds (``T_BENCH_TASK_LOGS_PATH``...) are fresh per sandbox and
  removed with it.

The sandbox is a :class:`ComposeSandbox`: the agent's container, whose ``close`` takes the whole
project down.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import docker.errors
import requests.exceptions
import yaml

from envs.task import ComposeServices
from infra.sandbox.base import SandboxInfraError
from infra.sandbox.docker_backend import AGENT_CAPABILITIES

log = logging.getLogger(__name__)

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
UP_TIMEOUT_S = 300.0
"""``up`` waits for ``depends_on: condition: service_healthy`` (a server's health check) this long at most."""
TB_CONTAINER_LOGS, TB_CONTAINER_AGENT_LOGS = "/logs", "/agent-logs"
"""Upstream's ``DockerComposeManager.CONTAINER_LOGS_PATH`` / ``CONTAINER_AGENT_LOGS_PATH``."""


def service_names(services: ComposeServices) -> list[str]:
    """The services of the compose file, in file order."""
    return list((yaml.safe_load(services.file.read_text()) or {}).get("services") or {})


def override(services: ComposeServices, tags: dict[str, str], labels: dict[str, str], main: dict,
             network: bool, network_name: str, egress_env: dict[str, str] | None = None) -> dict:
    """The override file's content (see the module docstring).

    Args:
        services: the task's compose project.
        tags: service -> image to run.
        labels: labels every container gets.
        main: extra keys for the agent's service (limits, tmpfs, ...).
        network: the services also join ``network_name``.
        network_name: the bridge to the outside (``agentrl-internet``, or ``agentrl-egress``).
        egress_env: with ``agentrl-egress``: the proxy variables every service gets, and under
            ``agentrl_ca_bundle`` the host path of the CA bundle mounted where they point.
    """
    spec = yaml.safe_load(services.file.read_text()) or {}
    out: dict = {"services": {}, "networks": {}}
    if "version" in spec:
        out["version"] = spec["version"]  # compose refuses files of different versions together
    declared = list((spec.get("networks") or {}).keys())
    for name in declared + ["default"]:
        out["networks"][name] = {"internal": True}
    if network:
        out["networks"][network_name] = {"external": True}
    for name, service in (spec.get("services") or {}).items():
        nets = (service or {}).get("networks") or ["default"]
        nets = list(nets) if isinstance(nets, list) else list(nets.keys())
        entry: dict = {"image": tags[name], "labels": dict(labels),
                       "networks": nets + ([network_name] if network else [])}
        if network and egress_env:
            env = {k: v for k, v in egress_env.items() if k != "agentrl_ca_bundle"}
            siblings = ",".join(spec.get("services") or {})  # the project's services talk directly, not via the proxy
            env.update({k: f"{env[k]},{siblings}" for k in ("NO_PROXY", "no_proxy")})
            entry["environment"] = {**_environment(service), **env}
            entry["volumes"] = [f"{egress_env['agentrl_ca_bundle']}:{env['SSL_CERT_FILE']}:ro"]
        if name == services.main:
            entry.update({"init": True, "command": ["sleep", "infinity"], "cap_drop": ["ALL"],
                          "cap_add": list(AGENT_CAPABILITIES), "security_opt": ["no-new-privileges"], **main})
        out["services"][name] = entry
    return out


def _environment(service: dict | None) -> dict[str, str]:
    """A compose service's own ``environment`` as a mapping (compose accepts a list of ``K=V`` too)."""
    env = (service or {}).get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


@functools.cache  # checked once per process
def host_blocked() -> bool:
    """Whether the host drops new connections from compose bridges (``infra.services.HOST_BLOCK_RULE``)."""
    from infra.services import HOST_BLOCK_RULE

    iptables = shutil.which("iptables") or shutil.which("iptables", path="/usr/sbin:/sbin")
    return iptables is not None and subprocess.run([iptables, "-C", "INPUT", *HOST_BLOCK_RULE],
                                                   capture_output=True).returncode == 0


def service_image(image: str, service: str) -> str:
    """The tag a multi-service task's ``service`` runs by: ``{image's repository}__{service}:{image's tag}``."""
    repository, _, tag = image.rpartition(":")
    return f"{repository}__{service}:{tag}"


def _compose(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        raise SandboxInfraError("sandbox_start_failed", "docker-compose not found: a multi-service task runs "
                                "through Docker Compose (`python -m infra.services up` installs Debian's "
                                "docker-compose)")
    return subprocess.run([binary, *args], env=env, capture_output=True, text=True, timeout=timeout_s)


class ComposeProject:
    """One running compose project: its files, variables and how to take it down."""

    def __init__(self, services: ComposeServices, client: docker.DockerClient, work: Path, env: dict[str, str]):
        self.services, self.client, self.work, self.env = services, client, work, env
        self.name = work.name
        self.files = ["-f", str(services.file), "-f", str(work / "override.yaml")]

    def args(self, *more: str) -> list[str]:
        """``docker-compose`` arguments naming this project and its files, then ``more``."""
        return ["-p", self.name, "--project-directory", str(self.services.file.parent), *self.files, *more]

    def down(self) -> None:
        """Remove the project's containers and networks; never raises (what the CLI left is removed by label)."""
        try:
            _compose(self.args("down", "-v", "--remove-orphans", "-t", "1"), self.env, 120)
        except (subprocess.SubprocessError, OSError, SandboxInfraError) as e:
            log.warning("docker-compose down %s failed: %s", self.name, e)
        try:
            for c in self.client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={self.name}"}):
                c.remove(force=True)
            for n in self.client.networks.list(filters={"label": f"{PROJECT_LABEL}={self.name}"}):
                n.remove()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            log.warning("compose project %s: leftovers not removed: %s", self.name, e)
        shutil.rmtree(self.work, ignore_errors=True)


def start_project(client: docker.DockerClient, services: ComposeServices, tags: dict[str, str],
                  labels: dict[str, str], main: dict, network: bool, network_name: str,
                  state_dir: Path | None, egress_env: dict[str, str] | None = None) -> tuple[ComposeProject, object]:
    """``docker-compose up -d --no-build`` of the task's file and its override.

    Returns:
        (the project, the agent's container as a docker SDK object).

    Raises:
        SandboxInfraError: ``sandbox_start_failed`` with compose's own message (nothing left running).
    """
    if not host_blocked():  # a project's bridge would reach every port of the host (iptables is off in dockerd)
        raise SandboxInfraError("sandbox_start_failed", f"{services.file}: a multi-service sandbox needs the host "
                                "firewall rule `python -m infra.services up` installs (iptables INPUT -i br-+ DROP)")
    root = (state_dir / "compose") if state_dir else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    work = root / f"agentrl-{uuid.uuid4().hex[:12]}"
    (work / "logs").mkdir(parents=True)
    (work / "agent-logs").mkdir()
    env = {**os.environ,
           "T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME": tags[services.main],
           "T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME": f"{work.name}-{services.main}",
           "T_BENCH_TASK_DOCKER_NAME_PREFIX": work.name,
           "T_BENCH_TEST_DIR": "/tests",
           "T_BENCH_TASK_LOGS_PATH": str(work / "logs"), "T_BENCH_CONTAINER_LOGS_PATH": TB_CONTAINER_LOGS,
           "T_BENCH_TASK_AGENT_LOGS_PATH": str(work / "agent-logs"),
           "T_BENCH_CONTAINER_AGENT_LOGS_PATH": TB_CONTAINER_AGENT_LOGS}
    (work / "override.yaml").write_text(yaml.safe_dump(override(services, tags, labels, main, network, network_name,
                                                                egress_env), sort_keys=False))
    project = ComposeProject(services, client, work, env)
    try:
        r = _compose(project.args("up", "-d", "--no-build"), env, UP_TIMEOUT_S)
    except (subprocess.SubprocessError, OSError) as e:
        project.down()
        raise SandboxInfraError("sandbox_start_failed", f"{services.file}: docker-compose up: {e}") from e
    except SandboxInfraError:
        project.down()
        raise
    if r.returncode != 0:
        project.down()
        raise SandboxInfraError("sandbox_start_failed", f"{services.file}: docker-compose up failed "
                                f"(exit {r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")
    found = client.containers.list(filters={"label": [f"{PROJECT_LABEL}={work.name}",
                                                      f"{SERVICE_LABEL}={services.main}"]})
    if not found:
        project.down()
        raise SandboxInfraError("sandbox_start_failed", f"{services.file}: service {services.main!r} is not "
                                "running after docker-compose up")
    return project, found[0]
