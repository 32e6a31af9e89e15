"""The flows' command line without services: a dead S3 endpoint is one ``error:`` line and exit 2, before the flow.

A real check points at a real closed port; nothing is faked.
"""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_cli

QUICKSTART = ROOT / "configs" / "quickstart.toml"


def test_dead_s3_endpoint_is_named_before_the_flow_starts():
    env = {"AGENTRL_S3_ENDPOINT": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    r = run_cli("flows.post_train", "--config", str(QUICKSTART), "--run-id", "cli-dead-s3", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith(f"error: {QUICKSTART}: storage: S3 endpoint http://127.0.0.1:9 not reachable"), err
    assert "Traceback" not in r.stderr and "Beginning flow run" not in r.stderr + r.stdout


def test_dead_s3_endpoint_in_make_up_is_a_clear_error():
    from infra.services import _ensure_bucket

    with pytest.raises(RuntimeError, match=r"S3 at http://127.0.0.1:9: cannot list/create bucket 'agentrl'"):
        _ensure_bucket("http://127.0.0.1:9", "k", "s", "agentrl")
