"""The resolved config a run was made with, stored beside it, and the check that a resume uses the same one.

``{run}/config.json`` (``RunLayout.config_record``) is the ``RunConfig`` as JSON, written by the first
flow that writes into the run. A later flow on the same ``run_id`` with a config that differs in
anything but the fields of :data:`RESUMABLE` is refused with :class:`ConfigChanged`, naming each
differing field: a form run with another task set must not rewrite ``envs.json``, nor an evaluation
with other settings overwrite ``eval.json``. ``allow_config_change`` is the explicit override: the
old record moves to ``config-history/NNNN.json`` and the new one is stored.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from infra.config import RunConfig
from infra.layout import RunLayout

RESUMABLE = frozenset({"steps", "name"})
"""Fields a resume may change: running more steps is how a run is extended; ``name`` only labels it."""


class ConfigChanged(ValueError):
    """A run id reused with a different config; the message names the run, the record and the fields."""


def _flat(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict) and value:
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: value}


def differences(stored: dict, config: RunConfig, ignore: tuple[str, ...] = ()) -> list[str]:
    """``field: stored -> given`` for each dotted field that differs, sorted.

    Fields of :data:`RESUMABLE` and under the dotted prefixes ``ignore`` (``("eval",)``) are not compared.
    """
    try:  # a record written before a field existed holds no value for it: compare with its default
        stored = RunConfig.model_validate(stored).model_dump(mode="json")
    except ValidationError:  # a field since removed or renamed: compare as stored (it shows as a difference)
        pass
    old, new = _flat(stored), _flat(config.model_dump(mode="json"))
    skip = (*RESUMABLE, *ignore)
    out = []
    for key in sorted(set(old) | set(new)):
        if any(key == p or key.startswith(p + ".") for p in skip) or old.get(key, "(absent)") == new.get(key,
                                                                                                      "(absent)"):
            continue
        out.append(f"{key}: {json.dumps(old.get(key, '(absent)'))} -> {json.dumps(new.get(key, '(absent)'))}")
    return out


def check(fs, config: RunConfig, allow_config_change: bool = False, ignore: tuple[str, ...] = ()) -> dict | None:
    """The stored record of ``config.run_id`` (None if none); reads only. ``ignore``: as :func:`differences`.

    Raises:
        ConfigChanged: a record exists, differs from ``config`` and ``allow_config_change`` is off.
    """
    layout = RunLayout(config.storage.bucket, config.storage.prefix, config.run_id)
    fs.invalidate_cache()
    if not fs.exists(layout.config_record):
        return None
    stored = json.loads(fs.cat_file(layout.config_record))
    diff = differences(stored, config, ignore)
    if diff and not allow_config_change:
        raise ConfigChanged(
            f"run '{config.run_id}' was made with another config ({layout.config_record}); differing fields: "
            + "; ".join(diff) + ". Use a new run_id, or continue this run with the new config explicitly "
            "(allow_config_change=true; CLI --allow-config-change)")
    return stored


def claim(fs, config: RunConfig, allow_config_change: bool = False) -> str:
    """Store ``config`` as the run's record, or check it matches the stored one; returns the record's URI.

    With ``allow_config_change`` and a differing record, the old one is kept at ``config_history(n)``
    first. A record that differs only in :data:`RESUMABLE` fields is left as first written.

    Raises:
        ConfigChanged: as :func:`check`; nothing is written then.
    """
    layout = RunLayout(config.storage.bucket, config.storage.prefix, config.run_id)
    stored = check(fs, config, allow_config_change)
    body = json.dumps(config.model_dump(mode="json"), indent=1).encode()
    if stored is None:
        fs.pipe_file(layout.config_record, body)
    elif differences(stored, config):
        n = len(fs.glob(layout.config_history(0).replace("0000.json", "*.json")))
        fs.pipe_file(layout.config_history(n), json.dumps(stored, indent=1).encode())
        fs.pipe_file(layout.config_record, body)
    return layout.config_record
