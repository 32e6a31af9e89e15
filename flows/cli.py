"""The shared command line of the flows: ``--config``, overrides, a preflight of the run's inputs, then the flow.

Every input a run needs is checked before torch, vLLM or Prefect start (seconds, not the minutes
after which a flow would otherwise fail inside a task, retried): the config, the S3 endpoint and
bucket, the Docker engine, the task sources, the model folder. A bad one prints a single
``error: ...`` line naming the file, field or endpoint and exits 2; nothing has been written.
The flow then runs against one Prefect backend (``infra.prefect_backend.flow_backend``).
"""

from __future__ import annotations

import argparse
import inspect
import sys

from infra.config import ConfigError, load_config
from infra.preflight import RunInputError, preflight

__all__ = ["RunInputError", "preflight", "run_flow_cli"]


def run_flow_cli(flow_fn, doc: str, argv: list[str] | None = None,
                 options: list[tuple[str, dict]] = (), show=lambda result, config: print(result),
                 config_options: list[tuple[str, str, dict]] = (), checks: dict | None = None,
                 precheck=None, record_ignore: tuple[str, ...] = ()) -> int:
    """Parse ``--config`` and overrides, run ``preflight``, then call ``flow_fn(config, **extra)``.

    Args:
        flow_fn: the flow.
        doc: the flow module's docstring (first line: the CLI description).
        argv: arguments (default ``sys.argv[1:]``).
        options: extra ``(flag, add_argument keywords)``; each parsed value is passed to the flow
            by its ``dest`` name.
        show: called with ``(flow result, config)`` to print the result.
        config_options: ``(flag, dotted config field, add_argument keywords)``: a value given
            overrides that field of the config (``--steps`` -> ``steps``).
        checks: keywords of ``preflight`` (which inputs this flow needs).
        precheck: called with the config before ``preflight``; may raise ``PrecisionMismatch``.
        record_ignore: config fields this flow may change on a stored run (``infra.config_record.check``);
            a flow with an ``allow_config_change`` parameter gets ``--allow-config-change`` and the check.

    Returns:
        0 on success; 2 when the config or an input cannot be used (one ``error:`` line on stderr).
    """
    from infra.config_record import ConfigChanged, check
    from infra.evaluate import PrecisionMismatch

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.toml", help="TOML run config")
    parser.add_argument("--run-id", default=None, help="override config run_id")
    overrides = [(parser.add_argument(flag, default=None, **kw).dest, field)
                 for flag, field, kw in config_options]
    extra = [parser.add_argument(flag, **kw).dest for flag, kw in options]
    guarded = "allow_config_change" in inspect.signature(getattr(flow_fn, "fn", flow_fn)).parameters
    if guarded:
        extra.append(parser.add_argument(
            "--allow-config-change", action="store_true",
            help="continue a stored run with a config that differs from the one it was made with").dest)
    args = parser.parse_args(argv)
    given = {field: getattr(args, dest) for dest, field in [("run_id", "run_id"), *overrides]
             if getattr(args, dest) is not None}
    try:
        config = load_config(args.config, **given)  # before torch/vLLM load: fast, clear errors
        if precheck is not None:
            precheck(config)
        fs = preflight(config, **(checks or {}))
        if guarded:  # a stored run with another config: refused here, before anything loads
            check(fs, config, args.allow_config_change, ignore=record_ignore)
    except ConfigError as e:  # names the file already
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RunInputError, PrecisionMismatch, ConfigChanged) as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 2
    # errors from here on happen inside the flow (maybe after writes): Prefect logs them, they propagate
    from infra.prefect_backend import flow_backend

    with flow_backend():  # the checkout's server if up, else a temporary one; a watchdog
        result = flow_fn(config, **{name: getattr(args, name) for name in extra})
    show(result, config)
    return 0
