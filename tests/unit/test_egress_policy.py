"""The egress rules (infra.egress.policy) and the row's egress columns, on hand-built inputs."""

import pytest

from infra.config import EgressConfig
from infra.egress.mirrors import folder_file, uv_installer_script
from infra.egress.policy import (
    EgressSummary,
    Mirror,
    cacheable,
    host_allowed,
    match_mirror,
    record_lines,
    session_allow,
)
from infra.store import egress_columns


@pytest.mark.parametrize(("host", "patterns", "allowed"), [
    ("pypi.org", ("pypi.org",), True),
    ("PyPI.org.", ("pypi.org",), True),  # case and a trailing dot do not matter
    ("files.pythonhosted.org", ("*.pythonhosted.org",), True),
    ("pythonhosted.org", ("*.pythonhosted.org",), False),  # Harbor's *.host means a subdomain
    ("evil-pypi.org", ("pypi.org",), False),
    ("anything.example", ("*",), True),
    ("pypi.org", (), False),
])
def test_host_patterns(host, patterns, allowed):
    assert host_allowed(host, patterns) is allowed


def test_session_allow_by_task_setting_phase_and_run_settings():
    run_allow, agent_allow = ("pypi.org",), ("files.pythonhosted.org",)
    # a task that allows any host: every phase, unless agent_allow narrows the agent's
    assert session_allow(None, "agent", run_allow, None)[0] == ("*",)
    assert session_allow(None, "agent", run_allow, agent_allow)[0] == ("files.pythonhosted.org", "pypi.org")
    assert session_allow(None, "verifier", run_allow, agent_allow)[0] == ("*",)
    assert session_allow(None, "build", run_allow, agent_allow)[0] == ("*",)
    # an allowlisted task: its hosts and the run's, in every phase
    hosts, policy = session_allow(("api.example.com",), "verifier", run_allow, agent_allow)
    assert hosts == ("api.example.com", "pypi.org") and "allowlist" in policy


@pytest.mark.parametrize(("method", "url", "cached"), [
    ("GET", "https://files.pythonhosted.org/packages/d9/5a/e7/six-1.16.0-py2.py3-none-any.whl", True),
    ("GET", "https://astral.sh/uv/0.7.13/install.sh", True),
    ("GET", "https://astral.sh/uv/install.sh", False),  # no version: whatever is newest
    ("GET", "https://github.com/astral-sh/uv/releases/download/0.7.13/uv-x86_64-unknown-linux-gnu.tar.gz", True),
    ("GET", "https://github.com/o/r/releases/latest/download/tool.tar.gz", False),
    ("GET", "https://huggingface.co/org/m/resolve/0123456789abcdef0123456789abcdef01234567/model.safetensors", True),
    ("GET", "https://huggingface.co/org/m/resolve/v1.0/model.safetensors", False),  # a tag can move
    ("GET", "https://huggingface.co/org/m/resolve/main/config.json", False),  # a branch, not a revision
    ("GET", "https://pypi.org/simple/six/", False),  # an index page changes
    ("GET", "http://deb.debian.org/debian/dists/bookworm/Release", False),
    ("GET", "http://deb.debian.org/debian/pool/main/c/curl/curl_7.88.1-10_amd64.deb", True),
    ("POST", "https://example.com/x-1.0-py3-none-any.whl", False),
    ("GET", "https://example.com/x-1.0-py3-none-any.whl?sig=1", True),  # the query is not part of the match
    ("GET", "https://github.com/o/r/archive/refs/heads/main.tar.gz", False),  # a branch's archive changes
    ("GET", "https://example.com/nightly.zip", False),
])
def test_what_is_cached(method, url, cached):
    assert cacheable(method, url) is cached


def test_mirror_matching():
    uv, hf = Mirror("uv"), Mirror("folder", "https://huggingface.co/", "/data/hf")
    assert match_mirror("https://astral.sh/uv/0.7.13/install.sh", [uv, hf]) == (
        uv, {"what": "installer", "version": "0.7.13"})
    assert match_mirror("https://astral.sh/uv/install.sh", [uv]) == (uv, {"what": "installer"})
    assert match_mirror("https://github.com/astral-sh/uv/releases/download/0.8.0/uv-aarch64-unknown-linux-musl.tar.gz",
                        [uv]) == (uv, {"what": "release", "version": "0.8.0", "arch": "aarch64", "libc": "musl"})
    assert match_mirror("https://huggingface.co/org/m/resolve/abc/config.json?download=1", [uv, hf]) == (
        hf, {"path": "org/m/resolve/abc/config.json"})
    assert match_mirror("https://astral.sh/other", [uv, hf]) is None


def test_folder_mirror_never_leaves_its_folder(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.txt").write_text("x")
    (tmp_path.parent / "secret.txt").write_text("s")
    assert folder_file(str(tmp_path), "a/f.txt") == b"x"
    assert folder_file(str(tmp_path), "a/missing") is None
    assert folder_file(str(tmp_path), "../secret.txt") is None
    assert folder_file(str(tmp_path), "a/%2e%2e/%2e%2e/secret.txt") is None


def test_uv_installer_names_the_version_and_says_a_mirror_served_it():
    script = uv_installer_script("0.7.13", "https://astral.sh/uv/0.7.13/install.sh").decode()
    assert script.startswith("#!/bin/sh\n")
    assert "releases/download/0.7.13/uv-$arch-unknown-linux-$libc.tar.gz" in script
    assert "served by the uv mirror: uv 0.7.13" in script and "$HOME/.local/bin" in script


def test_summary_of_a_record_and_the_rows_columns():
    records = [
        {"host": "pypi.org", "url": "https://pypi.org/simple/six/", "status": 200, "bytes": 1000, "source": "upstream"},
        {"host": "files.pythonhosted.org", "url": "https://f/x.whl", "status": 200, "bytes": 500, "source": "cache"},
        {"host": "astral.sh", "url": "https://astral.sh/uv/0.7.13/install.sh", "status": 200, "bytes": 2000,
         "source": "mirror uv"},
        {"host": "example.com", "url": "https://example.com/", "status": 403, "bytes": 90, "source": "denied"},
        {"host": "example.com", "url": "https://example.com/b", "status": 403, "bytes": 90, "source": "denied"},
        {"host": "judge.example", "url": "https://judge.example/submit", "status": 503, "bytes": 10,
         "source": "upstream"},
        {"host": "huggingface.co", "url": "https://huggingface.co/x", "status": 502, "bytes": 0, "source": "error"},
    ]
    s = EgressSummary.of(records)
    assert s.requests == 7 and s.bytes == 3690
    assert s.upstream_bytes == 1000 + 10  # not the cache's, the mirror's or the proxy's own denials
    assert s.hosts == ["pypi.org", "files.pythonhosted.org", "astral.sh", "example.com", "judge.example",
                       "huggingface.co"]
    assert s.denied == ["example.com"] and s.cached == 1
    assert s.failed == ["judge.example 503", "huggingface.co 502"]
    assert s.mirrored == ["uv: https://astral.sh/uv/0.7.13/install.sh"]
    lines = record_lines({"agent": s.__dict__, "verifier": EgressSummary().__dict__})
    assert lines[0].startswith("[agent] egress: 7 requests") and "[agent] egress denied by policy: example.com" in lines
    assert not any(line.startswith("[verifier]") for line in lines)  # a phase that sent nothing
    cols = egress_columns({"agent": s.__dict__})
    assert cols["egress_agent_requests"] == 7 and cols["egress_agent_denied"] == ["example.com"]
    assert (cols["egress_verifier_requests"], cols["egress_verifier_hosts"]) == (0, [])


def test_egress_config_as_proxy_settings():
    s = EgressConfig(allow=["pypi.org"], agent_allow=[], mirrors=[{"kind": "uv"},
                     {"kind": "folder", "prefix": "https://huggingface.co/", "source": "/hf"}]).settings()
    assert s.allow == ("pypi.org",) and s.agent_allow == ()  # an empty list: the agent reaches no host
    assert s.mirrors == (Mirror("uv"), Mirror("folder", "https://huggingface.co/", "/hf"))
    assert EgressConfig().settings().agent_allow is None and EgressConfig().enabled is True


def test_step_egress_totals_line_banner_and_episode_header():
    from infra.episodes import _egress_lines
    from infra.report import attention
    from infra.summary import egress_totals

    rows = [egress_columns({"agent": {"requests": 2, "bytes": 3_000_000, "hosts": ["pypi.org", "x.example"],
                                      "denied": ["x.example"]},
                            "verifier": {"requests": 5, "bytes": 1_000_000, "hosts": ["astral.sh"], "denied": []}}),
            egress_columns({})]
    totals = egress_totals(rows)
    assert totals == {"agent_requests": 2.0, "agent_bytes": 3e6, "agent_denied_rows": 1.0,
                      "verifier_requests": 5.0, "verifier_bytes": 1e6, "verifier_denied_rows": 0.0}
    header = _egress_lines(rows[0])
    assert header[0] == "- **egress (agent)** 2 requests, 3.00 MB, to `pypi.org`, `x.example`; **denied** `x.example`"
    assert header[1] == "- **egress (tests)** 5 requests, 1.00 MB, to `astral.sh`" and _egress_lines(rows[1]) == []
    found = attention({"optimizer_step": True, "rows_with_signal": 1, "rows": 2, "outcomes": {}, "egress": totals})
    assert found == ["egress denied: 1 of 2 rows asked for a host their policy does not allow (agent or tests; see "
                     "the episodes' egress lines, tasks.egress.allow / agent_allow)"]


def test_exclude_newer_keeps_only_files_uploaded_before_the_cutoff():
    """uv's ``--exclude-newer`` on a PEP 691 page: files at or after the cutoff, or without ``upload-time``, go;
    ``versions`` keeps those with a file left; HTML clients get the same files as PEP 503 links."""
    from infra.egress.mirrors import page_before, page_html, parse_cutoff

    def f(name, uploaded=None, **extra):
        return {"filename": name, "url": f"https://files.pythonhosted.org/p/{name}", "hashes": {"sha256": "ab"},
                **({"upload-time": uploaded} if uploaded else {}), **extra}

    page = {"meta": {"api-version": "1.1"}, "name": "transformers", "versions": ["4.52.4", "5.0.0", "5.1.0"],
            "files": [f("transformers-4.52.4-py3-none-any.whl", "2025-05-30T12:00:00.000001Z",
                        **{"requires-python": ">=3.9", "core-metadata": {"sha256": "cd"}}),
                      f("transformers-4.52.4.tar.gz", "2025-05-30T12:00:01Z"),
                      f("transformers-5.0.0-py3-none-any.whl", "2025-07-01T00:00:00Z"),  # at the cutoff: out
                      f("transformers-5.1.0.tar.gz")]}  # no upload time: out
    kept = page_before(page, parse_cutoff("2025-07-01"))
    assert [x["filename"] for x in kept["files"]] == ["transformers-4.52.4-py3-none-any.whl",
                                                      "transformers-4.52.4.tar.gz"]
    assert kept["versions"] == ["4.52.4"] and kept["name"] == "transformers" and len(page["files"]) == 4
    assert parse_cutoff("2025-07-01T00:00:00Z") == parse_cutoff("2025-07-01")
    html = page_html(kept).decode()
    assert ('<a href="https://files.pythonhosted.org/p/transformers-4.52.4-py3-none-any.whl#sha256=ab" '
            'data-requires-python="&gt;=3.9" data-core-metadata="sha256=cd" data-dist-info-metadata="sha256=cd">'
            "transformers-4.52.4-py3-none-any.whl</a>") in html
    assert "5.0.0" not in html
    with pytest.raises(ValueError, match="expected an ISO 8601 date"):
        parse_cutoff("last summer")
    m = Mirror("exclude-newer", source="2025-07-01")
    assert match_mirror("https://pypi.org/simple/transformers/", [m]) == (m, {"what": "project",
                                                                            "project": "transformers"})
    assert match_mirror("https://pypi.org/simple/", [m]) is None  # the root index is not filtered
    assert match_mirror("https://files.pythonhosted.org/packages/x.whl", [m]) is None
    assert m.name == "exclude-newer 2025-07-01"
