"""Our rollout path against the bare engine: same engine, prompts, sampling parameters and concurrency.

(b) **Our path**: one step of a run's rollouts collected for real, as ``post_train``'s step 0 collects
them (``tasks.rollouts._collect_async``: the config's tasks, chosen by ``select_tasks``, its group size,
sampling, scheduler and in-process engine; episodes in Docker sandboxes, verifiers scoring them).
Every engine request is recorded (prompt ids, sampling parameters, sampled length), with how many were
in flight at once. The engine counts its generated tokens and the seconds it spent in engine steps.

(a) **Bare engine**: the same vLLM ``LLM`` object, right after (b), driven directly (``LLM.enqueue`` and
``LLMEngine.step``, vLLM's own offline loop) with (b)'s recorded requests, each held to its recorded
length (``max_tokens`` = its sampled length, ``ignore_eos``) and with (b)'s sampling parameters and
``logprobs=0``, keeping ``C`` requests in flight, ``C`` = the most (b) ever had in flight. Nothing else
runs: no sandboxes, no tools, no harness.

(a') **Bare engine, turn order kept**: the same replay, but an episode's request for turn k+1 is enqueued
only when its turn k finishes (no tool time between them), every episode starting at once. (b)'s
requests cannot all be in flight together: a turn waits for the one before it. (a) against (a') is what
the episodes' own turn structure costs the engine; (b) against (a') is what our path adds to that
(sandboxes, tools, verification, the harness and Python in the engine's process).

Reported: generated tokens/s while busy for (a), (a') and (b), the ratios (b)/(a) (target >= 0.9) and
(b)/(a'), (b)'s idle fraction (wall time with no engine step running), the mean requests in flight during
(b), and where an episode's wall time went (``episode_s`` split into sandbox acquire, engine queue, prefill, decode, the
rest of generation (tokenization, the gateway), tool execution, verification and harness/Python
overhead, the remainder). The split is printed and drawn as a PNG (``--plot``). For (b) and each replay, the
engine thread's step time is split into on a core, waiting for one, and asleep (:class:`StepClock`).

``make bench-rollout`` (``python -m benchmarks.rollout_path --config configs/quickstart.toml``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from infra.rollout.engine import own_thread_count
from infra.summary import EPISODE_PARTS as PARTS
from infra.summary import episode_time_split

RESULTS = Path(__file__).resolve().parent / "results"


class RequestRecorder:
    """Wraps an engine's ``generate``: records each request with its sampled length and the peak in flight."""

    def __init__(self, engine):
        self.engine, self._generate = engine, engine.generate
        self.requests: list[tuple[object, int]] = []
        self.trajectories: list[str] = []  # each recorded request's trajectory (episode) id
        self.in_flight = self.peak = 0
        self._lock = threading.Lock()
        engine.generate = self

    def __call__(self, requests, trajectory_ids=None):
        """The engine's ``generate``, recorded."""
        with self._lock:
            self.in_flight += len(requests)
            self.peak = max(self.peak, self.in_flight)
        try:
            samples = self._generate(requests, trajectory_ids)
        finally:
            with self._lock:
                self.in_flight -= len(requests)
        with self._lock:
            self.requests += [(r, len(s.token_ids)) for r, s in zip(requests, samples, strict=True)]
            self.trajectories += list(trajectory_ids or [f"request-{len(self.trajectories) + i}"
                                                         for i in range(len(requests))])
        return samples

    def detach(self) -> None:
        """Give the engine its own ``generate`` back."""
        self.engine.generate = self._generate


class StepClock:
    """Splits the wall time of the engine's steps (``llm_engine.step``) into running, waiting for a core, and the rest.

    Around each step it reads the calling thread's CPU time (``time.thread_time``) and its run-queue delay
    (``/proc/thread-self/schedstat``'s second field, Linux: nanoseconds runnable but not running; its first field,
    CPU time, is not refreshed on a read and can lag a scheduler tick). What is left of the step's wall time is
    time the thread slept: in the engine, waiting for the interpreter lock (the process's other threads hold it)
    or for anything else it blocks on. :meth:`take` returns the seconds of each since the last take.
    """

    def __init__(self, llm_engine):
        self.llm_engine, self._step = llm_engine, llm_engine.step
        self.wall_s = self.cpu_s = self.run_queue_s = 0.0
        llm_engine.step = self

    @staticmethod
    def _read() -> tuple[float, float]:
        with open("/proc/thread-self/schedstat") as f:
            _, wait_ns, _ = f.read().split()
        return time.thread_time(), int(wait_ns) / 1e9

    def __call__(self, *args, **kwargs):
        """The engine's ``step``, timed."""
        cpu0, wait0 = self._read()
        t0 = time.monotonic()
        try:
            return self._step(*args, **kwargs)
        finally:
            self.wall_s += time.monotonic() - t0
            cpu1, wait1 = self._read()
            self.cpu_s += cpu1 - cpu0
            self.run_queue_s += wait1 - wait0

    def take(self) -> dict:
        """Seconds of step wall time since the last take: running, on a run queue, and the rest (asleep)."""
        out = {"step_wall_s": self.wall_s, "on_cpu_s": self.cpu_s, "run_queue_s": self.run_queue_s,
               "asleep_s": max(0.0, self.wall_s - self.cpu_s - self.run_queue_s)}
        self.wall_s = self.cpu_s = self.run_queue_s = 0.0
        return out

    def detach(self) -> None:
        """Give the engine its own ``step`` back."""
        self.llm_engine.step = self._step


def _split(clock: dict) -> str:
    wall = clock["step_wall_s"] or 1.0
    return (f"steps {clock['step_wall_s']:.1f} s: on a core {100 * clock['on_cpu_s'] / wall:.0f}%, waiting for a "
            f"core {100 * clock['run_queue_s'] / wall:.0f}%, asleep {100 * clock['asleep_s'] / wall:.0f}%")


def bare_engine(llm, requests: list[tuple[object, int]], concurrency: int, threads: int = 0,
                trajectories: list[str] | None = None) -> dict:
    """Drive vLLM's ``LLM`` directly with ``requests`` (``SampleRequest``, sampled length), ``concurrency`` in flight.

    With ``trajectories`` (each request's episode id, requests in turn order within an episode), an
    episode's next request is enqueued only when its previous one finishes, and ``concurrency`` is ignored.
    Runs in a thread of its own with the engine's CPU thread count (``threads``, 0: torch's default), as the
    engine's own steps run, at normal priority whatever the engine's (a realtime replay that never sleeps would be
    throttled by the kernel, 5% of each second by default). Returns generated tokens, seconds, tokens/s (the
    engine is busy the whole time) and the mean requests in flight.
    """
    out: dict = {}

    def go():
        if threads:
            own_thread_count(threads)
        out.update(_replay(llm, requests, concurrency, trajectories))

    t = threading.Thread(target=go, name="bare-engine")
    t.start()
    t.join()
    if not out:
        raise RuntimeError("bare engine replay failed (see the traceback above)")
    return out


def _replay(llm, requests: list[tuple[object, int]], concurrency: int,
            trajectories: list[str] | None = None) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    # Without episodes: one queue, ``concurrency`` of it in flight. With them: a queue per episode, its
    # requests in turn order, one in flight (the next turn is enqueued when the one before it finishes).
    queues: dict[str, list] = {}
    for i, (r, n) in enumerate(requests):
        if n > 0:
            queues.setdefault(trajectories[i] if trajectories else "", []).append((r, n))
    limit = 1 if trajectories else concurrency
    engine, tokens, owner, in_flight_s = llm.llm_engine, 0, {}, 0.0

    def refill(queue: str) -> None:
        while queues[queue] and sum(q == queue for q in owner.values()) < limit:
            r, n = queues[queue].pop(0)
            params = SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=n,
                                    min_tokens=n, ignore_eos=True, seed=r.seed, logprobs=0, detokenize=True)
            (request_id,) = llm.enqueue([TokensPrompt(prompt_token_ids=r.prompt_ids)], [params], use_tqdm=False)
            owner[request_id] = queue

    start = last = time.monotonic()
    for queue in queues:
        refill(queue)
    while owner:
        outputs = engine.step()
        now = time.monotonic()
        in_flight_s += len(owner) * (now - last)
        last = now
        for out in outputs:
            if out.finished:
                # enqueue returns the engine's internal id, the external one with a suffix: "32-1a2b3c4d"
                (key,) = [k for k in owner if k == out.request_id or k.startswith(f"{out.request_id}-")]
                queue = owner.pop(key)
                tokens += len(out.outputs[0].token_ids)
                refill(queue)
    seconds = time.monotonic() - start
    return {"generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "mean_in_flight": in_flight_s / seconds}


def plot(breakdown: dict[str, float], path: Path, title: str) -> None:
    """One horizontal stacked bar: the mean episode's wall time by part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.8))
    left = 0.0
    for k in PARTS:
        ax.barh([0], [breakdown[k]], left=left, label=f"{k.removesuffix('_s')} {breakdown[k]:.1f}s")
        left += breakdown[k]
    ax.set_yticks([])
    ax.set_xlabel("seconds (mean episode)")
    ax.set_title(title, fontsize=9)
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.55))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/quickstart.toml")
    p.add_argument("--run-id", default="bench-rollout")
    p.add_argument("--out", default=str(RESULTS / "rollout_path.json"))
    p.add_argument("--plot", default=str(RESULTS / "rollout_path.png"))
    p.add_argument("--batch-at-once", action="store_true",
                   help="the engine admits waiting calls only when none is in flight (its batching before)")
    a = p.parse_args(argv)

    from infra.config import load_config
    from infra.difficulty import select_tasks
    from infra.environments import build_catalog, load_run_tasks
    from infra.model import resolve_model
    from infra.preflight import preflight
    from infra.run import Policy, Run
    from tasks.rollouts import _collect_async

    config = load_config(a.config, run_id=a.run_id)
    run = Run(config, preflight(config))
    try:
        tasks, split, _ = load_run_tasks(config.tasks)
        t0 = time.monotonic()
        ts = config.tasks
        entries, _ = build_catalog(run.backend, tasks, split, validate=False, base_images=ts.base_images,
                                   fallback_base=ts.fallback_base_image or None, build_network=ts.build_network,
                                   registry_mirrors=ts.registry_mirrors)
        images = {e.task_id: (e.image, e.image_digest) for e in entries if e.usable}
        print(f"{len(images)} task images ready in {time.monotonic() - t0:.0f} s", flush=True)
        r, d = config.rollout, config.difficulty
        train = sorted(t for t in images if split.get(t) == "train")
        chosen = select_tasks(train, {}, r.tasks_per_step, d.window, d.hopeless_min_attempts, d.explore_min_attempts,
                              seed=r.seed * 7919, revisit_frac=d.revisit_frac).chosen
        run.serve(Policy(0, str(resolve_model(config.model.path))), lambda: 0.0)
        engine = run.engine
        engine.continuous_batching = not a.batch_at_once
        recorder = RequestRecorder(engine)
        clock = StepClock(engine.llm.llm_engine)
        tokens0, busy0, t0 = engine.generated_tokens, engine.busy_s, time.monotonic()
        rows, _, metrics = _collect_async(run, images, chosen, 0, lambda done, total: None)
        wall, busy = time.monotonic() - t0, engine.busy_s - busy0
        recorder.detach()
        ours_tokens = engine.generated_tokens - tokens0
        ours = {"generated_tokens": ours_tokens, "wall_s": wall, "busy_s": busy,
                "tokens_per_s_busy": ours_tokens / busy, "idle_frac": 1 - busy / wall, "mean_in_flight_busy": 0.0,
                "peak_in_flight": recorder.peak, "requests": len(recorder.requests), "episodes": len(rows),
                "time_to_batch_s": metrics["time_to_batch_s"]}
        # requests in flight while busy: each request's decode+prefill time over the busy time
        engine_s = sum(row["prefill_s"] + row["decode_s"] for row in rows)
        ours["mean_in_flight_busy"] = engine_s / busy if busy else 0.0
        ours["engine_thread"] = clock.take()
        print(f"our path: {len(rows)} episodes, {len(recorder.requests)} requests, {ours_tokens} tokens in "
              f"{wall:.1f} s "
              f"(engine busy {busy:.1f} s): {ours['tokens_per_s_busy']:.1f} tokens/s while busy, idle "
              f"{100 * ours['idle_frac']:.0f}%, peak {recorder.peak} requests in flight", flush=True)
        print(f"  our engine thread ({engine.step_thread})'s {_split(ours['engine_thread'])}", flush=True)
        bare = bare_engine(engine.llm, recorder.requests, max(1, recorder.peak), engine.threads)
        bare["engine_thread"] = clock.take()
        print(f"bare engine: same {len(recorder.requests)} requests, {recorder.peak} in flight: "
              f"{bare['generated_tokens']} tokens in {bare['seconds']:.1f} s = {bare['tokens_per_s']:.1f} tokens/s",
              flush=True)
        turns = bare_engine(engine.llm, recorder.requests, max(1, recorder.peak), engine.threads,
                            trajectories=recorder.trajectories)
        print(f"bare engine, turn order kept ({len(set(recorder.trajectories))} episodes at once, each turn after "
              f"the one before): {turns['tokens_per_s']:.1f} tokens/s, {turns['mean_in_flight']:.1f} requests in "
              f"flight on average", flush=True)
        turns["engine_thread"] = clock.take()
        print(f"  the turn-ordered replay's {_split(turns['engine_thread'])}", flush=True)
        # the same replay beside one busy core: what sharing the 2 cores costs the engine (the machine's share)
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            contended = bare_engine(engine.llm, recorder.requests, max(1, recorder.peak), engine.threads)
        finally:
            burner.kill()
            burner.wait()
            clock.detach()
        contended["engine_thread"] = clock.take()
        print(f"bare engine beside one busy core: {contended['tokens_per_s']:.1f} tokens/s", flush=True)
        breakdown = episode_time_split(rows)
    finally:
        run.close()
    ratio = ours["tokens_per_s_busy"] / bare["tokens_per_s"]
    ratio_turns = ours["tokens_per_s_busy"] / turns["tokens_per_s"]
    print(f"\nratio (ours while busy / bare, turn order kept): {ratio_turns:.2f}  (what our path adds to the episodes' "
          f"own turn structure)")
    print(f"ratio (ours while busy / bare): {ratio:.2f}  (target >= 0.9); against the bare engine beside one busy "
          f"core: {ours['tokens_per_s_busy'] / contended['tokens_per_s']:.2f}")
    mean = breakdown["episode_s"]
    print(f"mean episode {mean:.1f} s: " + ", ".join(
        f"{k.removesuffix('_s')} {breakdown[k]:.1f} ({100 * breakdown[k] / mean:.0f}%)" for k in PARTS))
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"config": a.config, "serving_dtype": config.model.serving_dtype,
              "continuous_batching": not a.batch_at_once, "ours": ours, "bare": bare,
              "bare_beside_busy_core": contended, "ratio_busy": ratio,
              "bare_turn_order_kept": turns, "ratio_busy_vs_turn_order_kept": ratio_turns,
              "ratio_busy_vs_contended": ours["tokens_per_s_busy"] / contended["tokens_per_s"],
              "episode_breakdown_s": breakdown, "engine_threads": engine.threads,
              "engine_step_thread": engine.step_thread,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "")}
    Path(a.out).write_text(json.dumps(result, indent=1))
    if a.plot:
        plot(breakdown, Path(a.plot), f"{a.config}: mean episode {breakdown['episode_s']:.1f} s; engine "
             f"{ours['tokens_per_s_busy']:.0f} tok/s busy vs bare {bare['tokens_per_s']:.0f} (ratio {ratio:.2f})")
        print(f"plot -> {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
