"""Install into the project's venv with uv, under the machine's pip settings; pip when uv cannot.

Run as a script before the project is installed (it imports nothing of it):
``python infra/venv_install.py VENV_PYTHON [uv pip install args...]``. uv reads no pip
configuration, so what decides what gets installed and from where is read with pip's own option
parser (config files and ``PIP_*`` variables, pip's precedence) and carried over: ``index-url``,
``no-index``, ``extra-index-url`` (local ``file://`` indexes that do not exist are left out, as pip
skips them with a warning), ``find-links``, ``constraint``, ``trusted-host``, ``pre`` and ``cert``
(as ``SSL_CERT_FILE``: a machine behind a TLS proxy trusts its CA). pip installs instead, reading
those settings itself, when uv is missing or fails, when pip's options cannot be read, or when a
setting uv is not given here is set (``proxy``, ``client-cert``, ``require-hashes``,
``only-binary``/``no-binary``). Exits with the installer's status.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# pip's install options as pip resolves them (its parser applies config files and PIP_* variables)
_READ_OPTIONS = """
import json
from pip._internal.commands import create_command
o, _ = create_command("install").parse_args([])
fc = o.format_control
print(json.dumps({"index_url": o.index_url, "no_index": o.no_index, "extra_index_urls": o.extra_index_urls,
                  "find_links": o.find_links, "constraints": o.constraints, "trusted_hosts": o.trusted_hosts,
                  "pre": o.pre, "cert": o.cert, "unsupported": [name for name, value in [
                      ("proxy", o.proxy), ("client-cert", o.client_cert), ("require-hashes", o.require_hashes),
                      ("no-binary/only-binary", fc.no_binary or fc.only_binary)] if value]}))
"""


def pip_options(python: str) -> dict | None:
    """The install options as pip resolves them (see ``_READ_OPTIONS``); None when they cannot be read."""
    r = subprocess.run([python, "-c", _READ_OPTIONS], capture_output=True, text=True)
    try:
        return json.loads(r.stdout) if r.returncode == 0 else None
    except ValueError:
        return None


def _usable_index(url: str) -> bool:
    return not url.startswith("file://") or Path(url.removeprefix("file://")).is_dir()


def uv_args(o: dict) -> tuple[list[str], dict[str, str]]:
    """Flags and environment for ``uv pip install`` from pip's resolved options ``o``."""
    args = ["--index-strategy", "unsafe-best-match"]  # pip's: the best version over every index
    args += ["--no-index"] if o["no_index"] else ["--index-url", o["index_url"]]
    args += [a for url in o["extra_index_urls"] if _usable_index(url) for a in ("--extra-index-url", url)]
    args += [a for link in o["find_links"] for a in ("--find-links", link)]
    args += [a for c in o["constraints"] for a in ("--constraint", c)]
    args += [a for host in o["trusted_hosts"] for a in ("--allow-insecure-host", host)]
    args += ["--prerelease", "allow"] if o["pre"] else []
    return args, ({"SSL_CERT_FILE": o["cert"]} if o["cert"] else {})


def main(argv: list[str]) -> int:
    """Install ``argv[1:]`` into the venv whose interpreter is ``argv[0]``; returns the exit status."""
    python, install = argv[0], argv[1:]
    uv = shutil.which("uv", path=str(Path(python).parent))
    options = pip_options(python) if uv is not None else None
    if uv is None or options is None:
        why = "no uv in the venv" if uv is None else "pip's options could not be read"
    elif options["unsupported"]:
        why = f"pip settings not carried over to uv: {', '.join(options['unsupported'])}"
    else:
        args, env = uv_args(options)
        rc = subprocess.run([uv, "pip", "install", "-q", "--python", python, *args, *install],
                            env={**os.environ, **env}).returncode
        if rc == 0:
            return 0
        why = f"uv failed (exit {rc})"
    print(f"venv_install: {why}; installing with pip instead", file=sys.stderr)  # noqa: T201
    return subprocess.run([python, "-m", "pip", "install", "-q", *install]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
