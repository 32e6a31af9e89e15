"""``prefect.yaml`` from the shipped configs: a ``post_train`` deployment per config, its values the defaults.

``python -m flows.deployments`` rewrites ``prefect.yaml`` (``--check`` fails if it is out of date; a
unit test runs that). Deployments: ``post_train/<config>`` for each config (``quickstart`` with the
nightly schedule, off), and one deployment of each other flow with the quickstart's values. A form
default is the config as ``load_config`` reads it, so "Quick run" on a deployment runs that config
and a changed form on a stored run id is refused (``infra.config_record``); ``serving_dtype = "auto"`` is
kept as such, for the flow to resolve on the host it runs on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from infra.config import load_config
from infra.layout import repo_root

HEADER = """\
# Deployments of agentrl's flows, generated from configs/*.toml by `python -m flows.deployments` (do not edit:
# a unit test checks this file is up to date). `make server` starts a local Prefect server and a worker on the
# process pool `agentrl-process`; `make deploy` registers these (`prefect --no-prompt deploy --all`).
# Trigger one: `prefect deployment run post_train/quickstart` (parameters: the RunConfig form, whose defaults
# are that config's values).
"""
OTHER_FLOWS = {
    "build_envs": "Build the task images and write envs.json.",
    "refresh_difficulty": "Pass rates from stored trajectories and the task sample for a step.",
    "collect_rollouts": "One step of rollouts with the newest published policy, stored as Parquet.",
    "evaluate": "pass@k of a published checkpoint on held-out tasks, in the serving precision.",
}


def render(root: Path | None = None) -> str:
    """The text of ``prefect.yaml`` for the configs under ``root/configs``."""
    root = root or repo_root()
    configs = {p.stem: load_config(p, resolve_auto=False) for p in sorted((root / "configs").glob("*.toml"))}
    deployments = []
    for name, config in configs.items():
        first = (p.read_text().splitlines() or [""])[0] if (p := root / "configs" / f"{name}.toml").exists() else ""
        entry = {"name": name, "entrypoint": "flows/post_train.py:post_train",
                 "description": f"post_train with configs/{name}.toml ({config.steps} steps). {first.lstrip('# ')}",
                 "tags": [f"config:{name}"], "work_pool": {"name": "agentrl-process"},
                 "parameters": {"config": config.model_dump(mode="json")}}
        if name == "quickstart":
            entry["schedules"] = [{"cron": "0 3 * * *", "timezone": "UTC", "active": False}]
        deployments.append(entry)
    quickstart = configs["quickstart"].model_dump(mode="json")
    for flow_name, description in OTHER_FLOWS.items():
        deployments.append({"name": flow_name, "entrypoint": f"flows/{flow_name}.py:{flow_name}",
                            "description": f"{description} Defaults: configs/quickstart.toml.",
                            "tags": ["config:quickstart"], "work_pool": {"name": "agentrl-process"},
                            "parameters": {"config": quickstart}})
    body = {"name": "agentrl", "prefect-version": "3.7.7",
            "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $AGENTRL_ROOT }}"}}],
            "deployments": deployments}
    return HEADER + yaml.safe_dump(body, sort_keys=False, width=110)


def main(argv: list[str] | None = None) -> int:
    """Write ``prefect.yaml`` (or, with ``--check``, exit 1 when it differs from what the configs give)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that prefect.yaml is up to date")
    args = parser.parse_args(argv)
    path, text = repo_root() / "prefect.yaml", render()
    if args.check:
        if path.read_text() != text:
            print(f"error: {path} is out of date with configs/*.toml: run python -m flows.deployments", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
