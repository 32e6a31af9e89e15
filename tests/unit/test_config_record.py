"""The config stored with a run, and the refusal to resume it with another (an in-memory filesystem)."""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest

from infra.config import RolloutConfig, RunConfig, TaskSetConfig, load_config
from infra.config_record import ConfigChanged, check, claim, differences
from infra.layout import RunLayout


@pytest.fixture
def fs():
    mem = fsspec.filesystem("memory")
    yield mem
    mem.store.clear()


def test_first_flow_stores_the_config_and_a_resume_with_it_passes(fs):
    config = load_config("configs/quickstart.toml", run_id=f"r-{uuid.uuid4().hex[:6]}")
    uri = claim(fs, config)
    assert uri == RunLayout("agentrl", "runs", config.run_id).config_record
    assert json.loads(fs.cat_file(uri)) == config.model_dump(mode="json")
    more_steps = config.model_copy(update={"steps": 10, "name": "quickstart-longer"})
    assert claim(fs, more_steps) == uri  # steps (and the label) may change on a resume
    assert json.loads(fs.cat_file(uri))["steps"] == config.steps  # the record stays as first written


def test_another_config_on_the_same_run_id_is_refused_naming_the_fields(fs):
    stored = load_config("configs/quickstart.toml")
    claim(fs, stored)
    form_defaults = RunConfig()  # the form's code defaults, run_id "quickstart" too
    with pytest.raises(ConfigChanged) as e:
        claim(fs, form_defaults)
    msg = str(e.value)
    assert "run 'quickstart' was made with another config (s3://agentrl/runs/quickstart/config.json)" in msg
    assert 'tasks.terminal_dir: "" -> "envs/terminal"' in msg and "--allow-config-change" in msg
    assert "steps" not in differences(stored.model_dump(mode="json"), form_defaults)
    assert json.loads(fs.cat_file(RunLayout("agentrl", "runs", "quickstart").config_record))["tasks"][
        "terminal_dir"] == ""  # nothing was written


def test_explicit_change_keeps_the_old_record_in_the_history(fs):
    a = RunConfig(run_id="hist", rollout=RolloutConfig(group_size=4))
    b = RunConfig(run_id="hist", rollout=RolloutConfig(group_size=8), tasks=TaskSetConfig(humaneval_eval=2))
    claim(fs, a)
    assert differences(a.model_dump(mode="json"), b) == ["rollout.group_size: 4 -> 8",
                                                          "tasks.humaneval_eval: 8 -> 2"]
    claim(fs, b, allow_config_change=True)
    layout = RunLayout("agentrl", "runs", "hist")
    assert json.loads(fs.cat_file(layout.config_record))["rollout"]["group_size"] == 8
    assert json.loads(fs.cat_file(layout.config_history(0)))["rollout"]["group_size"] == 4


def test_evaluation_may_differ_in_the_ignored_fields_only(fs):
    a = RunConfig(run_id="ev")
    claim(fs, a)
    other_eval = a.model_copy(update={"eval": a.eval.model_copy(update={"max_tokens": 7})})
    assert check(fs, other_eval, ignore=("eval",)) is not None
    with pytest.raises(ConfigChanged, match=r"eval.max_tokens: \d+ -> 7"):
        check(fs, other_eval)
    assert check(fs, RunConfig(run_id="never-stored")) is None


def test_load_config_names_the_config_by_its_file():
    assert load_config("configs/learn-agentic.toml").name == "learn-agentic"


def test_a_record_from_before_a_field_existed_still_resumes(fs):
    config = RunConfig(run_id="older")
    record = config.model_dump(mode="json")
    del record["rollout"]["top_k"]  # written before top_k existed; its default is what the run used
    layout = RunLayout("agentrl", "runs", "older")
    fs.pipe_file(layout.config_record, json.dumps(record).encode())
    assert claim(fs, config) == layout.config_record
    record["rollout"]["no_such_field"] = 1  # a field since removed: compared as stored, not a crash
    assert differences(record, config) == ['rollout.no_such_field: 1 -> "(absent)"',
                                           'rollout.top_k: "(absent)" -> 0']


def test_task_run_names_come_from_the_resolved_arguments():
    from tasks.naming import stage_run_name

    assert stage_run_name("collect_rollouts")(parameters={"run": object(), "task_ids": [], "step": 3}) == \
        "collect_rollouts step 3"
    assert stage_run_name("evaluate")(parameters={"report_uri": "s3://b/runs/r/checkpoints/v2/eval.json"}) == \
        "evaluate v2"
    assert stage_run_name("prepare_policy")(parameters={"run": object()}) == "prepare_policy"
