"""Docker sandbox backend and task image builds (docker SDK).

Isolation guaranteed here: no network unless the task has it (Terminal-Bench and Harbor tasks do,
as upstream: the ``agentrl-internet`` bridge, which reaches the outside but no port of the host), every
capability dropped but what package installs need (``AGENT_CAPABILITIES``), ``no-new-privileges``,
a pids limit, memory/CPU limits when the task (or the run's ``tasks.default_*``) sets them, a
per-container disk limit on a btrfs engine (``/tmp`` is then the image's own, as under ``docker
run``; without a quota it is a size-limited tmpfs, which the engine's archive API, and so
``put_file``/``get_file``, cannot see), every container labelled ``agentrl=1`` plus the owning
process (``agentrl.owner``) so the leftovers of a crashed run are reaped by label. Not guaranteed:
protection against kernel exploits (containers share the host kernel), or, without a quota
(overlay2 on ext4), a bound on what the agent writes outside ``/tmp``.

Task Dockerfiles name registry images (``FROM ubuntu:24.04``, ``FROM swebench/sweb.eval...``); those
with a local equivalent (``infra.base_images``) get it, built once and tagged with the upstream name;
others are rewritten through ``tasks.base_images`` or pulled (``infra.sandbox.registry``: a mirror
of ``tasks.registry_mirrors``, then the engine's own registry settings). One that none of these
supplies fails the build (``registry image X cannot be pulled (reason)``), unless the run names a
fallback base image explicitly (``tasks.fallback_base_image``). The build log says which.

Per-command deadlines are enforced inside the container with ``timeout -s KILL`` so that a
command hitting its deadline (exit 137) is told apart from a client-side socket timeout.

The agent's own commands run in one persistent tmux shell per sandbox (``run_in_shell``, see
``infra.sandbox.shell``: state persists across commands, as in Terminal-Bench); everything else
(verification, file copies, the runner's checks) runs with ``exec``, each in a fresh ``bash -c``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import logging
import os
import re
import socket
import tarfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import docker
import docker.errors
import requests.exceptions

from infra.egress.proxy import CONTAINER_CA, EGRESS_NETWORK
from infra.sandbox import shell
from infra.sandbox.base import ExecResult, SandboxInfraError
from infra.task_faults import strip_ansi

if TYPE_CHECKING:
    from envs.task import ComposeServices
    from infra.egress.policy import Session
    from infra.egress.proxy import EgressProxy

log = logging.getLogger(__name__)

LABEL = "agentrl"
INTERNET_NETWORK = "agentrl-internet"  # infra.services creates it: NAT to the outside, the host's ports dropped
OUTPUT_LIMIT_BYTES = 16_384
AGENT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "NET_BIND_SERVICE")
"""What root in a sandbox keeps of Docker's default capabilities: what ``apt-get install``/``dpkg``
(chown, setgid maintainer scripts), ``pip`` and a server on port 80 need, as in the upstream
harnesses' containers. Left out of Docker's defaults: NET_RAW (raw sockets: spoofing on the bridge),
MKNOD, AUDIT_WRITE, SETFCAP, SETPCAP, SYS_CHROOT. no-new-privileges stays."""
_CHANGING_FILE_READS = 5  # get_file: reads of a file that changes while the engine archives it
# A process the runtime could not start (exit 126, "OCI runtime exec failed: ... read init-p: connection
# reset by peer"): at the pids limit, runc's init needs a slot that a fork bomb's processes race for, so
# under CPU contention one exec in a few dozen loses. Nothing ran, so it is started again, this many times.
_EXEC_START_ATTEMPTS = 8
# Commands run detached; their output goes to a file on a small tmpfs of its own (so a model that
# fills its disk quota still gets its output back), read back with one more exec once the command
# finished (the archive API cannot read a tmpfs). The wrapper opens the output file before anything
# forks and uses builtins only (dash exits on a failed fork), so a sandbox out of processes (its pids
# limit) still reports what its shell said: earlier outputs are emptied (a process left over from an
# earlier command may still hold one open), and the command replaces the wrapper (exec, no fork).
_EXEC_DIR = "/.agentrl-exec"
_EXEC_WRAPPER = (f'[ -d {_EXEC_DIR} ] || mkdir -p {_EXEC_DIR}; exec > "{_EXEC_DIR}/$2" 2>&1 || exit 126; '
                 f'for f in {_EXEC_DIR}/*.out; do [ "$f" = "{_EXEC_DIR}/$2" ] || [ ! -s "$f" ] || : > "$f"; done; '
                 f'exec timeout -s KILL "$0" bash -c "$1"')
# stop_agent_processes, in sh with builtins only (a fork bomb leaves no process to fork): (1) SIGSTOP
# every process but init, its command and this shell, pass after pass, until a pass finds the same pids
# as the one before (all stopped: none can fork, and a fork racing a pending signal is restarted after
# it); (2) SIGKILL them; (3) until none is left, zombies included (they hold the pids limit's slots
# until init reaps them), kill again and wait, up to 2 s. Prints how many processes were killed.
_STOP_SCRIPT = r"""keep=" KEEP $$ "
signal() {
  n=0
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case "$keep" in *" $p "*) continue;; esac
    kill -$1 "$p" 2>/dev/null && n=$((n+1))
  done
}
i=0; prev=
while [ $i -lt 200 ]; do
  i=$((i+1)); signal STOP; set -- /proc/[0-9]*; now="$*"
  [ "$now" = "$prev" ] && break
  prev=$now
done
signal 9; t=$n; i=0
while [ $i -lt 40 ]; do
  i=$((i+1)); signal 9; [ $n -eq 0 ] && break
  sleep 0.05 2>/dev/null
done
echo $t"""
_NO_TMUX_WARNED: set[str] = set()  # images already logged as having no tmux (run_in_shell falls back to exec)
# Files of a Terminal-Bench task folder that never enter the image build context.
_HIDDEN = ("tests", "solution.sh", "solution.yaml", "task.yaml", "run-tests.sh")


def _tar_file(path: str, data: bytes, mode: int = 0o644) -> bytes:
    """A tar archive holding one file at relative ``path`` (parent folders included), for ``put_archive``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        parts = path.split("/")
        for i in range(1, len(parts)):
            folder = tarfile.TarInfo("/".join(parts[:i]))
            folder.type, folder.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(folder)
        info = tarfile.TarInfo(path)
        info.size, info.mode = len(data), mode
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE | re.MULTILINE)
_COPY_FROM = re.compile(r"^\s*COPY\s+(?:--\S+\s+)*?--from=(\S+)", re.IGNORECASE | re.MULTILINE)


def map_base_images(dockerfile: str, mapping: dict[str, str], local: set[str] | None = None,
                    fallback: str | None = None) -> tuple[str, dict[str, str]]:
    """Rewrite ``FROM`` lines whose image cannot be pulled here.

    Args:
        dockerfile: Dockerfile text.
        mapping: glob pattern (``ubuntu:*``, ``ghcr.io/laude-institute/*``) -> local image, tried in order.
        local: image names present on the engine (left alone); None: check only ``mapping``.
        fallback: image for a ``FROM`` that is neither local nor mapped (None: leave it as written; the
            build then uses it only if it is present by then, e.g. pulled).

    Returns:
        (new Dockerfile, {original image: replacement}). Build-stage names (``FROM x AS y`` then
        ``FROM y``) and ``scratch`` are never rewritten.
    """
    stages = {m.group(4).split()[-1].lower() for m in _FROM.finditer(dockerfile)
              if m.group(4).strip().lower().startswith("as ")}
    replaced: dict[str, str] = {}

    def sub(m: re.Match[str]) -> str:
        image = m.group(3)
        if image.lower() in stages or image == "scratch" or (local is not None and image in local):
            return m.group(0)
        target = next((v for k, v in mapping.items() if fnmatch.fnmatchcase(image, k)), None)
        if target is None and local is not None and image not in local:
            target = fallback
        if target is None or target == image:
            return m.group(0)
        replaced[image] = target
        return f"{m.group(1)}{m.group(2)}{target}{m.group(4)}"

    return _FROM.sub(sub, dockerfile), replaced


def _from_images(dockerfile: str) -> list[str]:
    """The images ``FROM`` lines name, build stages left out."""
    stages = {m.group(4).split()[-1].lower() for m in _FROM.finditer(dockerfile)
              if m.group(4).strip().lower().startswith("as ")}
    return [m.group(3) for m in _FROM.finditer(dockerfile) if m.group(3).lower() not in stages]


_COPY_SOURCES = re.compile(r"^\s*(?:COPY|ADD)\s+(?:--\S+\s+)*(.+)$", re.IGNORECASE | re.MULTILINE)


def copied_hidden(dockerfile: str) -> set[str]:
    """Hidden paths (``_HIDDEN`` or under them) the Dockerfile's own ``COPY``/``ADD`` lines name as sources.

    Upstream builds from the whole folder, so ``COPY tests/create_dataset.py ./`` works there (the
    file is in the image either way); such named paths stay in the context, the rest stays out.
    """
    named: set[str] = set()
    for m in _COPY_SOURCES.finditer(dockerfile):
        line = m.group(1).strip()
        words = [w.strip('",[]') for w in re.split(r"[\s,]+", line) if w.strip('",[]')]
        for src in words[:-1]:  # the last word is the destination
            src = src.removeprefix("./")
            if src.split("/", 1)[0] in _HIDDEN:
                named.add(src.rstrip("/"))
    return named


def _context_tar(folder: Path, dockerfile: str = "Dockerfile",
                 rewrite: dict[str, str] | None = None) -> tuple[bytes, str]:
    """Deterministic tar of a build context (hidden files excluded, unless the Dockerfile copies them) and its sha256.

    ``rewrite`` replaces files' contents by relative path (the Dockerfile after base-image mapping).
    """
    buf = io.BytesIO()
    rewrite = rewrite or {}
    text = rewrite.get(dockerfile) or ((folder / dockerfile).read_text() if (folder / dockerfile).is_file() else "")
    keep = copied_hidden(text)
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            kept = any(str(rel) == k or str(rel).startswith(k + "/") or fnmatch.fnmatch(str(rel), k) for k in keep)
            if (rel.parts[0] in _HIDDEN and not kept) or not path.is_file():
                continue
            info = tarfile.TarInfo(str(rel))
            data = rewrite[str(rel)].encode() if str(rel) in rewrite else path.read_bytes()
            info.size, info.mode, info.mtime = len(data), path.stat().st_mode & 0o777, 0
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return raw, hashlib.sha256(raw).hexdigest()


class DockerBackend:
    """Starts sandboxes on a Docker engine and builds task images."""

    def __init__(self, client: docker.DockerClient | None = None, mem_limit: str | None = None,
                 nano_cpus: int | None = None, pids_limit: int = 1024, tmp_size_mb: int = 256,
                 disk_mb: int = 1024, state_dir: Path | None = None, ca_bundle: Path | None = None,
                 egress: EgressProxy | None = None, agent_mounts: dict[str, str] | None = None,
                 agent_channel: bool = False):
        """Connect to the engine (``DOCKER_HOST`` or the default socket).

        ``agent_mounts`` (host folder -> container path) are mounted read-only into every sandbox (an
        installed agent's CLI, ``envs.harnesses.installed``). ``agent_channel``: every sandbox also joins
        ``agentrl-egress``, whose firewall lets it reach only ports of ``infra.egress.proxy.PORTS`` on the
        bridge (the run's gateway listens there for an agent running inside the sandbox); a task without
        the network still reaches nothing else, and gets no proxy variables.

        ``egress``: the egress proxy (``infra.egress``): sandboxes with the network join the
        ``agentrl-egress`` network and reach the outside only through it, and network builds go
        through it; None: they reach the outside directly (``agentrl-internet``, the host network).

        ``mem_limit`` (``"2g"``) and ``nano_cpus`` are the limits of sandboxes whose task sets none
        (None: no limit, as the Terminal-Bench and Harbor harnesses); ``pids_limit`` always applies.
        ``state_dir`` (default ``infra.services.state_path()``) caches local base images;
        ``ca_bundle`` (default ``$PIP_CERT`` or ``$SSL_CERT_FILE`` when the file exists) is the extra
        CAs they trust (``infra.base_images``).

        Raises:
            SandboxInfraError: reason ``engine_unreachable`` when the engine does not answer.
        """
        try:
            # one connection per concurrent episode: the default pool of 10 drops connections under load
            self.client = client or docker.from_env(timeout=120, max_pool_size=64)
            self.client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise SandboxInfraError("engine_unreachable", f"Docker engine not reachable: {e}") from e
        self.mem_limit, self.nano_cpus, self.pids_limit = mem_limit, nano_cpus, pids_limit
        self.tmp_size_mb, self.disk_mb = tmp_size_mb, disk_mb
        # Per-container disk limits need a driver that enforces --storage-opt size (btrfs with
        # quotas, as `make up` sets up; overlay2 only on XFS with pquota).
        try:
            self.disk_quota = self.client.info().get("Driver") == "btrfs"
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            self.disk_quota = False
        self._leftovers: set[str] = set()  # containers whose removal failed (engine down): swept later
        if state_dir is None:
            from infra.services import state_path

            state_dir = state_path()
        self.state_dir = Path(state_dir)
        if ca_bundle is None:
            from infra.egress.ca import ensure_bundle

            ca_bundle = ensure_bundle()  # the machine's CAs and the egress proxy's
        self.ca_bundle = ca_bundle
        self.egress = egress
        self.agent_mounts, self.agent_channel = dict(agent_mounts or {}), agent_channel

    def build_image(self, name: str, context: Path, dockerfile: str = "Dockerfile",
                    base_images: dict[str, str] | None = None,
                    fallback_base: str | None = None, network: bool = True,
                    registry_mirrors: dict[str, str] | None = None) -> tuple[str, bool, str]:
        """Build ``context``'s Dockerfile, tagged by the hash of its build context.

        ``network``: the build's ``RUN`` steps reach what this machine reaches (as ``docker build``
        does; the engine's host network, since dockerd here has no bridge); False: no network.

        The context excludes the hidden tests and the reference solution. An image whose tag
        already exists is not rebuilt. ``FROM``/``COPY --from=`` images are supplied as
        :meth:`_supply_base_images` says (present, ``base_images``, a local equivalent, pulled through
        ``registry_mirrors`` or the engine's own registry settings, then ``fallback_base`` only when
        given); the ``FROM`` rewrites applied are part of the hashed context, and every image supplied
        is listed at the top of the returned log (``base image ... pulled from ...``).

        Returns:
            (tag, built, log): ``agentrl-task-{name}:{hash[:16]}``, whether a build ran, build log.

        Raises:
            docker.errors.BuildError: the Dockerfile failed to build (its log is in the error), or an
                image it names cannot be supplied (``registry image X cannot be pulled (reason)``).
            FileNotFoundError: ``dockerfile`` is not in ``context``.
        """
        text = (context / dockerfile).read_text()
        local = {t for img in self.client.images.list() for t in img.tags}
        supplied, unpulled = self._supply_base_images(text, base_images or {}, local, fallback_base,
                                                      registry_mirrors or {})
        local |= set(supplied)
        mapped_text, mapped = map_base_images(text, base_images or {}, local, fallback_base)
        raw, digest = _context_tar(context, dockerfile, {dockerfile: mapped_text} if mapped else None)
        # a base image rebuilt under the same name (a local equivalent with other CAs, a new base recipe)
        # rebuilds the task image: the ids of the local images it starts from are part of its tag
        ids = "".join(sorted(self._image_id(image) for image in _from_images(mapped_text) if image in local))
        if ids:
            digest = hashlib.sha256(f"{digest}{ids}".encode()).hexdigest()
        # an exclude-newer mirror changes what the build's package installs resolve to: part of the tag
        dated = "".join(sorted(m.name for m in self.egress.settings.mirrors if m.kind == "exclude-newer")
                        ) if network and self.egress is not None else ""
        if dated:
            digest = hashlib.sha256(f"{digest}{dated}".encode()).hexdigest()
        tag = f"agentrl-task-{name.replace('/', '-').lower()}:{digest[:16]}"
        note = "".join(f"base image {n}\n" for n in supplied.values())
        note += "".join(f"base image {k} -> {v} ("
                        + (f"tasks.fallback_base_image: {unpulled[k]}" if k in unpulled else "tasks.base_images")
                        + ")\n" for k, v in mapped.items())
        try:
            self.client.images.get(tag)
            return tag, False, note
        except docker.errors.ImageNotFound:
            pass
        session = None
        if network and self.egress is not None:
            # TLS is intercepted only where every image the build starts from trusts the proxy's CA (ours)
            ours = all(self._trusts_egress_ca(image) for image in _from_images(mapped_text) if image != "scratch")
            try:
                session = self.egress.session("build", name, None, intercept=ours)
            except RuntimeError as e:
                raise docker.errors.BuildError(f"egress proxy: {e}", []) from e
        # Docker's predefined proxy build arguments: RUN steps see them, the image and its cache key do not
        buildargs = ({k: v for k, v in self.egress.env(session).items()
                      if k.lower() in ("http_proxy", "https_proxy", "no_proxy")} if session else None)
        try:
            _, log = self.client.images.build(fileobj=io.BytesIO(raw), custom_context=True, tag=tag,
                                              dockerfile=dockerfile, network_mode="host" if network else "none",
                                              rm=True, forcerm=True, labels={LABEL: "1"}, buildargs=buildargs)
        except docker.errors.BuildError as e:
            if session is not None:
                e.build_log = [*e.build_log, *({"stream": f"{line}\n"} for line in self._egress_lines(session))]
            raise
        egress = "".join(f"{line}\n" for line in self._egress_lines(session)) if session else ""
        return tag, True, note + strip_ansi("".join(str(chunk.get("stream", "")) for chunk in log)) + egress

    def _egress_sessions(self, image: str, labels: dict[str, str],
                         egress_hosts: tuple[str, ...] | None) -> dict[str, Session]:
        """A new sandbox's proxy sessions, ``agent`` and ``verifier``, named after its task.

        Raises:
            SandboxInfraError: ``sandbox_start_failed`` when the proxy cannot start.
        """
        assert self.egress is not None
        label = labels.get("agentrl.task") or labels.get("agentrl.validate") or image
        try:
            return {p: self.egress.session(p, label, egress_hosts) for p in ("agent", "verifier")}
        except RuntimeError as e:
            raise SandboxInfraError("sandbox_start_failed", f"{image}: egress proxy: {e}") from e

    def _trusts_egress_ca(self, image: str) -> bool:
        """Whether ``image`` is one of the project's base images (they trust the egress proxy's CA)."""
        try:
            labels = self.client.images.get(image).labels or {}
        except docker.errors.DockerException:
            return False
        from infra.services import CA_LABEL

        return bool(labels.get("agentrl.base.ca_sha256") or labels.get(CA_LABEL))

    def _egress_lines(self, session: Session) -> list[str]:
        """The egress record of a build, as log lines (empty when it sent nothing out)."""
        assert self.egress is not None
        summary = self.egress.summary(session)
        return summary.lines() if summary.requests else []

    def _supply_base_images(self, dockerfile: str, mapping: dict[str, str], local: set[str],
                            fallback: str | None, mirrors: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        """Make every registry image the Dockerfile names present on the engine under its own name.

        Each ``FROM`` and ``COPY --from=`` image that is not a build stage, ``scratch`` or matched by
        ``mapping`` (``tasks.base_images``, rewritten by :func:`map_base_images`) is, in order:

        1. present on the engine as a real image (pulled, loaded or built here before): used as it is;
        2. a name with a local equivalent (``infra.base_images``): that is built or loaded once and
           tagged with the upstream name;
        3. pulled (``infra.sandbox.registry.pull``: each of ``mirrors``, then the engine's own
           registry settings), bounded by ``registry.PULL_STALL_S`` without progress;
        4. a ``FROM`` with an explicit ``fallback``: left to :func:`map_base_images`, which rewrites it to
           the fallback (the pull's failure goes into the build log);
        5. otherwise the build fails, naming the image and the three ways to supply it.

        Local equivalents come before any registry for the names they know: they need no registry, so
        the same run config builds the same task image on every machine, connected or not (a task
        image's tag hashes the ids of the images it starts from: a pull that succeeds on one machine
        and fails on another would give one task two images, two validation verdicts and two training
        environments), and no build waits on a registry for them. What they change against upstream is
        in each build log; whoever wants upstream's own image pulls or loads it before the run
        (``docker pull``, ``docker load``), and step 1 then uses it.

        Returns:
            ({image: log note} for the images supplied, {image: why it could not be pulled} for the
            ``FROM`` images left to the fallback).

        Raises:
            docker.errors.BuildError: an image could not be supplied (``registry image X cannot be
                pulled (reason)``: the message names the image and its three remedies), or building its
                local equivalent failed.
        """
        from infra.base_images import ensure_local_base, ensure_uv_image, local_base_for, uv_image_version
        from infra.sandbox.registry import RegistryPullError, pull

        stages = {m.group(4).split()[-1].lower() for m in _FROM.finditer(dockerfile)
                  if m.group(4).strip().lower().startswith("as ")}
        wanted = [(m.group(3), "FROM") for m in _FROM.finditer(dockerfile)]
        wanted += [(m.group(1), "COPY --from") for m in _COPY_FROM.finditer(dockerfile)]
        found: dict[str, str] = {}
        unpulled: dict[str, str] = {}
        for image, where in wanted:
            if (image.lower() in stages or image.isdigit() or image == "scratch" or image in found
                    or image in unpulled or any(fnmatch.fnmatchcase(image, k) for k in mapping)):
                continue
            present = image in local or ("@" in image and self._image_id(image))
            if present and not self._is_local_equivalent(image):
                continue  # a real image of that name (pulled, loaded or built here): used as it is
            if uv_image_version(image):  # uv's distroless image, from uv's PyPI wheel
                try:
                    found[image] = ensure_uv_image(self.client, image, self.state_dir)[1]
                except (RuntimeError, docker.errors.DockerException) as e:
                    raise docker.errors.BuildError(f"local equivalent of {image} failed to build: {e}", []) from e
                continue
            hit = local_base_for(image)
            if hit is None:
                try:
                    found[image] = pull(self.client, image, mirrors)
                except RegistryPullError as e:
                    if where == "FROM" and fallback:
                        unpulled[image] = str(e)
                        continue  # map_base_images falls back
                    raise docker.errors.BuildError(
                        f"{where} {image}: {e}, and it has no local equivalent (infra.base_images); supply it "
                        f"with `docker load -i <file>` (a `docker save` of it), tasks.base_images = "
                        f'{{"{image}" = "<local image>"}}, or a registry that serves it (tasks.registry_mirrors, '
                        "or the engine's own registry-mirrors)", []) from e
                continue
            base, note = hit
            try:
                ensure_local_base(self.client, base, self.state_dir, self.ca_bundle, alias=image)
            except (RuntimeError, ValueError, docker.errors.DockerException) as e:
                raise docker.errors.BuildError(f"local equivalent of {image} ({base.tag}) failed to build: {e}",
                                               []) from e
            found[image] = f"{note} (local equivalent, tagged {image})"
        return found, unpulled

    def build_services(self, image: str, services: ComposeServices, base_images: dict[str, str] | None = None,
                       fallback_base: str | None = None, network: bool = True,
                       registry_mirrors: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
        """Build every service of a multi-service task but the agent's (``image``, built already).

        Each is built as :meth:`build_image` builds (local equivalents, the content-hash tag) and
        tagged ``{image's repository}__{service}:{image's tag}``, the name :meth:`start` runs it by.

        Returns:
            (service -> image, the builds' logs).

        Raises:
            docker.errors.BuildError: a service failed to build (its log is in the error).
        """
        from envs.terminal_bench import compose_build
        from infra.sandbox.compose import service_image, service_names

        spec_tags, logs = {services.main: image}, []
        repository = image.rpartition(":")[0]
        for name in service_names(services):
            if name == services.main:
                continue
            context, dockerfile, _ = compose_build(services.file, main=services.main, service=name)
            built_tag, _, log_text = self.build_image(f"{repository.removeprefix('agentrl-task-')}-{name}", context,
                                                      dockerfile, base_images, fallback_base, network=network,
                                                      registry_mirrors=registry_mirrors)
            alias = service_image(image, name)
            self.client.images.get(built_tag).tag(alias)
            spec_tags[name] = alias
            logs.append(f"service {name}: {built_tag} (as {alias})\n{log_text}")
        return spec_tags, "\n".join(logs)

    def _image_id(self, image: str) -> str:
        try:
            return self.client.images.get(image).id
        except docker.errors.ImageNotFound:
            return ""

    def _is_local_equivalent(self, image: str) -> bool:
        """Whether the local image named ``image`` is one of ours (``infra.base_images`` labels it)."""
        try:
            return any(k.startswith("agentrl.base.") for k in (self.client.images.get(image).labels or {}))
        except docker.errors.ImageNotFound:
            return False

    def snapshot(self, sandbox: DockerSandbox, repository: str, tag: str) -> str:
        """Commit a set-up sandbox as an image (``docker commit``), so attempts start from its state.

        Returns:
            ``repository:tag``.

        Raises:
            SandboxInfraError: the commit failed.
        """
        sandbox._api("commit", sandbox._container.commit, repository=repository, tag=tag,
                     conf={"Labels": {LABEL: "1"}})
        return f"{repository}:{tag}"

    def _start_compose(self, image: str, labels: dict[str, str], cpus: float | None, mem: str | None,
                       network: bool, services: ComposeServices, start_id: str) -> DockerSandbox:
        """A multi-service task's project (``infra.sandbox.compose``).

        With the network and an egress proxy, every service joins ``agentrl-egress`` with the agent session's
        proxy variables and CA bundle (mounted read-only).
        """
        from infra.sandbox import compose

        tags = {name: image if name == services.main else compose.service_image(image, name)
                for name in compose.service_names(services)}
        missing = [t for t in tags.values() if not self._image_id(t)]
        if missing:
            raise SandboxInfraError("sandbox_start_failed", f"{services.file}: service images {missing} are not "
                                    "built (build_envs builds them: DockerBackend.build_services)")
        main = {"pids_limit": self.pids_limit,
                "tmpfs": [f"{path}:{opts}" for path, opts in self._tmpfs().items()]}
        if mem:
            main.update(mem_limit=mem, memswap_limit=mem)
        if cpus or self.nano_cpus:
            main["cpus"] = cpus or self.nano_cpus / 1e9
        all_labels = {LABEL: "1", OWNER_LABEL: owner_id(), START_LABEL: start_id, **labels}
        sessions: dict[str, Session] = {}
        egress_env: dict[str, str] = {}
        if network and self.egress is not None:
            sessions = self._egress_sessions(image, labels, None)
            egress_env = {**self.egress.env(sessions["agent"]), "agentrl_ca_bundle": str(self.egress.ca_bundle())}
        project, container = compose.start_project(self.client, services, tags, all_labels, main, network,
                                                   EGRESS_NETWORK if sessions else INTERNET_NETWORK, self.state_dir,
                                                   egress_env)
        box = ComposeSandbox(container, self._leftovers, project)
        box.workdir = (container.attrs.get("Config") or {}).get("WorkingDir") or "/"
        box.egress, box.egress_sessions = (self.egress, sessions) if sessions else (None, {})
        try:
            box._main_pids()
        except SandboxInfraError:
            box.close()
            raise
        return box

    def _tmpfs(self) -> dict[str, str]:
        """The sandbox's tmpfs mounts: the command-output dir always; ``/tmp`` only without a disk quota.

        With a quota (btrfs) ``/tmp`` is the image's own, as under ``docker run`` (what the image put
        there stays visible; writes count against ``disk_mb``); without one a ``tmp_size_mb`` tmpfs is
        the only bound on what the agent writes there.
        """
        mounts = {_EXEC_DIR: "size=32m,mode=700"}
        if not self.disk_quota:
            mounts["/tmp"] = f"size={self.tmp_size_mb}m,mode=1777"
        return mounts

    def image_digest(self, image: str) -> str:
        """The image's content id (``sha256:...``), recorded so an episode can be replayed."""
        return self.client.images.get(image).id

    def start(self, image: str, labels: dict[str, str], cpus: float | None = None,
              memory_mb: int | None = None, network: bool = False, disk_mb: int | None = None,
              services: ComposeServices | None = None, egress_hosts: tuple[str, ...] | None = None) -> DockerSandbox:
        """Start an isolated container running ``sleep infinity`` (work dir: the image's WORKDIR).

        Args:
            image: image to start.
            labels: extra labels (``agentrl=1`` and ``agentrl.owner`` are always added).
            cpus: CPU limit (None: the backend's default).
            memory_mb: memory limit in MiB, swap included (None: the backend's default).
            network: the task has the network: with an egress proxy, the ``agentrl-egress`` network
                (the proxy only: its proxy variables and CA bundle (:data:`CONTAINER_CA`) are set, its
                agent phase under a session of its own, see ``DockerSandbox.phase``); without one,
                ``agentrl-internet`` (the outside, not the host); else no network.
            disk_mb: limit on what the sandbox writes (None: the backend's default), enforced when
                ``disk_quota`` (a btrfs engine); else only ``/tmp`` is bounded.
            services: a multi-service task's compose project (``infra.sandbox.compose``): ``image``
                runs as its agent's service, the others beside it (built by :meth:`build_services`);
                the sandbox's ``close`` takes the project down. No disk limit then; with the network and
                an egress proxy every service goes out through it under the agent's session (no allowlist).
            egress_hosts: with the network and an egress proxy: the hosts the task allows (None: any).

        Raises:
            SandboxInfraError: reason ``sandbox_start_failed``.
        """
        mem = f"{memory_mb}m" if memory_mb else self.mem_limit
        container = None
        start_id = uuid.uuid4().hex  # finds the container if the engine created it but the reply was lost
        if services is not None:
            if self.agent_channel or self.agent_mounts:
                raise SandboxInfraError("sandbox_start_failed", f"{image}: a multi-service task cannot run an "
                                        "installed agent (its compose project has no channel to the gateway)")
            if network and egress_hosts is not None:
                raise SandboxInfraError("sandbox_start_failed", f"{image}: a multi-service task cannot have an "
                                        "allowlist (compose sandboxes do not go through the egress proxy)")
            return self._start_compose(image, labels, cpus, mem, network, services, start_id)
        sessions: dict[str, Session] = {}
        environment = None
        network_mode = "none"
        if network and self.egress is not None:
            sessions = self._egress_sessions(image, labels, egress_hosts)
            environment, network_mode = self.egress.env(sessions["agent"]), EGRESS_NETWORK
        elif network and egress_hosts is not None:
            raise SandboxInfraError("sandbox_start_failed", f"{image}: the task allows only {', '.join(egress_hosts)}, "
                                    "which needs the egress proxy (tasks.egress.enabled = true)")
        elif network:
            network_mode = INTERNET_NETWORK
        channel = self.agent_channel and network_mode != EGRESS_NETWORK
        if channel and network_mode == "none":  # the channel only: the firewall opens nothing but its ports
            network_mode, channel = EGRESS_NETWORK, False
        volumes = {host: {"bind": path, "mode": "ro"} for host, path in self.agent_mounts.items()} or None
        try:
            # create, then start: a start that fails (engine going down) must not leak the created container
            container = self.client.containers.create(
                image, ["sleep", "infinity"], network_mode=network_mode, init=True, environment=environment,
                mem_limit=mem, memswap_limit=mem,
                nano_cpus=int(cpus * 1e9) if cpus else self.nano_cpus or None,
                pids_limit=self.pids_limit, cap_drop=["ALL"], cap_add=list(AGENT_CAPABILITIES),
                security_opt=["no-new-privileges"],
                tmpfs=self._tmpfs(),
                storage_opt={"size": f"{disk_mb or self.disk_mb}m"} if self.disk_quota else None,
                labels={LABEL: "1", OWNER_LABEL: owner_id(), START_LABEL: start_id, **labels}, volumes=volumes,
            )
            if channel:  # a task with the internet (no egress proxy) joins the channel's network too
                self.client.networks.get(EGRESS_NETWORK).connect(container)
            if sessions:
                container.put_archive("/", _tar_file(CONTAINER_CA.lstrip("/"), self.egress.ca_bundle().read_bytes()))
            container.start()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            if container is not None:
                DockerSandbox(container, self._leftovers).close()  # removed now, or swept once the engine is back
            else:  # the create may have happened with its reply lost (engine going down): sweep by label
                self._leftovers.add(f"{START_LABEL}={start_id}")
                self.sweep_leftovers()
            hint = (f" (the task allows the internet: its sandbox joins the network {INTERNET_NETWORK}, which "
                    "`python -m infra.services up` creates)") if network and INTERNET_NETWORK in str(e) else ""
            raise SandboxInfraError("sandbox_start_failed", f"{image}: {e}{hint}") from e
        box = DockerSandbox(container, self._leftovers)
        box.workdir = (container.attrs.get("Config") or {}).get("WorkingDir") or "/"
        box.egress, box.egress_sessions = self.egress, sessions
        try:
            box._main_pids()  # before any agent command: the processes verification keeps alive
        except SandboxInfraError:
            box.close()
            raise
        return box

    def reap(self, labels: dict[str, str] | None = None) -> int:
        """Remove every container carrying our label (and ``labels``); returns how many."""
        filters = [f"{LABEL}=1"] + [f"{k}={v}" for k, v in (labels or {}).items()]
        containers = self.client.containers.list(all=True, ignore_removed=True, filters={"label": filters})
        for c in containers:
            try:
                c.remove(force=True)
            except docker.errors.NotFound:
                pass
        return len(containers)

    def wait_engine(self, timeout_s: float = 60.0) -> bool:
        """Wait until the engine answers a ping (after a restart); True when it does within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client.ping()
                return True
            except (docker.errors.DockerException, requests.exceptions.RequestException):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.5)

    def sweep_leftovers(self) -> int:
        """Remove containers whose ``close`` failed while the engine was unreachable; returns how many remain.

        Entries are container ids, or ``agentrl.start=<id>`` labels of starts whose create call failed
        (the engine may have created the container and lost the reply): those are looked up by label.
        """
        for cid in list(self._leftovers):
            try:
                if cid.startswith(f"{START_LABEL}="):
                    for c in self.client.containers.list(all=True, ignore_removed=True, filters={"label": cid}):
                        c.remove(force=True)
                else:
                    self.client.api.remove_container(cid, force=True)
                self._leftovers.discard(cid)
            except docker.errors.NotFound:
                self._leftovers.discard(cid)
            except (docker.errors.DockerException, requests.exceptions.RequestException):
                pass
        return len(self._leftovers)

    def reap_orphans(self) -> int:
        """Remove containers left by a crashed run.

        Those labelled ``agentrl=1`` whose owner process (``agentrl.owner``, ``host:pid``) ran on
        this host and no longer runs. Containers of live processes are never touched.

        Returns:
            How many were removed.
        """
        host = socket.gethostname()
        removed = 0
        for c in self.client.containers.list(all=True, ignore_removed=True, filters={"label": f"{LABEL}=1"}):
            owner = c.labels.get(OWNER_LABEL, "")
            owner_host, _, pid = owner.rpartition(":")
            if owner_host != host or not pid.isdigit() or _pid_alive(int(pid)):
                continue
            try:
                c.remove(force=True)
                removed += 1
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:  # e.g. 409: another reaper is removing it
                log.warning("reap_orphans: container %s not removed: %s", c.short_id, e)
        return removed


OWNER_LABEL = "agentrl.owner"
START_LABEL = "agentrl.start"


def owner_id() -> str:
    """The owner label of every container this process starts.

    The run's mark (``infra.reaper``: ``host:pid`` of the run's process, inherited by the processes it
    starts), else ``host:pid`` of this process.
    """
    from infra.reaper import OWNER_ENV

    return os.environ.get(OWNER_ENV) or f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DockerSandbox:
    """One running container; see :class:`infra.sandbox.base.Sandbox`."""

    def __init__(self, container, leftovers: set[str] | None = None):
        self._container = container
        self._leftovers = leftovers if leftovers is not None else set()
        self._started_at = time.time()
        self._execs = 0
        self.sandbox_id = container.short_id
        self._keep_pids: tuple[int, ...] | None = None
        self.workdir = "/"  # the image's WORKDIR, set by ``DockerBackend.start``
        self._shell_started = False  # run_in_shell has had a session (a later new one is reported)
        self._no_tmux = False  # the image has no tmux: run_in_shell is exec
        self.egress: EgressProxy | None = None  # set by ``DockerBackend.start`` for a sandbox behind the proxy
        self.egress_sessions: dict[str, Session] = {}  # phase -> its proxy session
        self.phase = "agent"
        """``agent`` or ``verifier``: whose proxy session ``exec`` uses (the episode runner and validation set
        ``verifier`` before the tests run; the agent's shell and what it left running keep the agent's)."""

    def egress_record(self) -> dict[str, dict]:
        """What each phase sent out through the egress proxy (``EgressSummary`` fields by phase); {} without one."""
        if self.egress is None:
            return {}
        return {p: asdict(self.egress.summary(s)) for p, s in self.egress_sessions.items()}

    def alive(self) -> bool:
        """The container is still running (one inspect).

        Raises:
            SandboxInfraError: the inspect failed (container gone, engine unreachable).
        """
        self._api("inspect", self._container.reload)
        return self._container.status == "running"

    def _main_pids(self) -> tuple[int, ...]:
        """Pids (inside the container) of init and the ``sleep`` it runs, read once, before any agent command."""
        deadline = time.monotonic() + 5.0
        while self._keep_pids is None:
            r = self._exec_run("exec", ["cat", "/proc/1/task/1/children"])
            words = (r.output or b"").split()
            if r.exit_code == 0 and words and all(w.isdigit() for w in words):
                self._keep_pids = (1, *(int(w) for w in words))
            elif time.monotonic() > deadline:  # init has not forked its command yet, or /proc is odd
                raise SandboxInfraError("sandbox_start_failed",
                                        f"{self.sandbox_id}: no main process under init: {r.output[-200:]!r}")
            else:
                time.sleep(0.02)
        return self._keep_pids

    def _api(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except docker.errors.NotFound as e:
            raise SandboxInfraError("container_vanished", f"{self.sandbox_id} during {what}: {e}") from e
        except docker.errors.APIError as e:
            reason = self._stopped_reason() if "is not running" in str(e) else "docker_api_error"
            raise SandboxInfraError(reason, f"{self.sandbox_id} during {what}: {e}") from e
        except (requests.exceptions.RequestException, docker.errors.DockerException) as e:
            raise SandboxInfraError("engine_unreachable", f"{self.sandbox_id} during {what}: {e}") from e

    def _exec_run(self, what: str, argv: list[str]):
        """``exec_run`` of ``argv``, started again while the runtime cannot start its process.

        ``_EXEC_START_ATTEMPTS`` attempts, 0.05-0.5 s apart. Returns the SDK's ``ExecResult`` (exit code,
        output bytes).

        Raises:
            SandboxInfraError: as :meth:`_api`; ``exec_start_failed`` when no attempt started.
        """
        for attempt in range(_EXEC_START_ATTEMPTS):
            if attempt:
                time.sleep(min(0.05 * 2 ** (attempt - 1), 0.5))
            r = self._api(what, self._container.exec_run, argv)
            if not (r.exit_code == 126 and (r.output or b"").startswith(b"OCI runtime exec failed")):
                return r
        raise SandboxInfraError("exec_start_failed", f"{self.sandbox_id} during {what}: {_EXEC_START_ATTEMPTS} "
                                                     f"attempts: {r.output.decode('utf-8', 'replace').strip()}")

    def _stopped_reason(self) -> str:
        """Why a container that should be running is not: ``container_vanished`` or ``environment_broken``.

        The engine's event log tells the two apart: ``docker kill``/``stop``/``rm`` (an operator, a
        reaper, dockerd shutting down) leave ``kill``, ``stop`` or ``destroy`` events — an infra
        failure. A container whose main process died with none of those was stopped from inside, by
        the model's own commands (``kill`` of the main process, memory exhausted by its own
        program): ``environment_broken``, which the harness scores as a
        model failure, so breaking the sandbox is never a way to dodge a penalty. When the events
        cannot be read, the answer is ``container_vanished`` (never blame the model on a guess).
        """
        try:
            now = int(time.time()) + 1
            events = self._container.client.api.events(
                since=int(self._started_at) - 1, until=now, decode=True,
                filters={"container": self._container.id, "type": "container"})
            actions = {str(ev.get("Action", ev.get("status", ""))).split(":")[0] for ev in events}
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            return "container_vanished"
        if actions & {"kill", "stop", "destroy"} or "die" not in actions:
            return "container_vanished"
        return "environment_broken"

    def exec(self, command: str, timeout_s: float, workdir: str | None = None,
             env: dict[str, str] | None = None, output_limit_bytes: int = OUTPUT_LIMIT_BYTES) -> ExecResult:
        """Run ``command`` under ``bash -c`` with ``timeout -s KILL``; output truncated to ``output_limit_bytes``.

        It runs in ``workdir`` (default: the image's ``WORKDIR``, ``/`` when it sets none, as
        ``docker exec`` does), with ``env`` added to the container's environment.

        The exec is started detached and polled, so the client's socket timeout never bounds a
        command; stdout and stderr are merged, as a terminal shows them.

        Raises:
            SandboxInfraError: the container is gone or the engine failed; ``exec_start_failed`` when the
                output could not be read (the runtime could not start a process, ``_EXEC_START_ATTEMPTS`` times).
        """
        start = time.monotonic()
        self._execs += 1
        name = f"{self._execs}.out"
        argv = ["sh", "-c", _EXEC_WRAPPER, f"{timeout_s:g}", command, name]
        if self.phase != "agent" and self.phase in self.egress_sessions and self.egress is not None:
            # the phase's proxy variables win over the caller's (the agent shell's exports carry the agent's)
            env = {**(env or {}), **self.egress.env(self.egress_sessions[self.phase])}
        exit_code = self._run_detached(argv, workdir or self.workdir, env)
        duration_s = time.monotonic() - start
        read = ["head", "-c", str(output_limit_bytes), f"{_EXEC_DIR}/{name}"]
        raw = self._exec_run("read output", read).output or b""
        output = strip_ansi(raw[:output_limit_bytes].decode("utf-8", "replace"))  # as a terminal shows it
        # Exit 137 is a SIGKILL: from `timeout` at the command's deadline, or from the kernel's OOM
        # killer when the command outgrew the sandbox's memory (the model's own doing, reported as
        # a plain exit 137), or from outside (docker kill / rm, dockerd gone): then the container
        # itself is no longer running, which is an infra failure.
        timed_out = exit_code == 137 and duration_s >= timeout_s
        return ExecResult(exit_code, output, timed_out, duration_s)

    def _run_detached(self, argv: list[str], workdir: str, env: dict[str, str] | None = None) -> int:
        """Run ``argv`` detached and poll until it ends; returns its exit code.

        Raises:
            SandboxInfraError: the container is gone (a 137 or missing exit code with the container
                stopped) or the engine failed.
        """
        api = self._container.client.api
        exec_id = self._api("exec", api.exec_create, self._container.id, argv, workdir=workdir,
                            environment=env or None)["Id"]
        self._api("exec", api.exec_start, exec_id, detach=True)
        # Poll with short API calls: the command's deadline is enforced inside the container, so a
        # client whose socket timeout is shorter than the command never turns it into an error.
        poll_s = 0.01
        while (info := self._api("exec", api.exec_inspect, exec_id))["Running"]:
            time.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.1)
        exit_code = int(info["ExitCode"]) if info.get("ExitCode") is not None else -1
        # A SIGKILL (137) or no exit code may mean the container itself is gone: one inspect decides.
        if exit_code in (137, -1) and not self.alive():
            raise SandboxInfraError(self._stopped_reason(), f"{self.sandbox_id} stopped during exec")
        return exit_code

    def run_in_shell(self, command: str, timeout_s: float) -> ExecResult:
        """Run ``command`` in the sandbox's persistent shell (``infra.sandbox.shell``); output truncated to 16 KiB.

        The tmux session is started in the image's WORKDIR on first use; ``cd``, variables, an
        activated venv and background jobs persist to the next call. At the deadline the command gets
        ``C-c`` and is reported timed out (exit 137); a shell that ended gets a new session next time,
        which that command's output says. An image without tmux falls back to :meth:`exec` (logged
        once per image).

        Raises:
            SandboxInfraError: the container is gone or the engine failed; ``shell_failed`` when the
                shell's driver reported nothing (its errors are in the message).
        """
        if self._no_tmux:
            return self.exec(command, timeout_s)
        start = time.monotonic()
        self._execs += 1
        n, folder = self._execs, f"{_EXEC_DIR}/sh"
        exit_code = self._run_detached(shell.driver_argv(n, command, timeout_s, self.workdir, folder), self.workdir)
        duration_s = time.monotonic() - start
        raw = self._exec_run("read output", shell.read_argv(n, folder, OUTPUT_LIMIT_BYTES)).output or b""
        text = strip_ansi(raw.decode("utf-8", "replace"))
        try:
            result = shell.parse_result(text, duration_s, timeout_s, self.workdir, self._shell_started)
        except ValueError as e:
            raise SandboxInfraError("shell_failed", f"{self.sandbox_id}: the shell driver exited {exit_code}: "
                                                    f"{text.strip()[-500:]}") from e
        if result is None:
            self._no_tmux = True
            image = (self._container.attrs.get("Config") or {}).get("Image", "?")
            if image not in _NO_TMUX_WARNED:
                _NO_TMUX_WARNED.add(image)
                log.warning("image %s has no tmux: the agent's commands run with plain exec, each in a fresh "
                            "shell (cd, variables and jobs do not persist)", image)
            return self.exec(command, timeout_s)
        self._shell_started = True
        return result

    def changes(self) -> list[tuple[str, str]]:
        """What the container changed against its image (``docker diff``), tmpfs mounts left out.

        Returns ``[(kind, path)]``, kind ``A`` (added), ``C`` (changed) or ``D`` (deleted).

        Raises:
            SandboxInfraError: the container is gone or the engine failed.
        """
        kinds = {0: "C", 1: "A", 2: "D"}
        return [(kinds.get(c["Kind"], "?"), c["Path"]) for c in self._api("diff", self._container.diff) or []]

    def stop_agent_processes(self) -> int:
        """SIGKILL every process in the container except init and its ``sleep`` (``_STOP_SCRIPT``).

        Called before verification, so nothing the agent left running can touch the tests or the
        reward file. A fork bomb is stopped whole before it is killed, and the call returns once its
        processes are reaped (or after 2 s of waiting), so the next command has the pids limit back.

        Returns:
            How many processes were killed.

        Raises:
            SandboxInfraError: the container is gone or the engine failed; ``exec_start_failed`` when the
                runtime could not start the script (never reported as 0 killed: verification must not run
                beside the agent's processes).
        """
        keep = " ".join(str(p) for p in self._main_pids())
        script = _STOP_SCRIPT.replace("KEEP", keep)
        r = self._exec_run("stop agent processes", ["sh", "-c", script])
        try:
            return int((r.output or b"0").split()[-1])
        except (ValueError, IndexError):
            return 0

    def put_dir(self, local_dir: Path, dest: str) -> None:
        """Replace ``dest`` with the contents of ``local_dir`` (as root, mode kept)."""
        self._api("rm", self._container.exec_run, ["rm", "-rf", dest])
        self._api("mkdir", self._container.exec_run, ["mkdir", "-p", dest])
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path in sorted(local_dir.rglob("*")):
                tar.add(path, arcname=str(path.relative_to(local_dir)), recursive=False)
        self._api("put_archive", self._container.put_archive, dest, buf.getvalue())

    def put_file(self, data: bytes, dest: str) -> None:
        """Write one file (parent folder must exist)."""
        parent, name = dest.rsplit("/", 1)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        self._api("put_archive", self._container.put_archive, parent or "/", buf.getvalue())

    def get_file(self, path: str) -> bytes | None:
        """Read one regular file (through the engine's archive API, no size limit); None if absent.

        A file rewritten while the engine archives it (an agent's process still writing it: the engine
        stats the size, then copies fewer bytes and cuts the stream) is read again, up to
        ``_CHANGING_FILE_READS`` times; one that never holds still reads as the data bytes the engine
        sent in the last read. Callers that must trust a file compare manifests around the read.

        Raises:
            SandboxInfraError: ``docker_api_error``; ``file_unstable`` when no read got even the tar header.
        """
        partial: bytes | None = None
        for attempt in range(_CHANGING_FILE_READS):
            if attempt:
                time.sleep(0.02 * attempt)
            chunks: list[bytes] = []
            try:
                stream, _ = self._container.get_archive(path)
                for chunk in stream:
                    chunks.append(chunk)
            except docker.errors.NotFound:
                return None  # either the file or the container is gone; exec calls tell the two apart
            except requests.exceptions.ChunkedEncodingError:
                pass  # the engine cut the stream mid-file: the file changed under it; what came is parsed
            except (docker.errors.APIError, requests.exceptions.RequestException) as e:
                raise SandboxInfraError("docker_api_error", f"{self.sandbox_id} during get_archive: {e}") from e
            raw, partial = b"".join(chunks), None
            try:
                with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                    member = tar.next()
                    if member is None or not member.isfile():
                        return None
                    partial = raw[member.offset_data:member.offset_data + member.size]
                    return tar.extractfile(member).read()
            except tarfile.TarError:
                continue  # the header promised more bytes than the stream holds: the file shrank while read
        if partial is None:
            raise SandboxInfraError("file_unstable", f"{self.sandbox_id}: {path}: {_CHANGING_FILE_READS} reads "
                                                     "cut before the tar header")
        log.warning("%s: %s kept changing over %d reads; using the last read's %d bytes",
                    self.sandbox_id, path, _CHANGING_FILE_READS, len(partial))
        return partial

    def get_link(self, path: str) -> str | None:
        """A symlink's stored target, read through the engine's archive API (no process in the container)."""
        try:
            stream, _ = self._container.get_archive(path)
        except docker.errors.NotFound:
            return None
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            raise SandboxInfraError("docker_api_error", f"{self.sandbox_id} during get_archive: {e}") from e
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            return member.linkname if member is not None and member.issym() else None

    def close(self) -> None:
        """Force-remove the container; already gone is fine.

        Never raises: when the engine cannot be reached, the container id is kept for the backend's
        ``sweep_leftovers`` (and the label-based reaper), so nothing is left behind for good.
        """
        try:
            self._container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            self._leftovers.add(self._container.id)


class ComposeSandbox(DockerSandbox):
    """The agent's container of a compose project (``infra.sandbox.compose``); ``close`` takes the project down."""

    def __init__(self, container, leftovers: set[str] | None, project):
        super().__init__(container, leftovers)
        self._project = project

    def close(self) -> None:
        """``docker-compose down`` of the whole project (containers, networks, logs folders); never raises."""
        self._project.down()
