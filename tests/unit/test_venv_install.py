"""infra/venv_install.py: pip's resolved settings carried over to uv's flags."""

from __future__ import annotations

import sys

from infra import venv_install


def test_pip_options_follow_pip_precedence_and_become_uv_flags(monkeypatch, tmp_path):
    (tmp_path / "simple").mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = /opt/from-file\nextra-index-url = file://{tmp_path}/simple "
                    "file:///nowhere/simple\ncert = /etc/file.crt\n[install]\ncert = /etc/install.crt\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")  # a variable wins over the files
    monkeypatch.setenv("PIP_PRE", "1")
    monkeypatch.delenv("PIP_CERT", raising=False)
    o = venv_install.pip_options(sys.executable)
    assert o is not None and o["find_links"] == ["/opt/wheels"] and o["cert"] == "/etc/install.crt"
    args, env = venv_install.uv_args(o)
    assert args[:4] == ["--index-strategy", "unsafe-best-match", "--index-url", o["index_url"]]
    assert "file:///nowhere/simple" not in args  # pip skips a local index that does not exist
    assert args[args.index("--extra-index-url") + 1] == f"file://{tmp_path}/simple"
    assert args[args.index("--find-links") + 1] == "/opt/wheels" and args[-2:] == ["--prerelease", "allow"]
    assert env == {"SSL_CERT_FILE": "/etc/install.crt"}


def test_a_setting_uv_is_not_given_is_named(monkeypatch):
    monkeypatch.setenv("PIP_PROXY", "http://proxy.example:3128")
    assert venv_install.pip_options(sys.executable)["unsupported"] == ["proxy"]
