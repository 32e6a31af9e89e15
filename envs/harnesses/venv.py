"""A harness's own virtual environment: its pinned packages from PyPI, apart from the run's (no conflicts).

``$AGENTRL_STATE/harnesses/{name}/`` is created once per requirement set (``installed.json`` records
it) under a file lock, so concurrent episodes wait for one install.
"""

from __future__ import annotations

import fcntl
import json
import os
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
