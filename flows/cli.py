"""The shared command line of the deployable flows: ``--config``, overrides, then run the flow."""

from __future__ import annotations

import argparse
import sys

from infra.config import ConfigError, load_config


def run_flow_cli(flow_fn, doc: str, argv: list[str] | None = None,
                 options: list[tuple[str, dict]] = (), show=print) -> int:
    """Parse ``--config`` (before torch/vLLM load: fast, clear errors) and call ``flow_fn(config, **extra)``.

    ``options``: extra ``(flag, add_argument keywords)``; each parsed value is passed to the flow
    by its ``dest`` name. ``show`` prints the flow's result.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.toml", help="TOML run config")
    parser.add_argument("--run-id", default=None, help="override config run_id")
    extra = [parser.add_argument(flag, **kw).dest for flag, kw in options]
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, **({"run_id": args.run_id} if args.run_id else {}))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    show(flow_fn(config, **{name: getattr(args, name) for name in extra}))
    return 0
