"""A harness's own virtual environment: its pinned packages from PyPI, apart from the run's (no conflicts).

``$AGENTRL_STATE/harnesses/{name}/`` is created once per requirement set (``installed.json`` records
it) under a file lock, so concurrent episodes wait for one install.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from infra.layout import repo_root


def harness_python(name: str, requirements: list[str]) -> Path:
    """The interpreter of harness ``name``'s venv with ``requirements`` installed (created on first use).

    Raises:
        RuntimeError: ``pip install`` failed (its output's tail is in the message).
    """
    root = Path(os.environ.get("AGENTRL_STATE", repo_root() / ".state")) / "harnesses" / name
    root.parent.mkdir(parents=True, exist_ok=True)
    marker, python = root / "installed.json", root / "bin" / "python"
    with open(root.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()) == requirements and python.exists():
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True, capture_output=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               *requirements], capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"installing harness {name} ({' '.join(requirements)}) into {root} failed: "
                               f"{(done.stderr or done.stdout)[-1500:]}")
        marker.write_text(json.dumps(requirements))
    return python


def harness_target(name: str, requirements: list[str], python_version: str) -> Path:
    """A directory with ``requirements`` installed for CPython ``python_version`` on x86-64 Linux (wheels only).

    For a harness that needs another Python than this one (run where that Python is: a container),
    put on its ``PYTHONPATH``. ``pip install --target`` with the host's pip (and its CA settings);
    created once per requirement set under a file lock, as :func:`harness_python`.

    Raises:
        RuntimeError: ``pip install`` failed (its output's tail is in the message).
    """
    root = Path(os.environ.get("AGENTRL_STATE", repo_root() / ".state")) / "harnesses" / name
    root.parent.mkdir(parents=True, exist_ok=True)
    marker, lib = root / "installed.json", root / "lib"
    with open(root.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()) == requirements and lib.is_dir():
            return lib
        if lib.exists():
            shutil.rmtree(lib)
        platforms = [f"--platform={p}" for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64",
                                                  "manylinux_2_28_x86_64", "linux_x86_64")]
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               "--target", str(lib), f"--python-version={python_version}", "--implementation=cp",
                               "--only-binary=:all:", *platforms, *requirements],
                              capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"installing harness {name} ({' '.join(requirements)}) for Python {python_version} "
                               f"into {lib} failed: {(done.stderr or done.stdout)[-1500:]}")
        marker.write_text(json.dumps(requirements))
    return lib
