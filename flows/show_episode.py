"""Show what the agent did: one stored episode, a task's episodes, or a step's chosen set, as markdown.

``python -m flows.show_episode --config configs/quickstart.toml [--run-id R] --step N
(--episode-id E | --task T | --chosen)`` reads ``RunLayout.trajectories(N)`` from S3 (source
``.state/services.env`` first: ``set -a; . .state/services.env; set +a``) and prints what the
``publish_step_episodes`` artifact shows (``infra.episodes``): ``--task`` prints every episode of the
task in the step (its GRPO group, by sample index and attempt). Not a flow: it reads, never writes.
A missing step file or episode is one ``error:`` line naming what was looked for and what exists (exit 2).
"""

from __future__ import annotations

import argparse
import sys

from infra.config import ConfigError, load_config


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _listing(values: list[str], most: int = 20) -> str:
    shown = ", ".join(values[:most])
    return shown + (f", ... ({len(values)} in all)" if len(values) > most else "")


def main(argv: list[str] | None = None) -> int:
    """Print the selected episodes of a stored step; 0 on success, 2 on an input that cannot be used."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.toml", help="TOML run config")
    parser.add_argument("--run-id", default=None, help="override config run_id")
    parser.add_argument("--step", type=int, required=True, help="training step whose trajectories to read")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--episode-id", default=None, help="one episode (an attempt's id)")
    which.add_argument("--task", default=None, help="every episode of this task id in the step")
    which.add_argument("--chosen", action="store_true", help="the step's chosen episodes (best/worst per outcome)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, **({"run_id": args.run_id} if args.run_id else {}))
    except ConfigError as e:  # names the file already
        return _error(str(e))

    from infra.episodes import load_decoder, render_episode, render_step_episodes, step_advantages
    from infra.layout import RunLayout
    from infra.model import resolve_model
    from infra.storage import StorageError, s3_filesystem
    from infra.store import read_step

    try:
        fs = s3_filesystem(config.storage.bucket)
    except StorageError as e:
        return _error(f"storage: {e}")
    layout = RunLayout(config.storage.bucket, config.storage.prefix, config.run_id)
    uri = layout.trajectories(args.step)
    if not fs.exists(uri):
        folder = layout.trajectories_dir
        stored = sorted(fs.glob(f"{folder}/step-*.parquet")) if fs.exists(folder) else []
        steps = [str(int(p.rsplit("step-", 1)[1].split(".")[0])) for p in stored]
        return _error(f"{uri}: no trajectory file for step {args.step} of run {config.run_id}; "
                      f"stored steps: {_listing(steps) if steps else 'none'}")
    rows = read_step(fs, uri).to_pylist()
    if args.episode_id is not None:
        selected = [r for r in rows if r["episode_id"] == args.episode_id]
        if not selected:
            return _error(f"{uri}: no episode {args.episode_id!r}; its {len(rows)} episodes: "
                          f"{_listing(sorted(r['episode_id'] for r in rows))}")
    elif args.task is not None:
        selected = sorted((r for r in rows if r["task_id"] == args.task),
                          key=lambda r: (r["group_id"], r["sample_index"], r["attempt"]))
        if not selected:
            return _error(f"{uri}: no episode of task {args.task!r}; its tasks: "
                          f"{_listing(sorted({r['task_id'] for r in rows}))}")
    try:
        decode, markers = load_decoder(resolve_model(config.model.path))
    except OSError as e:  # FileNotFoundError: not an HF folder; OSError: no tokenizer in it
        return _error(f"model.path: {e}")
    t, harness = config.train, config.rollout.harness.kind
    try:
        if args.chosen:
            print(render_step_episodes(rows, decode, harness, markers=markers,
                                       scale_by_std=t.scale_by_std, baseline=t.baseline))
        else:
            advantages = step_advantages(rows, t.scale_by_std, t.baseline)
            print("\n---\n\n".join(render_episode(r, decode, advantages.get(r["episode_id"]), harness, markers)
                                     for r in selected))
    except ValueError as e:  # a row whose replies do not match its commands, named by episode
        return _error(f"{uri}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
