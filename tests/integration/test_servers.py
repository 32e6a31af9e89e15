"""Several real vLLM OpenAI servers behind the router: stickiness, failover, versions across an update.

Two servers (tiny model) are started once for the module; the collector runs real episodes in
Docker sandboxes through them with the asynchronous scheduler.
"""

from __future__ import annotations

import threading
import time

import pytest

from infra.rollout.engine import SampleRequest

pytestmark = pytest.mark.integration  # two real vLLM servers, dockerd


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    from infra.rollout.servers import start_servers

    started = start_servers(str(tiny_model), 2, tmp_path_factory.mktemp("vllm-logs"), max_model_len=1024,
                            kv_cache_gib=1.0, threads=1)
    yield started
    for s in started:
        s.stop()


@pytest.fixture()
def engine(servers, tiny_tokenizer):
    from infra.rollout.servers import ServerEngine

    for s in servers:
        if not s.alive():
            pytest.skip("a previous test killed a server")
    eng = ServerEngine(servers, tiny_tokenizer)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hello_image(backend):
    from envs import load_taskset
    from infra.environments import build_catalog
    from infra.layout import repo_root

    tasks = {t.task_id: t for t in load_taskset(repo_root() / "envs/terminal")[0] if t.task_id == "tb/hello-file"}
    entries, _ = build_catalog(backend, tasks, {k: "train" for k in tasks}, validate=False)
    assert entries[0].usable, entries[0].reason
    return tasks["tb/hello-file"], {"tb/hello-file": (entries[0].image, entries[0].image_digest)}


def _collector(engine, backend, images, max_turns: int = 3, group_size: int = 2, **kw):
    from infra.environments import BASE_IMAGE
    from infra.rollout.collector import Collector, CollectSettings
    from infra.rollout.scheduler import AsyncCollector

    settings = CollectSettings(group_size=group_size, temperature=1.0, top_p=1.0, max_tokens_per_turn=12,
                               max_turns=max_turns, seed=3, max_infra_retries=2)
    runner = Collector(engine, backend, settings, code_image=BASE_IMAGE)
    runner.bind("test-servers", 0, images)
    args = {"group_size": group_size, "max_groups_in_flight": 4, "max_concurrent_episodes": 8, "max_infra_retries": 2,
            "episode_deadline_s": 300}
    return AsyncCollector(runner, **{**args, **kw})


def test_sticky_routing_keeps_a_trajectory_on_its_replica_and_hits_its_prefix_cache(engine, tiny_tokenizer):
    before = engine.prefix_cache()
    served: dict[str, set] = {}
    histories = {f"traj{i}": tiny_tokenizer("hello there, this is a long enough shared prompt " * 4)["input_ids"]
                 for i in range(4)}
    for turn in range(3):
        samples = engine.generate([SampleRequest(h, 8, 1.0, 1.0, turn) for h in histories.values()],
                                  list(histories))
        for (tid, h), s in zip(list(histories.items()), samples, strict=True):
            served.setdefault(tid, set()).add(s.replica)
            histories[tid] = h + s.token_ids + tiny_tokenizer(" ok")["input_ids"]
    assert all(len(r) == 1 for r in served.values()), served  # sticky
    assert {next(iter(r)) for r in served.values()} == set(engine.servers)  # new ones spread over both
    after = engine.prefix_cache()
    assert after["hits"] - before["hits"] > 0  # later turns reused the cached history


class HoldLaterTurns:
    """The real engine, with each trajectory's second request held back until ``release`` is set.

    Lets a test apply a weight update exactly between turn 1 and turn 2 of every trajectory (timing only:
    every request is still served by the real engine).
    """

    def __init__(self, engine):
        self.engine = engine
        self.release = threading.Event()
        self.first_turns_done = threading.Semaphore(0)
        self._turns: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, trajectory_ids=None):
        with self._lock:
            turn = self._turns[trajectory_ids[0]] = self._turns.get(trajectory_ids[0], 0) + 1
        if turn == 2:
            assert self.release.wait(300), "the test never released the second turns"
        samples = self.engine.generate(requests, trajectory_ids)
        if turn == 1:
            self.first_turns_done.release()
        return samples


def test_weight_update_mid_trajectory_is_recorded_per_token(engine, backend, hello_image, tiny_model):
    task, images = hello_image
    held = HoldLaterTurns(engine)
    c = _collector(held, backend, images, max_turns=3, update_policy="pause")
    try:
        c.submit([("g-update", task)])
        for _ in range(2):  # both siblings sampled turn 1 (on v0); neither has sent turn 2
            assert held.first_turns_done.acquire(timeout=300), "the siblings' first turns were not sampled in 300 s"
        pause_s = c.update_weights(lambda: engine.load_weights(str(tiny_model), 1), 1)
        held.release.set()
        batch = c.next_batch(1, timeout_s=300)
    finally:
        held.release.set()
        c.drain(60)
        c.close()
    assert pause_s > 0
    for row in batch.train_rows():
        sampled = [v for v, m in zip(row["policy_versions"], row["loss_mask"], strict=True) if m]
        assert sampled[0] == 0, "turn 1 was sent before the update"
        assert sampled == sorted(sampled) and set(sampled) <= {0, 1}
        assert row["min_policy_version"] == sampled[0] and row["max_policy_version"] == sampled[-1]
        if row["num_turns"] > 1:
            assert sampled[-1] == 1, "turns after the update must come from version 1"
        assert all(v == -1 for v, m in zip(row["policy_versions"], row["loss_mask"], strict=True) if not m)


class HoldSample:
    """The real episode runner, with every attempt of some sample indices held back until ``release`` is set."""

    def __init__(self, runner, sample_indices: set[int]):
        self.runner, self.sample_indices, self.release = runner, sample_indices, threading.Event()

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, job):
        if job.sample_index in self.sample_indices:
            assert self.release.wait(300), "the test never released the held sample"
        return self.runner.run(job)


def test_partial_groups_train_finished_samples_and_the_remainder_after_an_update(engine, backend, hello_image,
                                                                                  tiny_model):
    task, images = hello_image
    c = _collector(engine, backend, images, max_turns=2, group_size=4, partial_group_min_samples=2,
                   update_policy="pause")
    held = c.runner = HoldSample(c.runner, {2, 3})
    try:
        c.submit([("g-a", task), ("g-b", task)])
        first = c.next_batch(1, timeout_s=300)  # 4 samples asked: no group is complete, both are split
        c.update_weights(lambda: engine.load_weights(str(tiny_model), 1), 1)
        held.release.set()
        second = c.next_batch(1, timeout_s=300)  # only the two remainders of two samples each can come
    finally:
        held.release.set()
        c.drain(60)
        c.close()
    assert first.metrics["groups_split"] == 2 and first.metrics["samples_carried"] == 4
    assert sorted((r["group_id"], r["sample_index"]) for r in first.train_rows()) == [
        ("g-a", 0), ("g-a", 1), ("g-b", 0), ("g-b", 1)]
    assert {r["max_policy_version"] for r in first.train_rows()} == {0}
    assert second.metrics["remainder_parts"] == 2 and second.metrics["batch_samples"] == 4
    rows = second.train_rows()
    assert sorted((r["group_id"], r["sample_index"]) for r in rows) == [("g-a", 2), ("g-a", 3), ("g-b", 2),
                                                                         ("g-b", 3)]
    for row in rows:  # held until after the update: every sampled token is version 1's
        assert {v for v, m in zip(row["policy_versions"], row["loss_mask"], strict=True) if m} == {1}
    assert second.metrics["sample_lag_mean"] == 0.0


def test_direct_publication_to_servers_loads_verified_bytes_or_refuses(servers, engine, tiny_model, tmp_path):
    """Replicas pull the trainer's files over HTTP while serving; a manifest mismatch changes nothing anywhere."""
    import torch
    from transformers import AutoModelForCausalLM

    from infra.checkpoint import CheckpointError, file_entries
    from infra.publish import DirectSource
    from infra.train.mismatch import trainer_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(tmp_path / "noisy")
    files = file_entries(tmp_path / "noisy")
    prompt = list(range(5, 60))
    try:
        with DirectSource(tmp_path / "noisy") as source:
            bad = {**files, "model.safetensors": {**files["model.safetensors"], "size": 1}}
            with pytest.raises(CheckpointError, match="does not match the manifest"):
                engine.load_weights_direct(source.url, bad, 5)
            assert set(engine.versions.values()) == {0} and len(engine.router.live) == 2
            timing = engine.load_weights_direct(source.url, files, 6)
        assert timing["transfer_s"] > 0 and timing["pause_s"] > 0
        assert set(engine.versions.values()) == {6}
        replicas = set()
        for i in range(2):  # new trajectories alternate between replicas: both serve the pulled weights
            out = engine.generate([SampleRequest(prompt, 6, 1.0, 1.0, i)], [f"direct-{i}"])[0]
            replicas.add(out.replica)
            assert out.policy_version == 6
            ref = trainer_logprobs(str(tmp_path / "noisy"), [prompt + out.token_ids], "float32")[0][len(prompt) - 1:]
            assert max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)) < 1e-3
        assert replicas == {s.url for s in servers}
    finally:
        engine.load_weights(str(tiny_model), 0)


def test_replica_death_fails_over_and_the_batch_completes(servers, engine, backend, hello_image):
    task, images = hello_image
    c = _collector(engine, backend, images, max_turns=3, infra_policy="retry")
    victim = servers[0]
    try:
        c.submit([("g-a", task), ("g-b", task)])
        deadline = time.monotonic() + 120
        while engine.router.in_flight[victim.url] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        victim.kill()
        batch = c.next_batch(2, timeout_s=300)
    finally:
        c.drain(60)
        c.close()
    assert victim.url in engine.router.dead
    failed = [r for r in batch.rows if r["outcome"] == "infra_failure"]
    assert failed and {r["reason"] for r in failed} == {"engine_unreachable"}
    for row in batch.train_rows():
        assert row["outcome"] != "infra_failure"
    retried = {(r["group_id"], r["sample_index"]) for r in failed}
    for row in batch.train_rows():  # every retried member finished on the surviving replica
        if (row["group_id"], row["sample_index"]) in retried:
            assert row["engine_replica"] == servers[1].url and row["attempt"] >= 1
