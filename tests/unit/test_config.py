"""Run configs: every shipped config parses; bad ones get errors naming file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import ConfigError, RunConfig, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_parses(path):
    assert isinstance(load_config(path), RunConfig)


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[rollout]\ngroup_sise = 4\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown key 'rollout.group_sise'; did you mean 'group_size'\? "
                                          r"expected one of \(rollout\): .*group_size"):
        load_config(p)
    p.write_text("stepz = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'stepz'; did you mean 'steps'\? expected one of \(top level\)"):
        load_config(p)


def test_cross_field_error_names_the_fields(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[publish]\npattern = "colocated"\n[rollout]\nengine = "servers"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: publish.pattern = \"colocated\" needs rollout.engine") and "''" not in msg
    p.write_text("[eval]\nk = [5]\n")  # a check inside one table
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: eval.k: each k must be in 1..samples_per_task=1, got [5]"


def test_out_of_range_value_is_named(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[rollout]\ngroup_size = 0\n")
    with pytest.raises(ConfigError, match=r"bad.toml: field 'rollout.group_size'.*greater than or equal to 1"):
        load_config(p)


def test_not_toml_and_missing(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("steps = = 2\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    p.write_bytes(b"steps = 2 # caf\xe9\n")
    with pytest.raises(ConfigError, match="bad.toml: not UTF-8 text"):
        load_config(p)
    with pytest.raises(ConfigError, match="is a folder; expected a TOML config file"):
        load_config(tmp_path)


def test_overrides_apply_and_validate():
    cfg = load_config(CONFIGS[0], steps=1, run_id="x1", **{"rollout.seed": 7})
    assert cfg.steps == 1 and cfg.run_id == "x1" and cfg.rollout.seed == 7
    with pytest.raises(ConfigError, match="unknown key 'rollout.sead'"):
        load_config(CONFIGS[0], **{"rollout.sead": 7})
    with pytest.raises(ConfigError, match="run_id"):
        load_config(CONFIGS[0], run_id="has space")
