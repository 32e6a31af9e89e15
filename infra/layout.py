"""Where a run's data lives: every storage path of a run is built and parsed here, nowhere else.

Under ``s3://{bucket}/{prefix}/{run_id}/``: ``envs.json`` and ``envs-logs/``, ``trajectories/``,
``dropped/`` and ``divergence/`` (``step-{step:06d}.parquet``), ``checkpoints/v{N}/`` (with
``eval.json``), ``summaries/step-{step:06d}.json``, ``report.md`` and ``config.json``; beside each
artifact, its lineage (``{artifact}.lineage.json``). Validation verdicts are shared
by every run of a bucket: ``s3://{bucket}/validation/{key}.json``. Local scratch (exports, fetched
checkpoints, trainer states, server logs) is ``$AGENTRL_STATE/work/{run_id}/``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_CHECKPOINT = re.compile(r"/checkpoints/v(\d+)/?$")


TRAINER_STATE_COMPLETE = "COMPLETE"


def repo_root() -> Path:
    """The project's root folder (relative config paths resolve against it)."""
    return Path(__file__).resolve().parent.parent


def resolve_path(path: str) -> Path | None:
    """A config path: absolute, or relative to the repo root; None for an empty string."""
    if not path:
        return None
    p = Path(path)
    return p if p.is_absolute() else repo_root() / p


@dataclass(frozen=True)
class RunLayout:
    """The storage paths of one run (URIs are ``s3://...``; ``work`` is a local folder)."""

    bucket: str
    prefix: str
    run_id: str

    @property
    def root(self) -> str:
        """``s3://{bucket}/{prefix}/{run_id}``."""
        return f"s3://{self.bucket}/{self.prefix}/{self.run_id}"

    @property
    def catalog(self) -> str:
        """The environment catalog, ``envs.json``."""
        return f"{self.root}/envs.json"

    def envs_log(self, task_id: str) -> str:
        """Build and validation log of a task (``/`` in its id becomes ``__``)."""
        return f"{self.root}/envs-logs/{task_id.replace('/', '__')}.log"

    def validation(self, key: str) -> str:
        """A cached validation verdict (shared by the runs of the bucket)."""
        return f"s3://{self.bucket}/validation/{key}.json"

    def trajectories(self, step: int) -> str:
        """One step's trajectory file."""
        return f"{self.root}/trajectories/step-{step:06d}.parquet"

    @property
    def trajectories_dir(self) -> str:
        """The folder of the step files (no scheme: an s3fs path)."""
        return f"{self.bucket}/{self.prefix}/{self.run_id}/trajectories"

    def dropped(self, step: int) -> str:
        """Groups the scheduler dropped while collecting ``step``."""
        return f"{self.root}/dropped/step-{step:06d}.parquet"

    @property
    def dropped_dir(self) -> str:
        """The folder of the dropped-group files (no scheme: an s3fs path)."""
        return f"{self.bucket}/{self.prefix}/{self.run_id}/dropped"

    def divergence(self, step: int) -> str:
        """Per-row divergence decisions of ``step``'s training."""
        return f"{self.root}/divergence/step-{step:06d}.parquet"

    def checkpoint(self, version: int) -> str:
        """Folder of checkpoint ``v{version}``."""
        return f"{self.root}/checkpoints/v{version}"

    @property
    def images_dir(self) -> str:
        """Task image archives for other nodes' engines, by image id, shared by the runs of the prefix (s3fs path)."""
        return f"{self.bucket}/{self.prefix}/images"

    @property
    def checkpoints_dir(self) -> str:
        """The folder of the checkpoints (no scheme: an s3fs path)."""
        return f"{self.bucket}/{self.prefix}/{self.run_id}/checkpoints"

    def trainer_state(self, version: int) -> str:
        """Folder of the trainer state saved with ``v{version}`` (``train.state_storage = "s3"``).

        Complete once it holds :data:`TRAINER_STATE_COMPLETE` (written last).
        """
        return f"{self.root}/trainer-state/v{version}"

    def eval_report(self, version: int, dtype: str = "", mismatch: bool = False) -> str:
        """``eval.json`` (serving precision) or, for another precision, ``eval-{dtype}-not-serving.json``."""
        name = f"eval-{dtype}-not-serving.json" if mismatch else "eval.json"
        return f"{self.checkpoint(version)}/{name}"

    def eval_served(self, version: int, dtype: str) -> str:
        """Where the report of an earlier serving precision is kept when the serving dtype changes."""
        return f"{self.checkpoint(version)}/eval-served-{dtype}.json"

    def summary(self, step: int) -> str:
        """One step's stored summary."""
        return f"{self.root}/summaries/step-{step:06d}.json"

    @property
    def summaries_glob(self) -> str:
        """Glob of every stored step summary."""
        return f"{self.root}/summaries/step-*.json"

    def episodes(self, step: int) -> str:
        """One step's chosen episodes, rendered (markdown, ``infra.episodes``)."""
        return f"{self.root}/episodes/step-{step:06d}.md"

    @property
    def report(self) -> str:
        """The run report (markdown)."""
        return f"{self.root}/report.md"

    @property
    def config_record(self) -> str:
        """The resolved config the run was made with (``config.json``); earlier ones in ``config-history/``."""
        return f"{self.root}/config.json"

    def config_history(self, n: int) -> str:
        """The ``n``-th config the run had before an explicit change (``allow_config_change``)."""
        return f"{self.root}/config-history/{n:04d}.json"

    @staticmethod
    def lineage(uri: str) -> str:
        """The lineage record stored beside an ``s3://`` artifact: ``{uri}.lineage.json`` (a folder's too)."""
        return f"{uri.rstrip('/')}.lineage.json"

    @property
    def work(self) -> Path:
        """Local scratch of the run: ``$AGENTRL_STATE/work/{run_id}`` (created)."""
        state = Path(os.environ.get("AGENTRL_STATE", repo_root() / ".state"))
        path = state / "work" / self.run_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    @staticmethod
    def version_of(checkpoint_uri: str) -> int:
        """The version in a checkpoint URI (``.../checkpoints/v{N}``).

        Raises:
            ValueError: ``checkpoint_uri`` does not name a checkpoint folder.
        """
        m = _CHECKPOINT.search(checkpoint_uri)
        if m is None:
            raise ValueError(f"{checkpoint_uri}: not a checkpoint URI (expected .../checkpoints/v<N>)")
        return int(m.group(1))


def artifact_key(run_id: str, suffix: str) -> str:
    """A Prefect artifact key for a run (keys allow only lowercase letters, digits and dashes)."""
    return "".join(c if c.isalnum() else "-" for c in run_id.lower()) + f"-{suffix}"
