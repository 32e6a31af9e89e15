"""Docker sandbox backend and task image builds (docker SDK).

Isolation guaranteed here: no network (``network_mode=none``), all capabilities dropped,
``no-new-privileges``, memory/CPU/pids limits, every container labelled ``agentrl=1`` so a
crashed run's leftovers can be reaped by label. Not guaranteed: protection against kernel
exploits (containers share the host kernel), or limits on disk use beyond the engine's defaults.

Per-command deadlines are enforced inside the container with ``timeout -s KILL`` so that a
command hitting its deadline (exit 137) is told apart from a client-side socket timeout.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
from pathlib import Path

import docker
import docker.errors
import requests.exceptions

from infra.sandbox.base import ExecResult, SandboxInfraError

LABEL = "agentrl"
OUTPUT_LIMIT_BYTES = 16_384
# Files of a Terminal-Bench task folder that never enter the image build context.
_HIDDEN = ("tests", "solution.sh", "task.yaml", "run-tests.sh")


def _context_tar(folder: Path) -> tuple[bytes, str]:
    """Deterministic tar of a build context (hidden files excluded) and its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if rel.parts[0] in _HIDDEN or not path.is_file():
                continue
            info = tarfile.TarInfo(str(rel))
            data = path.read_bytes()
            info.size, info.mode, info.mtime = len(data), path.stat().st_mode & 0o777, 0
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return raw, hashlib.sha256(raw).hexdigest()


class DockerBackend:
    """Starts sandboxes on a Docker engine and builds task images."""

    def __init__(self, client: docker.DockerClient | None = None, mem_limit: str = "512m",
                 nano_cpus: int = 1_000_000_000, pids_limit: int = 256):
        """Connect to the engine (``DOCKER_HOST`` or the default socket).

        Raises:
            SandboxInfraError: reason ``engine_unreachable`` when the engine does not answer.
        """
        try:
            self.client = client or docker.from_env(timeout=120)
            self.client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise SandboxInfraError("engine_unreachable", f"Docker engine not reachable: {e}") from e
        self.mem_limit, self.nano_cpus, self.pids_limit = mem_limit, nano_cpus, pids_limit

    def build_image(self, name: str, context: Path) -> tuple[str, bool, str]:
        """Build ``context``'s Dockerfile, tagged by the hash of its build context.

        The context excludes the hidden tests and the reference solution. An image whose tag
        already exists is not rebuilt.

        Returns:
            (tag, built, log): ``agentrl-task-{name}:{hash[:16]}``, whether a build ran, build log.

        Raises:
            docker.errors.BuildError: the Dockerfile failed to build (its log is in the error).
        """
        raw, digest = _context_tar(context)
        tag = f"agentrl-task-{name}:{digest[:16]}"
        try:
            self.client.images.get(tag)
            return tag, False, ""
        except docker.errors.ImageNotFound:
            pass
        _, log = self.client.images.build(fileobj=io.BytesIO(raw), custom_context=True, tag=tag,
                                          network_mode="none", rm=True, forcerm=True,
                                          labels={LABEL: "1"})
        return tag, True, "".join(str(chunk.get("stream", "")) for chunk in log)

    def image_digest(self, image: str) -> str:
        """The image's content id (``sha256:...``), recorded so an episode can be replayed."""
        return self.client.images.get(image).id

    def start(self, image: str, labels: dict[str, str]) -> DockerSandbox:
        """Start an isolated container running ``sleep infinity`` with a tmpfs-free /app work dir.

        Raises:
            SandboxInfraError: reason ``sandbox_start_failed``.
        """
        try:
            container = self.client.containers.run(
                image, ["sleep", "infinity"], detach=True, network_mode="none", init=True,
                mem_limit=self.mem_limit, memswap_limit=self.mem_limit, nano_cpus=self.nano_cpus,
                pids_limit=self.pids_limit, cap_drop=["ALL"], security_opt=["no-new-privileges"],
                labels={LABEL: "1", **labels}, working_dir="/app",
            )
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise SandboxInfraError("sandbox_start_failed", f"{image}: {e}") from e
        return DockerSandbox(container)

    def reap(self, labels: dict[str, str] | None = None) -> int:
        """Remove every container carrying our label (and ``labels``); returns how many."""
        filters = [f"{LABEL}=1"] + [f"{k}={v}" for k, v in (labels or {}).items()]
        containers = self.client.containers.list(all=True, filters={"label": filters})
        for c in containers:
            c.remove(force=True)
        return len(containers)


class DockerSandbox:
    """One running container; see :class:`infra.sandbox.base.Sandbox`."""

    def __init__(self, container):
        self._container = container
        self.sandbox_id = container.short_id

    def _api(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except docker.errors.NotFound as e:
            raise SandboxInfraError("container_vanished", f"{self.sandbox_id} during {what}: {e}") from e
        except docker.errors.APIError as e:
            reason = "container_vanished" if "is not running" in str(e) else "docker_api_error"
            raise SandboxInfraError(reason, f"{self.sandbox_id} during {what}: {e}") from e
        except (requests.exceptions.RequestException, docker.errors.DockerException) as e:
            raise SandboxInfraError("engine_unreachable", f"{self.sandbox_id} during {what}: {e}") from e

    def exec(self, command: str, timeout_s: float, workdir: str = "/app") -> ExecResult:
        """Run ``command`` under ``bash -c`` with ``timeout -s KILL``; output truncated to 16 KiB.

        Raises:
            SandboxInfraError: the container is gone or the engine failed.
        """
        start = time.monotonic()
        argv = ["timeout", "-s", "KILL", f"{timeout_s:g}", "bash", "-c", command]
        result = self._api("exec", self._container.exec_run, argv, workdir=workdir, demux=False)
        output = (result.output or b"")[:OUTPUT_LIMIT_BYTES].decode("utf-8", "replace")
        exit_code = int(result.exit_code if result.exit_code is not None else -1)
        # Exit 137 from `timeout -s KILL` is the command's own deadline; confirm the container
        # itself is still alive, else the kill came from outside (OOM of the sandbox, docker kill).
        if exit_code == 137:
            self._api("inspect", self._container.reload)
            if self._container.status != "running":
                raise SandboxInfraError("container_vanished", f"{self.sandbox_id} stopped during exec")
        return ExecResult(exit_code, output, exit_code == 137, time.monotonic() - start)

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
        """Read one regular file (through the engine's archive API, no size limit); None if absent."""
        try:
            stream, _ = self._container.get_archive(path)
        except docker.errors.NotFound:
            return None  # either the file or the container is gone; exec calls tell the two apart
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            raise SandboxInfraError("docker_api_error", f"{self.sandbox_id} during get_archive: {e}") from e
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                return None
            return tar.extractfile(member).read()

    def close(self) -> None:
        """Force-remove the container; already gone is fine."""
        try:
            self._container.remove(force=True)
        except docker.errors.NotFound:
            pass
