"""A harness's own virtual environment: its pinned packages from PyPI, apart from the run's (no conflicts).

``{cache}/{name}/`` is created once per requirement set (``installed.json`` records it) under a file
lock, so concurrent episodes, runs and checkouts wait for one install. The cache is
``AGENTRL_HARNESS_CACHE`` or ``~/.cache/agentrl/harnesses``, outside any checkout (as the model cache
is): a fresh clone reuses what an earlier one installed instead of paying 1-2 min per harness again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def cache_root() -> Path:
    """Harness install cache (``AGENTRL_HARNESS_CACHE`` or ``~/.cache/agentrl/harnesses``), absolute."""
    default = Path.home() / ".cache" / "agentrl" / "harnesses"
    return Path(os.environ.get("AGENTRL_HARNESS_CACHE") or default).resolve()


def _root(name: str) -> Path:
    return cache_root() / name


def _install_once(name: str, requirements: list[str], installed: str, install, where: str) -> Path:
    """``{root}/{installed}``, made by ``install(root)`` (a pip run) unless ``installed.json`` records ``requirements``.

    ``root`` is :func:`_root`; one file lock per name, so concurrent episodes wait for one install.

    Raises:
        RuntimeError: ``install`` failed (its output's tail and ``where`` are in the message).
    """
    root = _root(name)
    root.parent.mkdir(parents=True, exist_ok=True)
    marker, result = root / "installed.json", root / installed
    with open(root.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()) == requirements and result.exists():
            return result
        done = install(root)
        if done.returncode:
            raise RuntimeError(f"installing harness {name} ({' '.join(requirements)}){where} failed: "
                               f"{(done.stderr or done.stdout)[-1500:]}")
        marker.write_text(json.dumps(requirements))
    return result


def harness_python(name: str, requirements: list[str]) -> Path:
    """The interpreter of harness ``name``'s venv with ``requirements`` installed (created on first use).

    Raises:
        RuntimeError: ``pip install`` failed (its output's tail is in the message).
    """
    def install(root: Path) -> subprocess.CompletedProcess:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True, capture_output=True)
        return subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", *requirements], capture_output=True, text=True,
                              timeout=1800)

    return _install_once(name, requirements, "bin/python", install, f" into {_root(name)}")


def harness_target(name: str, requirements: list[str], python_version: str) -> Path:
    """A directory with ``requirements`` installed for CPython ``python_version`` on x86-64 Linux (wheels only).

    For a harness that needs another Python than this one (run where that Python is: a container),
    put on its ``PYTHONPATH``. ``pip install --target`` with the host's pip (and its CA settings);
    created once per requirement set under a file lock, as :func:`harness_python`.

    Raises:
        RuntimeError: ``pip install`` failed (its output's tail is in the message).
    """
    def install(root: Path) -> subprocess.CompletedProcess:
        lib = root / "lib"
        if lib.exists():
            shutil.rmtree(lib)
        platforms = [f"--platform={p}" for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64",
                                                  "manylinux_2_28_x86_64", "linux_x86_64")]
        return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               "--target", str(lib), f"--python-version={python_version}", "--implementation=cp",
                               "--only-binary=:all:", *platforms, *requirements],
                              capture_output=True, text=True, timeout=1800)

    return _install_once(name, requirements, "lib", install, f" for Python {python_version} into {_root(name) / 'lib'}")


def npm_package(name: str, spec: str) -> Path:
    """``{cache}/{name}/package``: the npm package ``spec`` (``@scope/pkg@version``) unpacked, as published.

    ``npm pack`` fetches the tarball from the registry npm is configured for (checking its integrity)
    and it is unpacked without running any install script; created once per spec under a file lock,
    as :func:`harness_python`.

    Raises:
        RuntimeError: ``npm`` is missing, or the fetch or the unpacking failed (the output's tail is in the message).
    """
    if shutil.which("npm") is None:
        raise RuntimeError(f"installing harness {name} ({spec}) needs npm: install Node.js's npm "
                           "(Debian: `apt-get install npm`)")

    def install(root: Path) -> subprocess.CompletedProcess:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / "package", ignore_errors=True)
        packed = subprocess.run(["npm", "pack", spec, "--json", "--pack-destination", str(root)],
                                capture_output=True, text=True, timeout=1800)
        if packed.returncode:
            return packed
        tarball = root / json.loads(packed.stdout)[0]["filename"]
        try:
            return subprocess.run(["tar", "-xzf", str(tarball), "-C", str(root)], capture_output=True, text=True)
        finally:
            tarball.unlink(missing_ok=True)

    return _install_once(name, [spec], "package", install, f" into {_root(name)} with npm")


def harness_root(name: str) -> Path:
    """Harness ``name``'s install folder (created empty if it is not there yet, for mounting before install)."""
    root = _root(name)
    root.mkdir(parents=True, exist_ok=True)
    return root
