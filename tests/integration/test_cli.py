"""The flows' command line on real services: an unusable input is one ``error:`` line and exit 2, before the flow.

Each case points a real check at a real thing that is not there (a missing socket, a missing
folder); nothing is faked. The run id of every case is fresh and is checked to have written
nothing to the store.
"""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import run_cli


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
    ('[engine]\nkind = "remote"\nurls = ["http://127.0.0.1:9"]\n', {"AGENTRL_ENGINE_TOKEN": ""},
     'engine.kind = "remote": $AGENTRL_ENGINE_TOKEN is not set'),
    ('[engine]\nkind = "remote"\nurls = ["http://127.0.0.1:9"]\n', {"AGENTRL_ENGINE_TOKEN": "t"},
     "engine.urls: http://127.0.0.1:9 cannot be reached"),
], ids=["model", "terminal_dir", "eval_ids", "code_file", "docker", "eval_dtype", "remote_token", "remote_url"])
def test_unusable_input_is_one_error_line_and_nothing_is_written(services_env, s3, tmp_path, toml, env, message):
    run_id = f"cli-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'run_id = "{run_id}"\n' + toml)
    r = run_cli("flows.post_train", "--config", str(cfg), env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {cfg}: {message}"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    s3.invalidate_cache()
    assert not s3.exists(f"{services_env['AGENTRL_BUCKET']}/runs/{run_id}"), "a refused run wrote to the store"


@pytest.mark.integration
def test_evaluate_cli_refuses_another_precision_before_loading(services_env, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('run_id = "cli-eval-dtype"\n[eval]\ndtype = "bfloat16"\n')
    r = run_cli("flows.evaluate", "--config", str(cfg))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: {cfg}: eval.dtype=bfloat16 but model.serving_dtype=float32: evaluation runs in the serving precision")


@pytest.mark.integration
def test_preflight_skips_model_path_once_the_run_has_published(services_env, s3, tiny_model):
    """A resumed run starts from its newest checkpoint, so a base model folder that is gone since
    does not stop it; before the first publication it does."""
    from flows.cli import RunInputError, preflight
    from infra.checkpoint import publish
    from infra.config import RunConfig
    from infra.layout import RunLayout

    run_id = f"cli-{uuid.uuid4().hex[:8]}"
    config = RunConfig.model_validate({"run_id": run_id, "model": {"path": "/gone/model"}})
    with pytest.raises(RunInputError, match="model.path: /gone/model is not an HF model folder"):
        preflight(config, docker=False, tasks=False)
    bucket = services_env["AGENTRL_BUCKET"]
    publish(s3, tiny_model, RunLayout(bucket, "runs", run_id).checkpoint(1), 1, 0, 0, "float32")
    preflight(config, docker=False, tasks=False)  # v1 is published: the run resumes from it
