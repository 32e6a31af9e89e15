"""Names of task runs in the Prefect UI: the stage and its step or version (``collect_rollouts step 3``)."""

from __future__ import annotations

import re
from collections.abc import Callable

_VERSION = re.compile(r"/checkpoints/v(\d+)(?:/|$)")


def stage_run_name(stage: str) -> Callable[..., str]:
    """A ``task_run_name`` callable: ``{stage} step {step}``, else ``{stage} v{version}``, else ``stage``.

    The step is the task's ``step`` argument (or its ``summary.step``); the version its ``version`` argument
    or the first checkpoint URI among its arguments. Prefect passes ``parameters`` resolved (quoted
    arguments unwrapped, ``tasks.lineage``); ``prefect.runtime.task_run.parameters`` would still hold them quoted.
    """
    def name(parameters: dict) -> str:
        params = parameters or {}
        step = params.get("step", getattr(params.get("summary"), "step", None))
        if isinstance(step, int):
            return f"{stage} step {step}"
        if isinstance(params.get("version"), int):
            return f"{stage} v{params['version']}"
        for value in params.values():
            if isinstance(value, str) and (m := _VERSION.search(value)):
                return f"{stage} v{m.group(1)}"
        return stage
    return name
