"""Local equivalents of the published base images task Dockerfiles start ``FROM``, built without a registry.

Terminal-Bench / Harbor tasks say ``FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620``,
``FROM python:3.13-slim-bookworm``, ``FROM ubuntu:24.04``...  No registry is reachable here, but the
Debian and Ubuntu archives are, so each base is rebuilt from its distribution: ``debootstrap
--variant=minbase`` (no recommends) into a rootfs, configured in place and upgraded from ``-updates``
and ``-security`` (debootstrap installs release versions only), then ``docker import`` as a single
layer (no second layer duplicating upgraded files).  ``local_base_for`` maps an upstream name to a
``LocalBase`` (``MAPPING``, one table); ``ensure_local_base`` makes it present (engine, else
``<state>/bases/<tag>.tar.gz``, else build) and tags it with the upstream name, so the legacy builder
(no BuildKit here) uses it and never pulls.

Every local base has:

* apt sources for its suite, ``-updates`` and ``-security`` on the public archives
  (``PUBLIC_ARCHIVES``); debootstrap may fetch from the host's Debian mirror, which is never
  written into the image (``infra.services._debian_mirror``);
* the Docker images' apt config (``docker-clean``: no ``.deb`` or ``*.bin`` caches in layers; no
  translations; gzipped indexes; suggests are not important), ``policy-rc.d`` (no services start
  on install), the slim images' dpkg path excludes (no docs but copyright, man pages, locales);
* debconf's frontend ``Noninteractive`` and ``DEBIAN_FRONTEND=noninteractive``;
* ca-certificates plus the extra CAs from ``ca_bundle`` (those the image does not already trust)
  as ``/usr/local/share/ca-certificates/agentrl-extra-N.crt`` run through ``update-ca-certificates``,
  and ``SSL_CERT_FILE``/``REQUESTS_CA_BUNDLE``/``PIP_CERT``/``CURL_CA_BUNDLE`` naming the system
  bundle (a public CA certificate is not a secret);
* tmux, asciinema, curl, procps, the distro's python3; ``LANG=C.UTF-8``, ``WORKDIR /app``,
  ``CMD ["/bin/bash"]``.

A *python image* (``LocalBase.python_image``) behaves like Docker Hub's ``python:3.x`` for what
tasks use: ``python``/``pip``/``pip3.X`` commands, ``pip install`` as root works system-wide
(``EXTERNALLY-MANAGED`` removed; Debian's pip installs into ``/usr/local/lib/python3.X/dist-packages``),
python3-venv.

What differs from upstream (also in each mapping note):

* Python is the distribution's package (``/usr/bin/python3.13``, Debian's patches and pip), not
  python.org's build in ``/usr/local``; no headers (python3-dev) and no ``PYTHON_VERSION``/
  ``GPG_KEY`` variables; pip, setuptools and wheel are Debian's versions.
* t-bench ``python-3-13`` is ``python:3.13-slim-bookworm`` + ``apt-get install tmux curl asciinema``
  + debconf noninteractive + ``WORKDIR /app``; here it is Debian **trixie** (3.13 is in no
  bookworm package), so apt installs trixie package versions (tasks pinning bookworm versions,
  e.g. ``jq=1.6-2.1``, fail).
* Python versions no distribution here packages map to the nearest one that does (3.12 and 3.10
  from Ubuntu noble/jammy, older to jammy's 3.10, newer to trixie's 3.13), noted in the log.
* ``ubuntu:*``/``debian:*`` get python3, curl, tmux, asciinema and ca-certificates, which the
  upstream images lack (a superset: tasks that install them still work).

Limits: building needs root (debootstrap, chroot), the network (host mirror or public archives)
and ~1 min per base; a base's recipe is fixed by its tag (bump the tag's last part when the
recipe changes).  An image or cache built with other extra CAs is rebuilt (label
``agentrl.base.ca_sha256``).
"""

from __future__ import annotations

import fcntl
import fnmatch
import gzip
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infra.services import _debian_mirror, _log_tail, _scrub_apt, _which

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalBase:
    """A local equivalent of a published base image."""

    tag: str
    """Our image tag, e.g. ``agentrl-python:3.13-trixie-2`` (the last part is the recipe version)."""
    distro: str
    """``debian`` or ``ubuntu``."""
    suite: str
    """``bookworm``, ``trixie``, ``noble`` or ``jammy``."""
    python_version: str
    """The Python a python image provides, e.g. ``3.13``; ``""`` when none beyond the distro's python3."""
    python_image: bool
    """Behaves like Docker Hub's ``python:3.x``: ``python``/``pip`` commands, system-wide pip, venv."""


TRIXIE_PY = LocalBase("agentrl-python:3.13-trixie-2", "debian", "trixie", "3.13", True)
BOOKWORM_PY = LocalBase("agentrl-python:3.11-bookworm-2", "debian", "bookworm", "3.11", True)
NOBLE_PY = LocalBase("agentrl-python:3.12-noble-3", "ubuntu", "noble", "3.12", True)
JAMMY_PY = LocalBase("agentrl-python:3.10-jammy-3", "ubuntu", "jammy", "3.10", True)
TRIXIE = LocalBase("agentrl-debian:13-trixie-1", "debian", "trixie", "", False)
BOOKWORM = LocalBase("agentrl-debian:12-bookworm-1", "debian", "bookworm", "", False)
NOBLE = LocalBase("agentrl-ubuntu:24.04-noble-2", "ubuntu", "noble", "", False)
JAMMY = LocalBase("agentrl-ubuntu:22.04-jammy-2", "ubuntu", "jammy", "", False)

_DISTRO_PY = "distro python3.{} instead of python.org's build"
MAPPING: tuple[tuple[str, LocalBase, str], ...] = (
    # (glob on the normalised name "repo:tag", local base, difference), first match wins.
    ("ghcr.io/laude-institute/t-bench/python-3-13:*", TRIXIE_PY,
     "upstream is python:3.13-slim-bookworm + tmux curl asciinema; Debian trixie's python3.13 here"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:*", NOBLE, "ubuntu:24.04 + tmux asciinema; python3 added here"),
    ("python:3.13*", TRIXIE_PY, _DISTRO_PY.format(13)),
    ("python:3.12*", NOBLE_PY, "Python 3.12 is in no Debian release; Ubuntu noble's python3.12 used"),
    ("python:3.11*", BOOKWORM_PY, _DISTRO_PY.format(11)),
    ("python:3.10*", JAMMY_PY, "Python 3.10 is in no current Debian release; Ubuntu jammy's python3.10 used"),
    ("python:3.1[4-9]*", TRIXIE_PY, "not packaged here; nearest available is Debian trixie's python3.13"),
    ("python:3.[0-9]", JAMMY_PY, "not packaged here; nearest available is Ubuntu jammy's python3.10"),
    ("python:3.[0-9][-.]*", JAMMY_PY, "not packaged here; nearest available is Ubuntu jammy's python3.10"),
    ("python:3", TRIXIE_PY, "newest packaged here is Debian trixie's python3.13"),
    ("python:3-*", TRIXIE_PY, "newest packaged here is Debian trixie's python3.13"),
    ("python:latest", TRIXIE_PY, "newest packaged here is Debian trixie's python3.13"),
    ("python:slim*", TRIXIE_PY, "newest packaged here is Debian trixie's python3.13"),
    ("ubuntu:24.04*", NOBLE, ""),
    ("ubuntu:noble*", NOBLE, ""),
    ("ubuntu:latest", NOBLE, ""),
    ("ubuntu:22.04*", JAMMY, ""),
    ("ubuntu:jammy*", JAMMY, ""),
    ("debian:bookworm*", BOOKWORM, ""),
    ("debian:12*", BOOKWORM, ""),
    ("debian:trixie*", TRIXIE, ""),
    ("debian:13*", TRIXIE, ""),
    ("debian:stable*", TRIXIE, ""),
    ("debian:latest", TRIXIE, ""),
)
"""Upstream names (``docker.io/library/`` and digests stripped, tag default ``latest``) to local bases."""

_SUITES = ("bullseye", "bookworm", "trixie", "focal", "jammy", "noble", "alpine")
"""Distribution words in upstream tags; one naming another suite than the base's goes into the note."""

PUBLIC_ARCHIVES = {
    "debian": ("http://deb.debian.org/debian", "http://deb.debian.org/debian-security"),
    "ubuntu": ("http://archive.ubuntu.com/ubuntu", "http://security.ubuntu.com/ubuntu"),
}
"""(main, security) archive URLs written into images."""
COMPONENTS = {"debian": ("main",), "ubuntu": ("main", "restricted", "universe", "multiverse")}
PACKAGES = ("ca-certificates", "curl", "tmux", "asciinema", "procps", "python3")
PYTHON_PACKAGES = ("python3-pip", "python3-venv", "python-is-python3")
UBUNTU_KEYRING_DEB = (
    "http://archive.ubuntu.com/ubuntu/pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb",
    "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8",
)
"""Ubuntu's archive keyring (2018 key F6EC B376 2474 EDA9 D21B 7022 8719 20D1 991B C93C) for debootstrap:
Debian 12 does not package it; fetched once and checked against this pinned sha256."""
CA_FILE = "/etc/ssl/certs/ca-certificates.crt"
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "SSL_CERT_FILE": CA_FILE,
    "REQUESTS_CA_BUNDLE": CA_FILE,
    "PIP_CERT": CA_FILE,
    "CURL_CA_BUNDLE": CA_FILE,
}
_APT_CONF = {
    # As in Docker's official debian/ubuntu images (debuerreotype).
    "docker-clean": (
        'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb '
        '/var/cache/apt/*.bin || true"; };\n'
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb '
        '/var/cache/apt/*.bin || true"; };\n'
        'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n'
    ),
    "docker-no-languages": 'Acquire::Languages "none";\n',
    "docker-gzip-indexes": 'Acquire::GzipIndexes "true";\n',
    "docker-autoremove-suggests": 'Apt::AutoRemove::SuggestsImportant "false";\n',
}
_DPKG_EXCLUDES = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/groff",
                  "usr/share/lintian", "usr/share/linda")
"""Trees the slim images do not install (``/usr/share/doc/*/copyright`` kept)."""
STEP_TIMEOUT_S = 900


# ---------------------------------------------------------------- mapping


def _normalise(image: str) -> tuple[str, list[str]]:
    """Return ``repo:tag`` with Docker Hub prefixes and a digest dropped, and notes on what was dropped."""
    name, notes = image.strip().lower(), []
    if "@" in name:
        name = name.split("@", 1)[0]
        notes.append("digest ignored")
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "index.docker.io/", "library/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name, notes


def local_base_for(image: str) -> tuple[LocalBase, str] | None:
    """The local equivalent of an upstream ``FROM`` image and a one-line note for the build log.

    Args:
        image: The name after ``FROM`` (``python:3.13-slim-bookworm``,
            ``ghcr.io/laude-institute/t-bench/python-3-13:20250620``; Docker Hub prefixes and
            ``@sha256:`` digests allowed).

    Returns:
        ``(base, note)``; the note reads ``"<image> -> <tag> (<differences>)"``, e.g.
        ``"python:3.10-slim-bookworm -> agentrl-python:3.10-jammy-3 (Python 3.10 is in no current Debian
        release; Ubuntu jammy's python3.10 used; jammy instead of bookworm)"``.  None when ``MAPPING``
        has no equivalent (the caller falls back or fails).
    """
    name, notes = _normalise(image)
    for pattern, base, difference in MAPPING:
        if fnmatch.fnmatchcase(name, pattern):
            words = set(re.split(r"[-.:/_]", name.rsplit(":", 1)[1]))
            named = [s for s in _SUITES if s in words and s != base.suite]
            diffs = [d for d in (difference, *(f"{base.suite} instead of {s}" for s in named), *notes) if d]
            return base, f"{image} -> {base.tag}" + (f" ({'; '.join(diffs)})" if diffs else "")
    return None


# ---------------------------------------------------------------- certificates


_PEM = re.compile(r"-----BEGIN CERTIFICATE-----\s*(.*?)\s*-----END CERTIFICATE-----", re.S)


def pem_certificates(text: str) -> list[str]:
    """Split PEM text into certificates, each as its base64 body without whitespace."""
    return ["".join(body.split()) for body in _PEM.findall(text)]


def extra_certificates(bundle: str, trusted: str) -> list[str]:
    """Certificates of ``bundle`` not in ``trusted`` (both PEM text), as PEM blocks, first occurrence order."""
    known, extra = set(pem_certificates(trusted)), []
    for body in pem_certificates(bundle):
        if body not in known:
            known.add(body)
            lines = [body[i:i + 64] for i in range(0, len(body), 64)]
            extra.append("-----BEGIN CERTIFICATE-----\n" + "\n".join(lines) + "\n-----END CERTIFICATE-----\n")
    return extra


def _ca_digest(ca_bundle: Path | None) -> str:
    """sha256 of the extra CA bundle's certificates (``none`` without one): a label on the image."""
    if ca_bundle is None:
        return "none"
    return hashlib.sha256("\n".join(pem_certificates(ca_bundle.read_text())).encode()).hexdigest()


# ---------------------------------------------------------------- rootfs


def apt_sources(base: LocalBase, keyring: str) -> str:
    """The deb822 ``sources.list.d`` file for ``base`` on the public archives (``keyring``: Signed-By path)."""
    main, security = PUBLIC_ARCHIVES[base.distro]
    suites = [base.suite, f"{base.suite}-updates"] + ([f"{base.suite}-backports"] if base.distro == "ubuntu" else [])
    components = " ".join(COMPONENTS[base.distro])
    stanza = "Types: deb\nURIs: {}\nSuites: {}\nComponents: {}\nSigned-By: {}\n"
    return (stanza.format(main, " ".join(suites), components, keyring) + "\n"
            + stanza.format(security, f"{base.suite}-security", components, keyring))


def _run_step(step: str, argv: list[str], log_file: Path) -> None:
    """Run one build step, output appended to ``log_file``.

    Raises:
        RuntimeError: The step exited non-zero or timed out; names the step and has the log tail.
    """
    with open(log_file, "ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        try:
            res = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=STEP_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as err:
            tail = _log_tail(log_file)
            raise RuntimeError(f"{step} timed out after {STEP_TIMEOUT_S} s; {log_file}:\n{tail}") from err
    if res.returncode != 0:
        raise RuntimeError(f"{step} failed (exit {res.returncode}); {log_file}:\n{_log_tail(log_file)}")


def _ubuntu_keyring(bases_dir: Path) -> Path:
    """Return Ubuntu's archive keyring, fetched once from ``UBUNTU_KEYRING_DEB`` and checked.

    Raises:
        RuntimeError: The download failed or its sha256 is not the pinned one.
    """
    url, sha256 = UBUNTU_KEYRING_DEB
    keyring = bases_dir / "ubuntu-keyring" / "usr/share/keyrings/ubuntu-archive-keyring.gpg"
    with open(bases_dir / "ubuntu-keyring.lock", "w") as lock:  # noble and jammy may build side by side
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not keyring.exists():
            _fetch_ubuntu_keyring(bases_dir, url, sha256)
    return keyring


def _fetch_ubuntu_keyring(bases_dir: Path, url: str, sha256: str) -> None:
    """Download the keyring .deb, check its sha256 and unpack it to ``<bases_dir>/ubuntu-keyring``."""
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            data = resp.read()
    except OSError as err:
        raise RuntimeError(f"ubuntu keyring: cannot fetch {url}: {err}") from err
    if hashlib.sha256(data).hexdigest() != sha256:
        raise RuntimeError(f"ubuntu keyring: {url} has sha256 {hashlib.sha256(data).hexdigest()}, expected {sha256}")
    with tempfile.TemporaryDirectory(dir=bases_dir) as tmp:
        deb = Path(tmp) / "ubuntu-keyring.deb"
        deb.write_bytes(data)
        _run_step("ubuntu keyring: dpkg-deb -x", ["dpkg-deb", "-x", str(deb), str(Path(tmp) / "x")],
                  bases_dir / "ubuntu-keyring.log")
        shutil.rmtree(bases_dir / "ubuntu-keyring", ignore_errors=True)
        os.replace(Path(tmp) / "x", bases_dir / "ubuntu-keyring")


def _debootstrap(base: LocalBase, rootfs: Path, bases_dir: Path, log_file: Path) -> None:
    """Bootstrap ``base``'s suite with ``PACKAGES`` (+ ``PYTHON_PACKAGES``) into ``rootfs``."""
    packages = PACKAGES + (PYTHON_PACKAGES if base.python_image else ())
    argv = [str(_which("debootstrap")), "--variant=minbase", f"--components={','.join(COMPONENTS[base.distro])}",
            f"--include={','.join(packages)}"]
    if base.distro == "ubuntu":
        # Debian 12's debootstrap has no script for noble; every Ubuntu suite uses gutsy's.
        argv += [f"--keyring={_ubuntu_keyring(bases_dir)}", base.suite, str(rootfs), PUBLIC_ARCHIVES["ubuntu"][0],
                 "/usr/share/debootstrap/scripts/gutsy"]
    else:
        argv += [base.suite, str(rootfs), _debian_mirror()]
    _run_step(f"debootstrap {base.suite}", argv, log_file)


def _slim(rootfs: Path, man_sections: bool) -> None:
    """Drop what the slim images exclude and make dpkg exclude it from later installs too.

    ``man_sections`` keeps ``/usr/share/man/man1``..``man8`` as empty folders, as Ubuntu's images
    have them: update-alternatives links man pages there and fails when they are missing (openjdk's
    post-install, in Terminal-Bench's predicate-pushdown-bench on ``t-bench/ubuntu-24-04``). Debian's
    slim images lack them (debuerreotype/docker-debian-artifacts#24), so Debian bases stay without.
    """
    for tree in _DPKG_EXCLUDES:
        top = rootfs / tree
        if not top.is_dir():
            continue
        for path in top.iterdir():
            if tree == "usr/share/doc" and path.is_dir():
                for sub in path.iterdir():
                    if sub.name != "copyright":
                        shutil.rmtree(sub) if sub.is_dir() and not sub.is_symlink() else sub.unlink()
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    rules = []
    for tree in _DPKG_EXCLUDES:
        rules.append(f"path-exclude /{tree}/*")
        if tree == "usr/share/doc":
            rules.append("path-include /usr/share/doc/*/copyright")
    (rootfs / "etc/dpkg/dpkg.cfg.d/docker-slim").write_text("\n".join(rules) + "\n")
    if man_sections:
        for n in range(1, 9):
            (rootfs / f"usr/share/man/man{n}").mkdir(parents=True, exist_ok=True)


def _upgrade(rootfs: Path, log_file: Path) -> None:
    """Apply ``-updates`` and ``-security`` (debootstrap installs release versions only), then drop the lists.

    Runs apt in the chroot on the public sources with the host's network and resolv.conf (debootstrap
    copied it; it is blanked afterwards) and ``/proc`` mounted for maintainer scripts.
    """
    proc = rootfs / "proc"
    _run_step("mount /proc in the rootfs", ["mount", "-t", "proc", "proc", str(proc)], log_file)
    try:
        _run_step("upgrade (chroot: apt-get update && apt-get upgrade)",
                  ["chroot", str(rootfs), "/usr/bin/env", "DEBIAN_FRONTEND=noninteractive", "/bin/sh", "-ec",
                   "apt-get update -qq && apt-get -y -qq -o Dpkg::Options::=--force-confold upgrade"], log_file)
    finally:
        subprocess.run(["umount", "-l", str(proc)], check=False)
    for path in (rootfs / "var/lib/apt/lists").glob("*"):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _configure(base: LocalBase, rootfs: Path, ca_bundle: Path | None, log_file: Path) -> int:
    """Configure a bootstrapped rootfs (apt, dpkg, debconf, CAs, python); returns the number of extra CAs.

    Raises:
        RuntimeError: A chroot step failed.
    """
    _scrub_apt(rootfs)  # the host mirror and package lists debootstrap left
    apt = rootfs / "etc/apt"
    keyrings = ([rootfs / "usr/share/keyrings/debian-archive-keyring.pgp",
                 rootfs / "usr/share/keyrings/debian-archive-keyring.gpg"] if base.distro == "debian"
                else [rootfs / "usr/share/keyrings/ubuntu-archive-keyring.gpg"])
    keyring = next((k for k in keyrings if k.exists()), None)
    if keyring is None:
        raise RuntimeError(f"configure: no archive keyring in the {base.suite} rootfs ({[str(k) for k in keyrings]})")
    (apt / "sources.list").unlink(missing_ok=True)
    signed_by = "/" + str(keyring.relative_to(rootfs))
    (apt / "sources.list.d" / f"{base.distro}.sources").write_text(apt_sources(base, signed_by))
    for name, text in _APT_CONF.items():
        (apt / "apt.conf.d" / name).write_text(text)
    policy = rootfs / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    _slim(rootfs, man_sections=base.distro == "ubuntu")
    _upgrade(rootfs, log_file)
    for name, text in (("etc/hostname", ""), ("etc/resolv.conf", ""),
                       ("etc/hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")):
        (rootfs / name).unlink(missing_ok=True)  # debootstrap copied the host's
        (rootfs / name).write_text(text)
    for pattern in ("var/log/*.log", "var/log/apt/*", "var/cache/debconf/*-old", "var/lib/dpkg/*-old", "tmp/*"):
        for path in rootfs.glob(pattern):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    extras = []
    if ca_bundle is not None:
        extras = extra_certificates(ca_bundle.read_text(), (rootfs / CA_FILE.lstrip("/")).read_text())
        for i, pem in enumerate(extras):
            (rootfs / f"usr/local/share/ca-certificates/agentrl-extra-{i}.crt").write_text(pem)
    script = ["echo 'debconf debconf/frontend select Noninteractive' | debconf-set-selections",
              "update-ca-certificates"]
    if base.python_image:
        # As python:3.x images: the interpreter's own prefix in /usr/local (here a venv over the distro's
        # python3, with pip from ensurepip), whose site-packages holds what `pip install` adds and nothing
        # of Debian's (asciinema's python3-* packages stay with /usr/bin/python3, as upstream, where
        # apt's python3 is a second interpreter): pip can upgrade any package, none lacks a RECORD.
        script += [
            "rm -f /usr/lib/python3*/EXTERNALLY-MANAGED",
            f"python{base.python_version} -m venv /usr/local",
            "rm -f /usr/local/bin/activate* /usr/local/bin/Activate.ps1",
            f"/usr/local/bin/python{base.python_version} -m pip --version",
            f"[ -e /usr/local/bin/pip{base.python_version} ] || "
            f"ln -s pip3 /usr/local/bin/pip{base.python_version}",
        ]
    _run_step("configure (chroot: debconf, update-ca-certificates, pip)",
              ["chroot", str(rootfs), "/bin/sh", "-ec", " && ".join(script)], log_file)
    (rootfs / "app").mkdir(exist_ok=True)
    return len(extras)


# ---------------------------------------------------------------- images


def _file_name(tag: str) -> str:
    """A file name for ``tag`` (``/`` and ``:`` replaced)."""
    return tag.replace("/", "_").replace(":", "_")


def _current(client: docker.DockerClient, tag: str, ca_digest: str) -> bool:
    """Whether ``tag`` is on the engine and was built with the same extra CAs."""
    import docker

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return (image.labels or {}).get("agentrl.base.ca_sha256") == ca_digest


def _build(client: docker.DockerClient, base: LocalBase, bases_dir: Path, ca_bundle: Path | None) -> None:
    """Debootstrap, configure and ``docker import`` ``base`` (root only, ~1 min)."""
    import docker

    if os.geteuid() != 0:
        raise RuntimeError(f"image {base.tag} is missing and building it (debootstrap, chroot) needs root")
    if _which("debootstrap") is None:
        raise RuntimeError(f"building {base.tag} needs debootstrap: apt-get install debootstrap")
    rootfs, log_file = bases_dir / f"rootfs-{_file_name(base.tag)}", bases_dir / f"{_file_name(base.tag)}.log"
    shutil.rmtree(rootfs, ignore_errors=True)
    log_file.write_text(f"building {base}\n")
    log.info("building %s: debootstrap %s (~1 min, log %s)", base.tag, base.suite, log_file)
    try:
        _debootstrap(base, rootfs, bases_dir, log_file)
        n_extra = _configure(base, rootfs, ca_bundle, log_file)
        labels = {"agentrl.base.suite": base.suite, "agentrl.base.ca_sha256": _ca_digest(ca_bundle),
                  "agentrl.base.extra_cas": str(n_extra)}
        changes = [f"ENV {k}={v}" for k, v in ENV.items()]
        changes += [f'LABEL {k}="{v}"' for k, v in labels.items()] + ["WORKDIR /app", 'CMD ["/bin/bash"]']
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        repo, _, version = base.tag.rpartition(":")
        try:
            result = client.api.import_image_from_stream(iter(lambda: tar.stdout.read(1 << 20), b""),
                                                         repository=repo, tag=version, changes=changes)
        except docker.errors.APIError as err:
            tar.kill()
            raise RuntimeError(f"docker import of {rootfs} as {base.tag} failed: {err}") from err
        finally:
            tar.wait()
        if tar.returncode != 0:
            raise RuntimeError(f"tar of {rootfs} failed (exit {tar.returncode})")
    finally:
        if os.path.ismount(rootfs / "proc"):
            raise RuntimeError(f"{rootfs}/proc is still mounted; unmount it, then delete {rootfs}")
        shutil.rmtree(rootfs, ignore_errors=True)
    if not client.images.list(name=base.tag):
        raise RuntimeError(f"docker import did not produce {base.tag}: {str(result)[-1000:]}")


def _tag_alias(client: docker.DockerClient, tag: str, alias: str) -> None:
    """Tag image ``tag`` as ``alias`` (``repo[:tag]``, no digest).

    Raises:
        ValueError: ``alias`` holds a digest (a digest reference cannot be satisfied by a tag).
    """
    if "@" in alias:
        raise ValueError(f"alias {alias!r}: a digest reference cannot be tagged; rewrite the FROM line to a tag")
    last = alias.rsplit("/", 1)[-1]
    repo, version = (alias.rsplit(":", 1) if ":" in last else (alias, "latest"))
    client.images.get(tag).tag(repo, version)


def ensure_local_base(client: docker.DockerClient, base: LocalBase, state_dir: Path, ca_bundle: Path | None,
                      alias: str | None = None) -> str:
    """Make sure ``base.tag`` exists on the engine, built with ``ca_bundle``'s extra CAs.

    In order: present (with the same CAs); else ``docker load`` of ``<state_dir>/bases/<tag>.tar.gz``;
    else built (debootstrap + configure + ``docker import``, ~1 min) and saved there
    (``docker save | gzip``).  Then tagged ``alias`` when given (the upstream name) so the legacy
    builder finds it and never pulls.  A lock file per tag (``flock``) makes parallel callers,
    threads or processes, build a base once; later callers find it present.

    Args:
        client: Docker client of the engine to build on.
        base: The base, from ``local_base_for``.
        state_dir: State directory; caches and build logs go to ``<state_dir>/bases/``.
        ca_bundle: PEM file of CAs to trust besides the distro's (a proxy's CA; the host's whole
            bundle also works: certificates the image already trusts are skipped); None for none.
        alias: Upstream image name to tag the result as (e.g.
            ``ghcr.io/laude-institute/t-bench/python-3-13:20250620``).

    Returns:
        ``base.tag``.

    Raises:
        RuntimeError: A step failed (keyring download, debootstrap, configure, import, save, load);
            the message names it and has the log tail.
        ValueError: ``alias`` is a digest reference.
    """
    import docker

    bases_dir = Path(state_dir) / "bases"
    bases_dir.mkdir(parents=True, exist_ok=True)
    cache = bases_dir / f"{_file_name(base.tag)}.tar.gz"
    digest = _ca_digest(ca_bundle)
    with open(bases_dir / f"{_file_name(base.tag)}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _current(client, base.tag, digest) and cache.exists():
            log.info("loading %s from %s", base.tag, cache)
            try:
                with open(cache, "rb") as f:
                    client.images.load(f)
            except (docker.errors.APIError, OSError) as err:
                raise RuntimeError(f"docker load of {cache} failed: {err}; delete it to rebuild") from err
            if not client.images.list(name=base.tag):
                raise RuntimeError(f"{cache} loaded but holds no {base.tag}; delete it to rebuild")
        if not _current(client, base.tag, digest):
            _build(client, base, bases_dir, ca_bundle)
            log.info("saving %s to %s", base.tag, cache)
            tmp = cache.with_name(cache.name + ".tmp")
            try:
                with gzip.open(tmp, "wb", compresslevel=6) as out:
                    for chunk in client.images.get(base.tag).save(named=base.tag):
                        out.write(chunk)
            except (docker.errors.APIError, OSError) as err:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"docker save of {base.tag} to {cache} failed: {err}") from err
            os.replace(tmp, cache)
        if alias:
            _tag_alias(client, base.tag, alias)
    return base.tag


# ---------------------------------------------------------------- uv's distroless image

_UV_IMAGE = re.compile(r"^ghcr\.io/astral-sh/uv:(\d+\.\d+\.\d+)$")


def uv_image_version(image: str) -> str | None:
    """The uv version of ``ghcr.io/astral-sh/uv:X.Y.Z`` (the distroless image: ``/uv`` and ``/uvx`` only); else None.

    Tags with a distribution (``0.8.14-bookworm``) or ``latest`` are not covered.
    """
    m = _UV_IMAGE.match(_normalise(image)[0])
    return m.group(1) if m else None


def ensure_uv_image(client: docker.DockerClient, image: str, state_dir: Path) -> tuple[str, str]:
    """Build the local equivalent of uv's distroless image ``ghcr.io/astral-sh/uv:X.Y.Z`` and tag it so.

    Upstream's image is ``FROM scratch`` with the ``uv`` and ``uvx`` binaries at ``/`` (what
    ``COPY --from=ghcr.io/astral-sh/uv:X.Y.Z /uv /uvx /bin/`` takes); the same binaries ship in uv's
    PyPI wheel (``uv-X.Y.Z.data/scripts/``), downloaded here with pip (PyPI is reachable).

    Returns:
        (``image``, log note).

    Raises:
        ValueError: ``image`` is not a plain-version uv image.
        RuntimeError: the wheel could not be downloaded or the image not built (the message says which).
    """
    import io
    import tarfile
    import zipfile

    import docker.errors

    version = uv_image_version(image)
    if version is None:
        raise ValueError(f"{image}: not ghcr.io/astral-sh/uv:X.Y.Z")
    note = f"{image} -> built FROM scratch with /uv and /uvx from PyPI's uv=={version} wheel"
    try:
        if (client.images.get(image).labels or {}).get("agentrl.base.uv") == version:
            return image, note
    except docker.errors.ImageNotFound:
        pass
    wheels = Path(state_dir) / "bases" / "uv-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with open(wheels / f"uv-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(wheels.glob(f"uv-{version}-*manylinux*x86_64*.whl"))
        if not found:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                "--platform", "manylinux_2_17_x86_64", "-d", str(wheels), f"uv=={version}"],
                               capture_output=True, text=True)
            found = sorted(wheels.glob(f"uv-{version}-*manylinux*x86_64*.whl"))
            if r.returncode != 0 or not found:
                raise RuntimeError(f"pip download uv=={version} failed (exit {r.returncode}): {r.stderr[-800:]}")
        buf = io.BytesIO()
        with zipfile.ZipFile(found[0]) as whl, tarfile.open(fileobj=buf, mode="w") as tar:
            dockerfile = b'FROM scratch\nCOPY uv uvx /\nENTRYPOINT ["/uv"]\n'
            files = {"Dockerfile": (dockerfile, 0o644)}
            for name in ("uv", "uvx"):
                files[name] = (whl.read(f"uv-{version}.data/scripts/{name}"), 0o755)
            for name, (data, mode) in files.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
        try:
            client.images.build(fileobj=io.BytesIO(buf.getvalue()), custom_context=True, tag=image, rm=True,
                                forcerm=True, network_mode="none", labels={"agentrl": "1", "agentrl.base.uv": version})
        except (docker.errors.BuildError, docker.errors.APIError) as e:
            raise RuntimeError(f"building {image} from the uv=={version} wheel failed: {e}") from e
    return image, note
