"""prefect.yaml is generated from configs/*.toml: one post_train deployment per config, its values the defaults."""

from __future__ import annotations

import yaml

from flows.deployments import main, render
from infra.config import RunConfig, load_config
from infra.layout import repo_root


def test_prefect_yaml_is_up_to_date_with_the_configs():
    assert main(["--check"]) == 0, "run: python -m flows.deployments"


def test_each_config_is_a_deployment_whose_defaults_are_its_values():
    spec = yaml.safe_load(render())
    by_name = {d["name"]: d for d in spec["deployments"]}
    for path in (repo_root() / "configs").glob("*.toml"):
        d = by_name[path.stem]
        assert d["entrypoint"] == "flows/post_train.py:post_train"
        assert RunConfig.model_validate(d["parameters"]["config"]) == load_config(path)
    assert by_name["evaluate"]["parameters"]["config"]["run_id"] == "quickstart"
    assert [s["active"] for s in by_name["quickstart"]["schedules"]] == [False]
