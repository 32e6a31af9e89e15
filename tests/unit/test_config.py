"""Run configs: every shipped config parses; bad ones get errors naming file and field; backends chosen by kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import (
    AsyncScheduler,
    ColocatedPublish,
    ConfigError,
    DirectPublish,
    InprocEngine,
    RunConfig,
    ServersEngine,
    StoragePublish,
    SyncScheduler,
    load_config,
)

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
    p.write_text('[publish]\nkind = "colocated"\n[engine]\nkind = "servers"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: publish.kind = \"colocated\" needs engine.kind = \"inproc\"") and "''" not in msg
    with pytest.raises(ValueError, match="colocated.*needs engine.kind"):
        RunConfig(engine=ServersEngine(), publish=ColocatedPublish())
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


def test_a_config_that_sets_nothing_means_what_it_meant_before_the_unions():
    # the flat fields' defaults before the change: engine "inproc", pattern "storage", scheduler "async"
    c = RunConfig()
    assert c.engine == InprocEngine() and c.publish == StoragePublish()
    assert c.rollout.scheduler == AsyncScheduler(overprovision=1.0, prefetch=False, max_policy_lag=1,
                                                 episode_deadline_s=900.0, infra_policy="retry",
                                                 update_policy="pause", max_concurrent_episodes=16)
    assert ServersEngine() == ServersEngine(count=2, threads=1, routing="affinity")
    assert DirectPublish().host == "127.0.0.1"


def test_each_kind_takes_its_own_keys(tmp_path):
    p = tmp_path / "ok.toml"
    p.write_text('[engine]\nkind = "servers"\ncount = 3\nrouting = "round_robin"\n'
                 '[publish]\nkind = "direct"\nhost = "10.0.0.2"\n'
                 '[rollout]\nscheduler = { kind = "async", overprovision = 1.5, prefetch = true }\n')
    c = load_config(p)
    assert c.engine == ServersEngine(count=3, threads=1, routing="round_robin")
    assert c.publish == DirectPublish(host="10.0.0.2")
    assert c.rollout.scheduler == AsyncScheduler(overprovision=1.5, prefetch=True)
    p.write_text('[rollout.scheduler]\nkind = "sync"\n')
    assert load_config(p).rollout.scheduler == SyncScheduler()
    assert load_config(p, **{"engine.kind": "servers", "engine.count": 4}).engine == ServersEngine(count=4)


def _error(tmp_path, text: str) -> str:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    return str(e.value).replace(f"{p}: ", "bad.toml: ")


def test_unknown_key_in_a_kind_lists_that_kinds_keys(tmp_path):
    assert _error(tmp_path, '[engine]\nkind = "servers"\ncont = 2\n') == (
        "bad.toml: unknown key 'engine.cont'; did you mean 'count'? "
        'expected one of (engine, kind = "servers"): advertise, count, host, kind, routing, threads')
    assert _error(tmp_path, '[engine]\nkind = "inproc"\ncount = 2\n') == (
        "bad.toml: unknown key 'engine.count'; 'count' is a key of kind 'servers'; "
        'expected one of (engine, kind = "inproc"): kind, realtime_priority, threads')
    assert _error(tmp_path, '[rollout.scheduler]\nkind = "async"\nprefech = true\n').startswith(
        "bad.toml: unknown key 'rollout.scheduler.prefech'; did you mean 'prefetch'? "
        'expected one of (rollout.scheduler, kind = "async"): dynamic_sampling, episode_deadline_s, infra_policy,')


def test_unknown_or_missing_kind_names_the_kinds(tmp_path):
    assert _error(tmp_path, '[engine]\nkind = "server"\n') == (
        "bad.toml: field 'engine.kind': unknown kind 'server'; did you mean 'servers'? "
        "expected one of 'inproc', 'servers', 'remote'")
    assert _error(tmp_path, '[publish]\nkind = "s3"\n') == (
        "bad.toml: field 'publish.kind': unknown kind 's3'; expected one of 'storage', 'direct', 'colocated'")
    assert _error(tmp_path, "[engine]\ncount = 3\n") == (
        "bad.toml: field 'engine.kind': missing; expected one of 'inproc', 'servers', 'remote' "
        "('count' is a key of kind 'servers')")


def test_a_value_inside_a_kind_is_named_by_its_toml_field(tmp_path):
    assert _error(tmp_path, '[engine]\nkind = "servers"\ncount = 0\n') == (
        "bad.toml: field 'engine.count': Input should be greater than or equal to 1 (got 0)")
    assert _error(tmp_path, "[rollout]\nscheduler = { kind = \"async\", update_policy = \"later\" }\n").startswith(
        "bad.toml: field 'rollout.scheduler.update_policy': Input should be 'finish', 'pause' or 'abort'")
    assert _error(tmp_path, "[rollout]\nscheduler = { kind = \"async\", retry_backoff_s = -1 }\n") == (
        "bad.toml: field 'rollout.scheduler.retry_backoff_s': Input should be greater than or equal to 0 (got -1)")


def test_the_flat_keys_of_older_configs_say_where_they_went(tmp_path):
    assert _error(tmp_path, '[rollout]\nscheduler = "sync"\n') == (
        "bad.toml: field 'rollout.scheduler': expected a table with a kind, one of 'sync', 'async' "
        "(e.g. rollout.scheduler = {kind = \"sync\"}), got 'sync'")
    lines = _error(tmp_path, '[rollout]\nengine = "servers"\nservers = 3\nmax_policy_lag = 2\n').splitlines()
    assert [line.split("; expected")[0] for line in lines] == [
        "bad.toml: unknown key 'rollout.engine'; 'rollout.engine' moved to 'engine.kind'",
        "bad.toml: unknown key 'rollout.servers'; 'rollout.servers' moved to 'engine.count'",
        "bad.toml: unknown key 'rollout.max_policy_lag'; 'rollout.max_policy_lag' moved to "
        "'rollout.scheduler.max_policy_lag'"]
    assert _error(tmp_path, '[publish]\npattern = "direct"\n') == (
        "bad.toml: field 'publish.kind': missing; expected one of 'storage', 'direct', 'colocated' "
        "('publish.pattern' moved to 'publish.kind')")


def test_top_k_is_off_by_default_and_out_of_range_is_named(tmp_path):
    from infra.rollout.collector import CollectSettings

    assert RunConfig().rollout.top_k == 0  # vLLM's value for "off"
    p = tmp_path / "ok.toml"
    p.write_text("[rollout]\ntop_k = 40\ntop_p = 0.9\n")
    settings = CollectSettings.of(load_config(p).rollout)
    assert (settings.top_k, settings.top_p) == (40, 0.9)
    assert _error(tmp_path, "[rollout]\ntop_k = -1\n") == (
        "bad.toml: field 'rollout.top_k': Input should be greater than or equal to 0 (got -1)")
    assert _error(tmp_path, "[rollout]\ntop_k = 2.5\n").startswith("bad.toml: field 'rollout.top_k': ")


def test_no_fallback_base_image_unless_chosen_and_registry_mirrors_are_checked(tmp_path):
    assert RunConfig().tasks.fallback_base_image == ""  # an unpullable FROM fails, cause registry_image
    p = tmp_path / "mirrors.toml"
    p.write_text('[tasks]\nfallback_base_image = "agentrl-base:bookworm"\n'
                 'registry_mirrors = {"docker.io" = "localhost:5000", "*" = "mirror.example:443/cache"}\n')
    t = load_config(p).tasks
    assert t.fallback_base_image == "agentrl-base:bookworm"
    assert t.registry_mirrors == {"docker.io": "localhost:5000", "*": "mirror.example:443/cache"}
    p.write_text('[tasks]\nregistry_mirrors = {"docker.io" = "https://localhost:5000"}\n')
    with pytest.raises(ConfigError, match=r"mirrors.toml: .*tasks.registry_mirrors: 'docker.io' = "
                                          r"'https://localhost:5000': expected a registry .* without a scheme"):
        load_config(p)


def test_partial_groups_need_k_between_2_and_the_group_size(tmp_path):
    ok = tmp_path / "ok.toml"
    ok.write_text('[rollout]\ngroup_size = 8\n[rollout.scheduler]\nkind = "async"\npartial_group_min_samples = 4\n'
                  'overprovision = 1.5\n')
    assert load_config(ok).rollout.scheduler.partial_group_min_samples == 4
    assert "must be below group_size = 4" in _error(
        tmp_path, '[rollout]\ngroup_size = 4\n[rollout.scheduler]\nkind = "async"\npartial_group_min_samples = 4\n'
                  'overprovision = 2.0\n')
    assert "no group is ever split (set overprovision above 1)" in _error(
        tmp_path, '[rollout]\ngroup_size = 8\n[rollout.scheduler]\nkind = "async"\npartial_group_min_samples = 4\n')
    assert "no GRPO baseline" in _error(
        tmp_path, '[rollout.scheduler]\nkind = "async"\npartial_group_min_samples = 1\n')
    assert "does not combine with dynamic_sampling" in _error(
        tmp_path, '[rollout.scheduler]\nkind = "async"\npartial_group_min_samples = 2\ndynamic_sampling = true\n')


def test_rollouts_on_ray_take_either_scheduler_and_need_an_engine_reached_over_http(tmp_path):
    ok = tmp_path / "ok.toml"
    ok.write_text('[engine]\nkind = "servers"\nhost = "10.0.0.1"\n[rollout]\nfan_out = "ray"\n'
                  'ray_address = "10.0.0.1:6379"\n[rollout.scheduler]\nkind = "sync"\n')
    assert load_config(ok).rollout.ray_address == "10.0.0.1:6379"
    ok.write_text('[engine]\nkind = "servers"\n[rollout]\nfan_out = "ray"\n')  # the async scheduler
    assert load_config(ok).rollout.scheduler.kind == "async"
    assert "nodes cannot reach servers on 127.0.0.1" in _error(  # a cluster elsewhere, engines on loopback
        tmp_path, '[engine]\nkind = "servers"\n[rollout]\nfan_out = "ray"\nray_address = "10.0.0.1:6379"\n')
    assert 'rollout.fan_out = "ray" needs engine.kind = "servers" or "remote"' in _error(
        tmp_path, '[rollout]\nfan_out = "ray"\n[rollout.scheduler]\nkind = "sync"\n')
    assert "ray_address = '10.0.0.1:6379' is set but rollout.fan_out = \"local\"" in _error(
        tmp_path, '[rollout]\nray_address = "10.0.0.1:6379"\n')


@pytest.mark.parametrize(("cuda", "avx512_bf16", "amx", "expected"), [
    (False, False, False, "float32"),  # an AVX2-only CPU: bf16 would be emulated
    (False, True, False, "bfloat16"),
    (False, False, True, "bfloat16"),
    (True, False, False, "bfloat16"),
])
def test_auto_serving_dtype_is_bf16_only_where_the_host_computes_it_natively(tmp_path, monkeypatch, cuda,
                                                                             avx512_bf16, amx, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    cfg = tmp_path / "auto.toml"
    cfg.write_text('[model]\nserving_dtype = "auto"\n')
    assert load_config(cfg).model.serving_dtype == expected
    assert load_config(cfg, resolve_auto=False).model.serving_dtype == "auto"  # as a deployment keeps it
    assert load_config(cfg, **{"model.serving_dtype": "bfloat16"}).model.serving_dtype == "bfloat16"  # explicit
    # the flow validates a deployment's parameters on its own host: "auto" resolves there
    kept = load_config(cfg, resolve_auto=False).model_dump(mode="json")
    assert RunConfig.model_validate(kept).model.serving_dtype == expected


def test_auto_serving_dtype_is_refused_with_remote_servers(tmp_path):
    cfg = tmp_path / "remote.toml"
    cfg.write_text('[model]\nserving_dtype = "auto"\n[engine]\nkind = "remote"\nurls = ["http://10.0.0.7:8000"]\n')
    with pytest.raises(ConfigError, match=r'remote\.toml: .*model\.serving_dtype = "auto" resolves on this host, '
                                          r'not on the remote servers'):
        load_config(cfg)
    assert load_config(cfg, **{"model.serving_dtype": "float32"}).model.serving_dtype == "float32"
