"""The engine's batching thread: realtime priority (slots, refusals, the config rule) and its faults."""
import os
import threading

import pytest

from infra.config import ConfigError, InprocEngine, load_config
from infra.rollout.engine import VLLMEngine, realtime_thread
from tests.helpers import may_run_fifo


def _in_thread(fn):
    out = {}

    def go():
        out["result"] = fn()
        out["policy"] = os.sched_getscheduler(0)

    t = threading.Thread(target=go)
    t.start()
    t.join()
    return out


FIFO = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK  # what sched_getscheduler reads back


def _cpus(monkeypatch, n):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


@pytest.mark.skipif(not may_run_fifo(), reason="SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO")
def test_the_thread_runs_fifo_while_a_slot_is_free_and_the_slot_returns_when_closed(monkeypatch, tmp_path):
    _cpus(monkeypatch, 2)  # one slot: a core always stays with the normal threads
    first = _in_thread(lambda: realtime_thread(3, str(tmp_path)))
    slot, said = first["result"]
    assert slot is not None and said == "SCHED_FIFO 3" and first["policy"] == FIFO
    second = _in_thread(lambda: realtime_thread(3, str(tmp_path)))
    assert second["result"][0] is None and second["policy"] == os.SCHED_OTHER
    assert "none of the 1 realtime slots for 2 CPUs is free" in second["result"][1]
    slot.close()
    third = _in_thread(lambda: realtime_thread(3, str(tmp_path)))
    assert third["result"][1] == "SCHED_FIFO 3" and third["policy"] == FIFO
    third["result"][0].close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread was never touched


def test_one_cpu_or_no_permission_leaves_the_thread_normal_and_the_slot_free(monkeypatch, tmp_path):
    _cpus(monkeypatch, 1)
    r = _in_thread(lambda: realtime_thread(1, str(tmp_path)))
    assert r["result"] == (None, "normal (SCHED_FIFO 1 not applied: 1 CPU, the other threads would starve)")
    assert r["policy"] == os.SCHED_OTHER
    _cpus(monkeypatch, 2)

    def refused(pid, policy, param):
        raise PermissionError(1, "Operation not permitted")

    real = os.sched_setscheduler
    monkeypatch.setattr(os, "sched_setscheduler", refused)
    r = _in_thread(lambda: realtime_thread(1, str(tmp_path)))
    assert r["result"][0] is None and "not permitted: Operation not permitted" in r["result"][1]
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, policy, param: None)  # the slot was let go
    slot, said = realtime_thread(1, str(tmp_path))
    assert said == "SCHED_FIFO 1"
    slot.close()
    monkeypatch.setattr(os, "sched_setscheduler", real)


def test_realtime_steps_need_one_engine_thread(tmp_path):
    assert InprocEngine(threads=1, realtime_priority=1).realtime_priority == 1
    p = tmp_path / "bad.toml"
    p.write_text('[engine]\nkind = "inproc"\nrealtime_priority = 1\n')
    with pytest.raises(ConfigError, match=r"engine.realtime_priority = 1 needs engine.threads = 1 \(it is 0\)"):
        load_config(p)
    p.write_text('[engine]\nkind = "inproc"\nthreads = 1\nrealtime_priority = 100\n')
    with pytest.raises(ConfigError, match="realtime_priority"):
        load_config(p)


def test_an_unopenable_slot_leaves_the_thread_normal_and_says_why(monkeypatch, tmp_path):
    _cpus(monkeypatch, 2)
    r = _in_thread(lambda: realtime_thread(1, str(tmp_path / "missing")))
    assert r["result"][0] is None and r["policy"] == os.SCHED_OTHER
    assert "agentrl-realtime-step-0.lock: No such file or directory" in r["result"][1]


def test_the_batching_thread_gives_its_slot_back_however_it_ends(monkeypatch, tmp_path):
    _cpus(monkeypatch, 2)
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, policy, param: None)
    e = object.__new__(VLLMEngine)  # the batching thread's frame only: no model
    e.threads, e.realtime_priority, e.realtime_lock_dir = 0, 1, str(tmp_path)

    def failing_serve():
        held = realtime_thread(1, str(tmp_path))  # held while serving: no slot for another
        assert held[0] is None and "none of the 1 realtime slots for 2 CPUs is free" in held[1]
        raise RuntimeError("a fault outside the step")

    e._serve = failing_serve
    with pytest.raises(RuntimeError, match="outside the step"):
        e._batch_loop()
    assert e.step_thread == "SCHED_FIFO 1"
    slot, said = realtime_thread(1, str(tmp_path))  # free again
    assert said == "SCHED_FIFO 1"
    slot.close()


def test_an_engine_with_realtime_steps_needs_one_thread(tmp_path):
    with pytest.raises(ValueError, match="realtime_priority = 1 needs threads = 1 \\(got 0\\)"):
        VLLMEngine(str(tmp_path), realtime_priority=1)


@pytest.mark.skipif(not may_run_fifo(), reason="SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO")
def test_threads_a_realtime_thread_starts_begin_at_normal_priority(monkeypatch, tmp_path):
    _cpus(monkeypatch, 2)

    def start_one():
        slot, _ = realtime_thread(1, str(tmp_path))
        child = _in_thread(lambda: None)
        slot.close()
        return child["policy"]

    r = _in_thread(start_one)
    assert r["policy"] == FIFO and r["result"] == os.SCHED_OTHER


def test_a_fifo_at_the_slot_path_is_refused_without_blocking(monkeypatch, tmp_path):
    _cpus(monkeypatch, 2)
    os.mkfifo(tmp_path / "agentrl-realtime-step-0.lock")  # opening it blocking would wait for a writer forever
    r = _in_thread(lambda: realtime_thread(1, str(tmp_path)))
    assert r["result"][0] is None and r["policy"] == os.SCHED_OTHER
    assert "agentrl-realtime-step-0.lock: not a regular file" in r["result"][1]


def test_a_sample_that_cannot_be_read_fails_its_call_not_the_batching_thread(tmp_path):
    """A fault turning one output into a sample (the engine record unwritable) reaches that call, and the
    batching thread serves the next call (before, the thread died and every caller waited forever)."""
    from types import SimpleNamespace

    from infra.rollout.engine import _Pending

    class Engine:  # vLLM's LLM as the loop uses it: enqueue, then step until each request finishes
        def __init__(self):
            self.n, self.waiting = 0, []
            self.llm_engine = self

        def enqueue(self, prompts, params, use_tqdm=False):
            ids = [f"{self.n + k}-abcdefgh" for k in range(len(prompts))]
            self.n += len(prompts)
            self.waiting += [i.split("-")[0] for i in ids]
            return ids

        def step(self):
            done, self.waiting = self.waiting, []
            return [SimpleNamespace(request_id=r, finished=True) for r in done]

    e = object.__new__(VLLMEngine)
    e.__dict__.update(llm=Engine(), threads=0, realtime_priority=0, realtime_lock_dir=None,
                      _lock=threading.Lock(), _queue=[], _queue_cv=threading.Condition(), _closed=False,
                      _in_flight=0, _holds=0, continuous_batching=True, policy_version=0, busy_s=0.0, calls=0)
    bad = str(tmp_path / "missing" / "record.jsonl")
    e._sample = lambda out, version, call: open(bad, "a") if call.prompts[0] == "bad" else out.request_id
    e._batcher = threading.Thread(target=e._batch_loop, daemon=True)
    e._batcher.start()
    calls = [_Pending(["bad", "x"], [None, None]), _Pending(["ok"], [None])]
    for c in calls:
        with e._queue_cv:
            e._queue.append(c)
            e._queue_cv.notify()
        assert c.done.wait(10), "the call was never answered"
    assert isinstance(calls[0].error, FileNotFoundError)
    assert calls[1].error is None and calls[1].samples == ["2"] and e._batcher.is_alive()
    with e._queue_cv:
        e._closed = True
        e._queue_cv.notify_all()
    e._batcher.join(10)
