"""Pulling a task Dockerfile's registry base image: image references, mirrors, a bounded pull.

A ``FROM``/``COPY --from=`` image that is not on the engine and has no local equivalent
(``infra.base_images``) is pulled (``DockerBackend.build_image`` decides the order). :func:`pull`
asks the engine to pull it, first from each configured mirror (``tasks.registry_mirrors``), then by
its own name, which goes through the engine's own configuration (``registry-mirrors``,
``insecure-registries``, proxies in ``daemon.json``; loopback registries are insecure-allowed by
default). A mirror's copy is tagged with the image's own name, so the Dockerfile builds unchanged
and the next build finds it present.

The pull is bounded by progress, not by size: the engine streams a status line at least every
second or so while it resolves, downloads and extracts; a pull that says nothing for ``stall_s``
seconds is abandoned (the connection closed, which cancels it in the engine). A registry that
refuses the connection or whose name does not resolve fails at once (tens of milliseconds).

Limits: a digest reference (``image@sha256:...``) is pulled by its own name only (a mirror's copy
cannot be tagged with a digest); credentials are the engine client's (``~/.docker/config.json``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import docker.auth
import requests.exceptions

if TYPE_CHECKING:
    import docker

DOCKER_HUB = "docker.io"
PULL_STALL_S = 30.0
"""Seconds a pull may go without a status line from the engine before it is abandoned."""
_HOST = re.compile(r"^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:]+\])(?::\d+)?$")
_PATH = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")


class RegistryPullError(Exception):
    """A registry image could not be pulled; ``str()`` reads ``registry image X cannot be pulled (reason)``."""

    def __init__(self, image: str, reason: str):
        """Record the image as named in the Dockerfile and why every attempt failed."""
        super().__init__(f"registry image {image} cannot be pulled ({reason})")
        self.image, self.reason = image, reason


@dataclass(frozen=True)
class Reference:
    """An image reference split as the engine reads it.

    ``registry``: ``docker.io`` for Docker Hub names; ``path``: the repository path on that registry
    (``library/python`` for Hub's official images); ``tag`` (default ``latest``) or ``digest``.
    """

    registry: str
    path: str
    tag: str
    digest: str = ""

    def on(self, registry: str) -> str:
        """The same repository and tag (or digest) on ``registry`` (``host[:port][/prefix]``)."""
        return f"{registry.rstrip('/')}/{self.path}" + (f"@{self.digest}" if self.digest else f":{self.tag}")


def parse_reference(image: str) -> Reference:
    """Split an image reference (``python:3.12``, ``swebench/x:latest``, ``127.0.0.1:5000/a/b:1``, ``x@sha256:..``).

    The first component is a registry when it has a ``.`` or ``:`` or is ``localhost`` (the engine's
    rule); otherwise the image is on Docker Hub, under ``library/`` when it has a single component.

    Raises:
        ValueError: not a valid reference (empty, a build argument like ``${BASE}``, upper case in the
            repository path); the message names the image and the expected form.
    """
    rest, _, digest = image.strip().partition("@")
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, name = first, remainder
    else:
        registry, name = DOCKER_HUB, rest
    last = name.rsplit("/", 1)[-1]
    path, tag = (name.rsplit(":", 1) if ":" in last else (name, "latest"))
    if registry in (DOCKER_HUB, "index.docker.io"):
        registry = DOCKER_HUB
        path = path if "/" in path else f"library/{path}"
    if not _PATH.match(path) or not _HOST.match(registry) or not tag or (digest and ":" not in digest):
        raise ValueError(f"{image!r} is not an image reference (expected [registry[:port]/]repository[:tag]"
                         "[@sha256:digest], lower-case repository, no build arguments)")
    return Reference(registry, path, tag, digest)


def mirror_references(image: str, mirrors: dict[str, str]) -> list[str]:
    """Where ``image`` may be pulled from besides its own registry: ``mirrors[its registry]``, then ``mirrors["*"]``.

    ``mirrors`` maps a registry as images name it (``docker.io`` for Docker Hub names, ``ghcr.io``,
    ``127.0.0.1:5000``) or ``*`` to a mirror ``host[:port][/prefix]``; the image's repository path is
    appended (``{"docker.io": "localhost:5000"}``: ``python:3.12`` -> ``localhost:5000/library/python:3.12``,
    as a pull-through cache of Docker Hub names it). Digest references and a mirror equal to the
    image's own registry give none.

    Raises:
        ValueError: ``image`` is not a reference (see :func:`parse_reference`).
    """
    ref = parse_reference(image)
    if ref.digest:
        return []
    found = []
    for key in (ref.registry, "*"):
        mirror = mirrors.get(key, "").rstrip("/")
        if mirror and mirror != ref.registry and ref.on(mirror) not in found:
            found.append(ref.on(mirror))
    return found


def _split_tag(reference: str) -> tuple[str, str]:
    """``(repository as written, tag or digest)`` of a reference; the tag defaults to ``latest``."""
    if "@" in reference:
        repository, digest = reference.split("@", 1)
        return repository, digest
    if ":" in reference.rsplit("/", 1)[-1]:
        repository, tag = reference.rsplit(":", 1)
        return repository, tag
    return reference, "latest"


def _pull_one(client: docker.DockerClient, reference: str, stall_s: float) -> list[str]:
    """Ask the engine to pull ``reference``; returns its status lines.

    Raises:
        RuntimeError: the engine refused (its message), reported an error in the stream, or said
            nothing for ``stall_s`` seconds.
    """
    api = client.api
    repository, tag = _split_tag(reference)
    params = {"fromImage": repository, "tag": tag}
    headers = {}
    header = docker.auth.get_config_header(api, docker.auth.resolve_repository_name(repository)[0])
    if header:
        headers["X-Registry-Auth"] = header
    url = f"{api.base_url}/v{api.api_version}/images/create"
    lines: list[str] = []
    try:
        # docker-py's own pull sets no timeout at all; the read timeout here is the stall bound
        with api.post(url, params=params, headers=headers, stream=True, timeout=(10, stall_s)) as response:
            if response.status_code >= 400:
                try:
                    message = response.json().get("message", "")
                except ValueError:
                    message = response.text
                raise RuntimeError(message.strip() or f"engine answered HTTP {response.status_code}")
            for raw in response.iter_lines():
                if not raw.strip():
                    continue
                try:
                    event = json.loads(raw)
                except ValueError as e:
                    raise RuntimeError(f"unreadable engine reply {raw[:200]!r}") from e
                if event.get("error"):
                    raise RuntimeError(str(event["error"]).strip())
                status = str(event.get("status", ""))
                if status and "progress" not in event and not status.startswith(("Waiting", "Downloading",
                                                                                 "Extracting", "Verifying")):
                    lines.append(f"{event['id']}: {status}" if event.get("id") else status)
    except requests.exceptions.Timeout as e:
        raise RuntimeError(f"no progress for {stall_s:g} s") from e
    except requests.exceptions.ConnectionError as e:  # a read timeout mid-stream arrives as a ConnectionError
        if "timed out" in str(e):
            raise RuntimeError(f"no progress for {stall_s:g} s") from e
        raise RuntimeError(f"engine connection failed: {e}") from e
    return lines


def pull(client: docker.DockerClient, image: str, mirrors: dict[str, str] | None = None,
         stall_s: float = PULL_STALL_S) -> str:
    """Pull ``image`` onto the engine: from each mirror (:func:`mirror_references`), then by its own name.

    A copy pulled from a mirror is tagged ``image``. Each attempt is bounded by ``stall_s`` seconds
    without progress (see the module docstring).

    Returns:
        The build-log note: ``"<image> pulled from <reference>"`` and the engine's last status line.

    Raises:
        RegistryPullError: every attempt failed; the reason lists each reference and its error.
    """
    try:
        candidates = [*mirror_references(image, mirrors or {}), image]
    except ValueError as e:
        raise RegistryPullError(image, str(e)) from e
    errors = []
    for reference in candidates:
        try:
            lines = _pull_one(client, reference, stall_s)
        except RuntimeError as e:
            errors.append(f"{reference}: {e}")
            continue
        if reference != image:
            client.images.get(reference).tag(*_split_tag(image))
        status = lines[-1] if lines else "pulled"
        return f"{image} pulled from {reference} ({status})"
    raise RegistryPullError(image, "; ".join(errors) if len(errors) > 1 else errors[0].split(": ", 1)[1])
