"""The flows' parameter form: Prefect builds it from ``RunConfig``'s JSON schema; each backend union is a choice."""

from __future__ import annotations

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate

from infra.config import DirectPublish, RunConfig, ServersEngine, SyncScheduler


@pytest.fixture(scope="module")
def schema() -> dict:
    from flows.post_train import post_train

    return parameter_schema(post_train).model_dump()


def _choices(schema: dict, model: str, field: str) -> tuple[list[str], dict]:
    prop = schema["definitions"][model]["properties"][field]
    # anyOf, not oneOf: Prefect's default UI renders anyOf as one tab per choice and oneOf only as raw JSON
    assert "oneOf" not in prop
    return [ref["$ref"].removeprefix("#/definitions/") for ref in prop["anyOf"]], prop["default"]


def test_each_backend_union_is_a_choice_with_its_default(schema):
    assert _choices(schema, "RunConfig", "engine") == (["InprocEngine", "ServersEngine", "RemoteEngine"],
                                                       {"kind": "inproc", "threads": 0, "realtime_priority": 0})
    assert _choices(schema, "RunConfig", "publish") == (
        ["StoragePublish", "DirectPublish", "ColocatedPublish"], {"kind": "storage", "endpoint": ""})
    names, default = _choices(schema, "RolloutConfig", "scheduler")
    assert names == ["SyncScheduler", "AsyncScheduler"] and default["kind"] == "async"
    servers = schema["definitions"]["ServersEngine"]["properties"]
    assert servers["kind"]["const"] == "servers" and servers["count"]["default"] == 2
    # a choice shows only its own fields
    assert set(servers) == {"kind", "count", "threads", "routing", "host", "advertise"}


def test_the_forms_values_validate_back_into_the_same_config(schema):
    from flows.post_train import post_train

    default = {"config": schema["properties"]["config"]["default"]}
    assert validate(default, schema, raise_on_error=True) == []  # the server's check of a run's parameters
    assert post_train.validate_parameters(default)["config"] == RunConfig()
    # what the form sends after picking the ServersEngine, DirectPublish and SyncScheduler tabs
    picked = RunConfig(engine=ServersEngine(), publish=DirectPublish(),
                       rollout={"scheduler": SyncScheduler()}).model_dump(mode="json")
    assert validate({"config": picked}, schema, raise_on_error=True) == []
    assert post_train.validate_parameters({"config": picked})["config"] == RunConfig.model_validate(picked)
    assert validate({"config": {"engine": {"kind": "gpu"}}}, schema)  # an unknown kind fails the server's check


@pytest.mark.parametrize("name", ["post_train", "build_envs", "collect_rollouts", "evaluate", "refresh_difficulty"])
def test_every_form_field_has_help_text(name):
    """The form shows each field's description: flow parameters from the docstring's Args, config fields from
    their attribute docstrings (a field whose own text equals its table's is shown with the table's)."""
    import importlib

    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(getattr(importlib.import_module(f"flows.{name}"), name).fn).model_dump()
    defs = schema.get("definitions") or schema.get("$defs") or {}
    missing = [k for k, v in schema["properties"].items() if not v.get("description")]
    for model, d in defs.items():
        for field, prop in d.get("properties", {}).items():
            ref = prop.get("$ref", "").rsplit("/", 1)[-1]
            if not prop.get("description") and not defs.get(ref, {}).get("description"):
                missing.append(f"{model}.{field}")
    assert missing == []
