"""infra/venv_install.py: pip's settings carried over to uv's flags."""

from __future__ import annotations

import subprocess

from infra import venv_install


def test_pip_precedence_and_uv_flags(monkeypatch, tmp_path):
    (tmp_path / "simple").mkdir()
    listed = (f"global.extra-index-url='file://{tmp_path}/simple file:///nowhere/simple'\n"
              "global.find-links='/opt/a /opt/b'\n"
              "global.cert='/etc/global.crt'\n"
              "install.cert='/etc/install.crt'\n"
              "global.constraint='/etc/c.txt'\n"
              ":env:.find-links='/opt/wheels'\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, listed, ""))
    settings = venv_install.pip_settings("python")
    assert settings["find-links"] == "/opt/wheels" and settings["cert"] == "/etc/install.crt"
    args, env = venv_install.uv_args(settings)
    assert args == ["--index-strategy", "unsafe-best-match", "--find-links", "/opt/wheels",
                    "--constraint", "/etc/c.txt", "--extra-index-url", f"file://{tmp_path}/simple"]
    assert env == {"SSL_CERT_FILE": "/etc/install.crt"}
