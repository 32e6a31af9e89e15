"""The flows' command line: a bad config or an unusable input is one ``error:`` line and exit 2, before the flow.

Each case points a real check at a real thing that is not there (a closed port, a missing socket,
a missing folder); nothing is faked. The run id of every case is fresh and is checked to have
written nothing to the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def _cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_dead_s3_endpoint_is_named_before_the_flow_starts():
    env = {"AGENTRL_S3_ENDPOINT": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    r = _cli("flows.post_train", "--config", str(QUICKSTART), "--run-id", "cli-dead-s3", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith(f"error: {QUICKSTART}: storage: S3 endpoint http://127.0.0.1:9 not reachable"), err
    assert "Traceback" not in r.stderr and "Beginning flow run" not in r.stderr + r.stdout


def test_dead_s3_endpoint_in_make_up_is_a_clear_error():
    from infra.services import _ensure_bucket

    with pytest.raises(RuntimeError, match=r"S3 at http://127.0.0.1:9: cannot list/create bucket 'agentrl'"):
        _ensure_bucket("http://127.0.0.1:9", "k", "s", "agentrl")


@pytest.mark.integration
@pytest.mark.parametrize(("toml", "env", "message"), [
    ('[model]\npath = "/nonexistent/model"\n', {},
     "model.path: /nonexistent/model is not an HF model folder (no config.json)"),
    ('[tasks]\nterminal_dir = "/nonexistent/envs"\n', {}, "tasks: tasks.terminal_dir: /nonexistent/envs not found"),
    ('[tasks]\nterminal_eval_ids = ["no-such-task"]\n', {},
     "tasks: tasks.terminal_eval_ids: ['no-such-task'] are not tasks of the configured task sets"),
    ('[tasks]\ncode_file = "/nonexistent/problems.jsonl"\n', {},
     "tasks: tasks.code_file: /nonexistent/problems.jsonl not found"),
    ("", {"DOCKER_HOST": "unix:///nonexistent/docker.sock"},
     "Docker engine at unix:///nonexistent/docker.sock not reachable"),
    ('[eval]\ndtype = "bfloat16"\n', {}, "eval.dtype=bfloat16: post_train evaluates with its serving engine"),
], ids=["model", "terminal_dir", "eval_ids", "code_file", "docker", "eval_dtype"])
def test_unusable_input_is_one_error_line_and_nothing_is_written(services_env, s3, tmp_path, toml, env, message):
    run_id = f"cli-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'run_id = "{run_id}"\n' + toml)
    r = _cli("flows.post_train", "--config", str(cfg), env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {cfg}: {message}"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    s3.invalidate_cache()
    assert not s3.exists(f"{services_env['AGENTRL_BUCKET']}/runs/{run_id}"), "a refused run wrote to the store"


@pytest.mark.integration
def test_evaluate_cli_refuses_another_precision_before_loading(services_env, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('run_id = "cli-eval-dtype"\n[eval]\ndtype = "bfloat16"\n')
    r = _cli("flows.evaluate", "--config", str(cfg))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: {cfg}: eval.dtype=bfloat16 but model.serving_dtype=float32: evaluation runs in the serving precision")


@pytest.mark.integration
def test_preflight_skips_model_path_once_the_run_has_published(services_env, s3, tiny_model):
    """A resumed run starts from its newest checkpoint, so a base model folder that is gone since
    does not stop it; before the first publication it does."""
    from flows.cli import RunInputError, preflight
    from infra.checkpoint import checkpoint_uri, publish
    from infra.config import RunConfig

    run_id = f"cli-{uuid.uuid4().hex[:8]}"
    config = RunConfig.model_validate({"run_id": run_id, "model": {"path": "/gone/model"}})
    with pytest.raises(RunInputError, match="model.path: /gone/model is not an HF model folder"):
        preflight(config, docker=False, tasks=False)
    bucket = services_env["AGENTRL_BUCKET"]
    publish(s3, tiny_model, checkpoint_uri(bucket, "runs", run_id, 1), 1, 0, 0, "float32")
    preflight(config, docker=False, tasks=False)  # v1 is published: the run resumes from it
