"""Install into the project's venv with uv, under the machine's pip settings; pip when uv cannot.

Run as a script before the project is installed (it imports nothing of it):
``python infra/venv_install.py VENV_PYTHON [uv pip install args...]``. uv reads no pip
configuration, so the settings that decide what gets installed and from where are carried over
from ``pip config list`` (files and ``PIP_*`` variables, pip's precedence): ``find-links``,
``constraint``, ``index-url``, ``extra-index-url`` (local ``file://`` indexes that do not exist are
left out, as pip skips them with a warning) and ``cert`` (as ``SSL_CERT_FILE``: a machine behind a TLS
proxy trusts its CA). When uv is missing or fails, the same install runs with ``VENV_PYTHON -m pip``,
which reads those settings itself. Exits with the installer's status.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# ``pip config list`` prints each ``section.name`` once, the files already merged in pip's order
# (site over user over global); a ``PIP_*`` variable (section ``:env:``) wins over [install] over [global].
_SECTIONS = {"global": 0, "install": 1, ":env:": 2}
_LIST_FLAGS = {"find-links": "--find-links", "constraint": "--constraint", "extra-index-url": "--extra-index-url"}


def pip_settings(python: str) -> dict[str, str]:
    """``{name: value}`` from ``python -m pip config list``, the highest-precedence value of each name."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    best: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if sep and section in _SECTIONS and (name not in best or _SECTIONS[section] >= best[name][0]):
            best[name] = (_SECTIONS[section], value.strip().strip("'\""))
    return {name: value for name, (_, value) in best.items()}


def _usable_index(url: str) -> bool:
    return not url.startswith("file://") or Path(url.removeprefix("file://")).is_dir()


def uv_args(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Flags and environment for ``uv pip install`` from pip's ``settings``."""
    args = ["--index-strategy", "unsafe-best-match"]  # pip's: the best version over every index
    if (index := settings.get("index-url")) and _usable_index(index):
        args += ["--index-url", index]
    for name, flag in _LIST_FLAGS.items():
        for value in settings.get(name, "").split():
            if name != "extra-index-url" or _usable_index(value):
                args += [flag, value]
    env = {"SSL_CERT_FILE": settings["cert"]} if settings.get("cert") else {}
    return args, env


def main(argv: list[str]) -> int:
    """Install ``argv[1:]`` into the venv whose interpreter is ``argv[0]``; returns the exit status."""
    python, install = argv[0], argv[1:]
    uv = shutil.which("uv", path=str(Path(python).parent))
    if uv is not None:
        args, env = uv_args(pip_settings(python))
        rc = subprocess.run([uv, "pip", "install", "-q", "--python", python, *args, *install],
                            env={**os.environ, **env}).returncode
        if rc == 0:
            return 0
        print(f"venv_install: uv failed (exit {rc}); installing with pip instead", file=sys.stderr)  # noqa: T201
    return subprocess.run([python, "-m", "pip", "install", "-q", *install]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
