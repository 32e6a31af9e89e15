"""Asynchronous group scheduling for time to a trainable batch.

The measure this module serves is *time to a trainable batch*: from asking for ``n`` complete
groups until they are in hand, straggler tail included. Three mechanisms, and an optional fourth:

- **Ready bank.** Every episode runs on its own worker; a group enters the bank the moment its
  last sibling finishes. :meth:`AsyncCollector.next_batch` takes eligible complete groups in
  completion order, regardless of launch order, so a group launched first but finishing last
  never blocks a batch.
- **Over-provisioning and carry-over.** Up to ``max_groups_in_flight`` groups run at once, and
  the collector keeps launching while the trainer trains; complete groups not taken by this batch
  stay in the bank for the next one, as long as their policy lag is within ``max_policy_lag``
  (older groups are dropped and counted, never trained on).
- **No wedged step.** Every episode has a deadline (``episode_deadline_s``): a member past it is
  cancelled and recorded as ``infra_failure/episode_deadline``. A group with an infra failure is
  handled by ``infra_policy``: ``retry`` relaunches that member (a new attempt, up to
  ``max_infra_retries``, then the group is dropped), ``drop`` drops the group at once.
- **Dynamic sampling** (optional: ``dynamic_sampling=True``; DAPO's, Yu et al. 2025). A group whose
  rewards are all equal has every GRPO advantage 0, so it carries no gradient.
  :meth:`AsyncCollector.next_batch` passes over such *zero-variance* groups and waits for groups
  with signal, drawing on the groups over-provisioning keeps in flight and, given a ``refill``
  callable, on one fresh group submitted per skipped group (DAPO's over-sampling), so over-provisioning
  is not needed; it skips at most ``max_extra_groups`` per batch (dropped as ``zero_variance``, with
  their rows; never trained). Past that bound, or when nothing more can come, they fill the batch,
  so a step is never wedged.
- **Partial groups** (optional: ``partial_group_min_samples = k``). A batch is then counted in
  samples (``n_groups * G``), not groups: when the bank's complete groups fall short, a group in
  flight with at least ``k`` finished samples is split at the moment the batch is taken; its
  finished samples train now as one part (their GRPO baseline from those samples only: advantages
  are computed per group id within a batch), and its running samples are carried as the group's
  remainder, banked and trained as a part of their own when they finish; a remainder of one sample is
  cancelled instead (alone, its advantage is 0: it would hold a sandbox and engine time for no signal).
  A group completes at its
  slowest sibling; on long-tailed agentic episodes that sibling holds the whole group (the idea of
  training on partial groups is prime-rl's; AReaL and slime carry unfinished rollouts instead).

Weight updates (:meth:`AsyncCollector.update_weights`) follow ``update_policy`` for episodes in
flight: ``finish`` stops launching, lets in-flight episodes finish on the old weights, then
applies; ``pause`` applies at once (in-flight episodes pause while the engine reloads and continue
on the new weights; the per-token versions the engine stamps record which version produced which
tokens); ``abort`` cancels in-flight episodes, applies, and relaunches them from scratch.

The collector is engine- and sandbox-agnostic: an :class:`EpisodeRunner` runs one attempt to a
trajectory row. The same code drives real engines and sandboxes
(:class:`infra.rollout.collector.Collector`) and the simulated fleet of ``benchmarks.batch_time``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)

InfraPolicy = Literal["retry", "drop"]
#: Outcomes the trainer leaves out of the gradient (``infra.train.trainer.EXCLUDED_OUTCOMES``; not imported: torch).
UNTRAINED_OUTCOMES = ("infra_failure", "unknown")
UpdatePolicy = Literal["finish", "pause", "abort"]


@dataclass
class EpisodeJob:
    """One attempt of one group member, as handed to the runner.

    ``cancel`` is set when the scheduler gives up on the attempt (deadline, ``abort`` update, group
    dropped); runners check it between turns and return early. ``queued_s``: when it was submitted to
    the workers; ``launched_s``: when a worker started it (0 while queued); both on the collector's clock.
    """

    group_id: str
    task: Any
    sample_index: int
    attempt: int
    seed: int
    launch_index: int
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_s: float = 0.0
    launched_s: float = 0.0


class EpisodeRunner(Protocol):
    """Runs one episode; the scheduler calls it from worker threads."""

    def run(self, job: EpisodeJob) -> dict:
        """Run ``job`` to its end and return its trajectory row.

        The row needs at least ``outcome`` (``infra_failure`` or a model outcome), ``reason``,
        ``min_policy_version`` (-1 when nothing was sampled) and ``max_policy_version``. Raising
        counts as ``infra_failure/harness_error``.
        """
        ...

    def failed_row(self, job: EpisodeJob, reason: str) -> dict:
        """A row for an attempt the scheduler ended (``reason``: ``episode_deadline``, ``harness_error``)."""
        ...


def row_tokens_by_version(row: dict) -> Counter:
    """A row's sampled tokens per policy version.

    From its per-token ``policy_versions`` where ``loss_mask`` is 1 (``infra.store`` rows), or its
    ``tokens_by_version`` (``{version: tokens}``, the simulator's rows); a row with neither counts its
    ``min_policy_version`` once (none when it is -1: nothing sampled).
    """
    counts: Counter = Counter()
    if "tokens_by_version" in row:
        counts.update({int(v): n for v, n in row["tokens_by_version"].items()})
    elif "policy_versions" in row and "loss_mask" in row:
        counts.update(v for v, m in zip(row["policy_versions"], row["loss_mask"], strict=True) if m)
    elif row.get("min_policy_version", -1) >= 0:
        counts[row["min_policy_version"]] += 1
    return counts


@dataclass(frozen=True)
class Attempt:
    """One finished attempt: the runner's row, and beside it the scheduler's timings (collector clock, s)."""

    row: dict
    finished_s: float
    episode_s: float  # launch to finish
    queue_s: float = 0.0  # submitted to launched
    _tokens_by_version: Counter | None = field(default=None, repr=False, compare=False)

    def tokens_by_version(self) -> Counter:
        """:func:`row_tokens_by_version` of the row (cached: a finished row does not change)."""
        if self._tokens_by_version is None:  # frozen: set once, as a cache
            object.__setattr__(self, "_tokens_by_version", row_tokens_by_version(self.row))
        return self._tokens_by_version


@dataclass
class Group:
    """One task's G siblings as they finish. ``attempts`` holds every attempt (retries included)."""

    group_id: str
    task: Any
    launch_index: int
    group_size: int
    launched_s: float
    final: dict[int, Attempt] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    completed_s: float = 0.0
    dropped: str = ""
    part: int = 0  # 0: the whole group, or its first part; k: the k-th part split off (partial groups)
    _tokens_by_version: Counter | None = field(default=None, repr=False, compare=False)

    @property
    def rows(self) -> list[dict]:
        """Every attempt's row, in finishing order."""
        return [a.row for a in self.attempts]

    @property
    def complete(self) -> bool:
        """Every sibling has its final row (non-infra, unless the collector keeps failed members)."""
        return len(self.final) == self.group_size

    @property
    def min_policy_version(self) -> int:
        """Oldest policy version that produced any token of the group's final rows (-1: none sampled)."""
        versions = [a.row["min_policy_version"] for a in self.final.values() if a.row["min_policy_version"] >= 0]
        return min(versions) if versions else -1

    def tokens_by_version(self) -> Counter:
        """Sampled tokens of the final rows per policy version (cached once the group is complete).

        :meth:`Attempt.tokens_by_version` summed over the final attempts.
        """
        if self._tokens_by_version is not None:
            return self._tokens_by_version
        counts: Counter = Counter()
        for attempt in self.final.values():
            counts.update(attempt.tokens_by_version())
        if self.complete:
            self._tokens_by_version = counts
        return counts

    def mean_token_lag(self, current_version: int) -> float:
        """Mean over the final rows' sampled tokens of the versions between each token's and ``current_version``.

        The staleness the trainer's importance ratios see, token-weighted (0.0 if nothing was sampled);
        with episodes that continue across weight updates (``update_policy = "pause"``) it is below the
        lag of the oldest token (:attr:`min_policy_version`).
        """
        counts = self.tokens_by_version()
        total = sum(counts.values())
        return sum(n * (current_version - v) for v, n in counts.items()) / total if total else 0.0

    def final_rows(self) -> list[dict]:
        """The G final rows, by sample index."""
        return [self.final[i].row for i in sorted(self.final)]

    def split(self, now_s: float) -> Group:
        """Split off the finished samples as a complete part, returned; ``self`` becomes the remainder.

        The part keeps the group id, its finished samples' final rows and every attempt of those
        samples; the remainder keeps the running samples (``group_size`` less the finished ones), their
        earlier failed attempts, and ``part + 1``. Sample indices are kept, so seeds and rows stay the
        group's own.

        Raises:
            ValueError: nothing finished, or every sample did (a complete group is not split).
        """
        if not self.final or self.complete:
            raise ValueError(f"group {self.group_id}: split needs some, not all, samples finished "
                             f"({len(self.final)}/{self.group_size})")
        done = set(self.final)
        part = Group(self.group_id, self.task, self.launch_index, len(done), self.launched_s,
                     final=dict(self.final), attempts=[a for a in self.attempts if a.row["sample_index"] in done],
                     completed_s=now_s, part=self.part)
        self.group_size -= len(done)
        self.final, self.part = {}, self.part + 1
        self.attempts = [a for a in self.attempts if a.row["sample_index"] not in done]
        return part

    @property
    def reward_varies(self) -> bool:
        """Whether the group carries GRPO signal: its trained final rows' ``reward`` s are not all equal.

        Trained rows: outcome not in :data:`UNTRAINED_OUTCOMES`, as the trainer selects them; fewer than
        two such rows, or all rewards equal, give every advantage exactly 0 (``group_advantages``).

        Raises:
            ValueError: a trained final row has no ``reward`` (names the group and sample).
        """
        rows = [r for r in self.final_rows() if r["outcome"] not in UNTRAINED_OUTCOMES]
        missing = [r["sample_index"] for r in rows if "reward" not in r]
        if missing:
            raise ValueError(f"group {self.group_id}: dynamic sampling needs each final row's 'reward'; "
                             f"sample(s) {missing} have none")
        return len({r["reward"] for r in rows}) > 1


class ReadyBank:
    """Complete groups waiting for the trainer, in completion order.

    A group is eligible while ``current_version - group.min_policy_version <= max_policy_lag`` and, when
    ``max_mean_token_lag`` is set, its :meth:`Group.mean_token_lag` is at most that; :meth:`take` and
    :meth:`take_with_signal` drop the ones past either bound (counted in ``dropped_stale``). Both lags only
    grow as versions advance, so a group once past a bound never returns.

    The second bound lets episodes that continue across weight updates (partial rollouts, as in AReaL,
    Fu et al. 2025, and slime) train although their first turns are several versions old, while the
    tokens on average stay within ``max_mean_token_lag``; the importance ratio, its truncation (TIS) and
    the divergence rule correct and bound what remains.
    """

    def __init__(self, max_policy_lag: int, max_mean_token_lag: float | None = None):
        """Create an empty bank.

        Args:
            max_policy_lag: largest allowed lag of the oldest token, in policy versions (>= 0).
            max_mean_token_lag: largest allowed token-weighted mean lag (>= 0), or None: no such bound.
        """
        if max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {max_policy_lag}")
        if max_mean_token_lag is not None and max_mean_token_lag < 0:
            raise ValueError(f"max_mean_token_lag must be >= 0 or None, got {max_mean_token_lag}")
        self.max_policy_lag, self.max_mean_token_lag = max_policy_lag, max_mean_token_lag
        self._groups: list[Group] = []
        self.dropped_stale: list[Group] = []

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: Group) -> None:
        """Add a complete group (raises ``ValueError`` for an incomplete one)."""
        if not group.complete:
            raise ValueError(f"group {group.group_id} is not complete ({len(group.final)}/{group.group_size})")
        self._groups.append(group)

    def lag(self, group: Group, current_version: int) -> int:
        """Policy lag of a group: versions between its oldest token and ``current_version`` (0 if none sampled)."""
        return 0 if group.min_policy_version < 0 else current_version - group.min_policy_version

    def within(self, group: Group, current_version: int) -> bool:
        """Whether ``group`` is within both lag bounds at ``current_version``."""
        return self.lag(group, current_version) <= self.max_policy_lag and (
            self.max_mean_token_lag is None or group.mean_token_lag(current_version) <= self.max_mean_token_lag)

    def expire(self, current_version: int) -> list[Group]:
        """Remove and return the groups past either lag bound."""
        stale = [g for g in self._groups if not self.within(g, current_version)]
        if stale:
            self._groups = [g for g in self._groups if g not in stale]
            for g in stale:
                g.dropped = "stale"
            self.dropped_stale += stale
        return stale

    def eligible(self, current_version: int) -> int:
        """Number of groups :meth:`take` could return now."""
        return len(self.eligible_groups(current_version))

    def eligible_groups(self, current_version: int) -> list[Group]:
        """The banked groups within the lag bound, in completion order (left in the bank)."""
        return [g for g in self._groups if self.within(g, current_version)]

    def take(self, n: int, current_version: int, in_launch_order: bool = False) -> list[Group]:
        """Remove and return up to ``n`` eligible groups, first completed first.

        ``in_launch_order=True`` (the naive baseline) returns groups by launch index instead.
        """
        self.expire(current_version)
        pool = sorted(self._groups, key=lambda g: g.launch_index) if in_launch_order else list(self._groups)
        taken = pool[:n]
        self._groups = [g for g in self._groups if g not in taken]
        return taken

    def take_samples(self, n_samples: int, current_version: int) -> list[Group]:
        """Remove and return eligible groups, first completed first, until they hold ``n_samples`` final rows.

        Fewer when the bank holds fewer; the last group taken may overshoot (groups are not cut here).
        Stale groups are dropped first, as in :meth:`take`.
        """
        self.expire(current_version)
        taken, rows = [], 0
        for g in self._groups:
            if rows >= n_samples:
                break
            taken.append(g)
            rows += len(g.final)
        self._groups = [g for g in self._groups if g not in taken]
        return taken

    def eligible_samples(self, current_version: int) -> int:
        """Final rows of the eligible banked groups."""
        return sum(len(g.final) for g in self.eligible_groups(current_version))

    def usable(self, current_version: int, max_skip: int) -> int:
        """Groups :meth:`take_with_signal` would put in a batch now if ``n`` were unbounded.

        Eligible groups with signal, plus the zero-variance ones beyond the ``max_skip`` it would skip.
        """
        eligible = self.eligible_groups(current_version)
        signal = sum(g.reward_varies for g in eligible)
        return signal + max(0, len(eligible) - signal - max_skip)

    def skip_candidates(self, current_version: int, max_skip: int, in_launch_order: bool = False) -> list[Group]:
        """The eligible zero-variance groups :meth:`take_with_signal` would skip first, at most ``max_skip``.

        In its order (completion order, launch order with ``in_launch_order``); left in the bank. A group
        listed here is only skipped if the batch does not need it to fill up.

        Raises:
            ValueError: an eligible group's final row has no ``reward``.
        """
        pool = self.eligible_groups(current_version)
        if in_launch_order:
            pool.sort(key=lambda g: g.launch_index)
        return [g for g in pool if not g.reward_varies][:max_skip]

    def take_with_signal(self, n: int, current_version: int, max_skip: int,
                         in_launch_order: bool = False) -> tuple[list[Group], list[Group]]:
        """Remove and return ``(batch, skipped)`` for dynamic sampling (DAPO, Yu et al. 2025).

        The batch is up to ``n`` eligible groups, those with signal (:attr:`Group.reward_varies`) first;
        ``fill = min(n - signal, zero)`` zero-variance groups complete it when too few have signal. Of
        the other zero-variance groups, the first ``min(max_skip, zero - fill)`` are skipped (marked
        ``dropped = "zero_variance"``); the rest stay banked. Both lists in completion order (launch
        order with ``in_launch_order``), stale groups dropped first as in :meth:`take`.

        Raises:
            ValueError: an eligible group's final row has no ``reward``.
        """
        self.expire(current_version)
        pool = sorted(self._groups, key=lambda g: g.launch_index) if in_launch_order else list(self._groups)
        signal = [g for g in pool if g.reward_varies]
        zero = [g for g in pool if not g.reward_varies]
        fill = min(max(0, n - len(signal)), len(zero))
        n_skip = min(max_skip, len(zero) - fill)
        skipped, chosen = zero[:n_skip], set(map(id, signal[:n] + zero[n_skip:n_skip + fill]))
        taken = [g for g in pool if id(g) in chosen]
        for g in skipped:
            g.dropped = "zero_variance"
        gone = chosen | set(map(id, skipped))
        self._groups = [g for g in self._groups if id(g) not in gone]
        return taken, skipped


@dataclass
class BatchResult:
    """What :meth:`AsyncCollector.next_batch` returns.

    Attributes:
        groups: the complete groups of the batch (``len == n``), each with its G final rows; with partial
            groups, parts of groups (``group.part``, fewer rows) until the rows reach ``n * G``.
        rows: every attempt of the batch's groups (retried infra failures included): what the
            step's trajectory file records.
        dropped: groups dropped since the previous batch (``group.dropped`` says why: ``stale``,
            ``infra_failure:<reason>``, ``zero_variance``, skipped by dynamic sampling, or ``lone_remainder``,
            a cancelled one-sample remainder with earlier failed attempts), with the
            attempts they had; never trained on (not in ``rows``: the caller stores them apart).
        metrics: per-batch scheduling figures (see :meth:`AsyncCollector.next_batch`).
    """

    groups: list[Group]
    rows: list[dict]
    dropped: list[Group]
    metrics: dict[str, float]

    @property
    def attempts(self) -> list[Attempt]:
        """Every attempt of the batch's groups with its timings, group by group (``rows`` in the same order)."""
        return [a for g in self.groups for a in g.attempts]

    def train_rows(self) -> list[dict]:
        """The batch's final rows, group by group."""
        return [r for g in self.groups for r in g.final_rows()]


def _dropped_stale_metrics(stale: list[Group]) -> dict[str, float]:
    """What stale-dropping cut since the previous batch (finished samples only).

    ``dropped_stale_samples``, and ``dropped_stale_reward_mean`` when any has a reward: beside the batch's
    reward mean it shows whether the lag rules select against long episodes (which end late), a biased
    gradient when length and reward correlate.
    """
    done = [r for g in stale for r in g.rows if r["outcome"] != "infra_failure"]
    rewards = [r["reward"] for r in done if "reward" in r]
    out = {"dropped_stale_samples": float(len(done))}
    if rewards:
        out["dropped_stale_reward_mean"] = sum(rewards) / len(rewards)
    return out


class AsyncCollector:
    """Keeps groups in flight on a worker pool and hands out complete groups from a ready bank."""

    def __init__(self, runner: EpisodeRunner, *, group_size: int, max_groups_in_flight: int,
                 max_concurrent_episodes: int, max_policy_lag: int = 1, episode_deadline_s: float = 600.0,
                 infra_policy: InfraPolicy = "retry", max_infra_retries: int = 1,
                 update_policy: UpdatePolicy = "pause", in_launch_order: bool = False, prefetch: bool = True,
                 policy_version: int = 0, seed: int = 0, clock: Callable[[], float] = time.monotonic,
                 first_launch_index: int = 0, retry_backoff_s: float = 0.0, keep_failed_members: bool = False,
                 dynamic_sampling: bool = False, max_extra_groups: int = 0,
                 max_mean_token_lag: float | None = None, partial_group_min_samples: int = 0):
        """Create a collector; nothing runs until groups are submitted.

        Args:
            runner: runs one attempt to a row.
            group_size: G, siblings per group.
            max_groups_in_flight: K, groups launched and not yet complete (over-provisioning bound).
            max_concurrent_episodes: worker threads (episodes running at once).
            max_policy_lag: groups whose oldest token is more versions behind are never handed out.
            max_mean_token_lag: nor those whose sampled tokens are on average more versions behind
                (:class:`ReadyBank`); None: no such bound.
            episode_deadline_s: wall-clock limit per attempt; past it the attempt is infra_failure.
            infra_policy: ``retry`` the failed member or ``drop`` the group.
            max_infra_retries: retries per member under ``retry`` before the group is dropped.
            update_policy: what in-flight episodes do when weights change (see module docstring).
            in_launch_order: hand out groups by launch order (naive baseline) instead of completion order.
            prefetch: keep launching between batches (while the trainer trains); False launches only
                while :meth:`next_batch` waits (up to K groups in flight either way).
            policy_version: version of the weights the engines serve now.
            seed: base of the per-attempt seeds.
            clock: monotonic clock (seconds).
            first_launch_index: launch index of the first group (attempt seeds derive from it), for groups
                of one batch collected by several collectors (one group per fan-out worker).
            retry_backoff_s: retry ``a`` of a member starts ``retry_backoff_s * 2**(a-1)`` s after the failure
                (0: at once), so an outage (a sandbox engine restarting) is not met with instant retries.
            keep_failed_members: a member out of retries ends with its failed attempt and its siblings run on
                (a one-shot batch keeps every row: evaluation, sync mode); False drops the group (training).
            dynamic_sampling: :meth:`next_batch` waits for groups with reward signal, skipping zero-variance
                ones (module docstring); rows need a ``reward``. :meth:`run_all` is unaffected.
            max_extra_groups: zero-variance groups skipped per batch at most (>= 0); past it they fill the batch.
                Also the most fresh groups one :meth:`next_batch` submits through its ``refill``.
            partial_group_min_samples: 0 (off), or ``k`` in ``[2, G)``: batches count samples and a group with
                ``k`` finished samples may train them while the rest are carried (module docstring). Not
                with ``dynamic_sampling`` or ``in_launch_order``.

        Raises:
            ValueError: a size or policy out of range.
        """
        if group_size < 1 or max_groups_in_flight < 1 or max_concurrent_episodes < 1:
            raise ValueError("group_size, max_groups_in_flight and max_concurrent_episodes must be >= 1")
        if infra_policy not in ("retry", "drop") or update_policy not in ("finish", "pause", "abort"):
            raise ValueError(f"infra_policy {infra_policy!r} / update_policy {update_policy!r} unknown")
        if episode_deadline_s <= 0:
            raise ValueError(f"episode_deadline_s must be > 0, got {episode_deadline_s}")
        if max_extra_groups < 0:
            raise ValueError(f"max_extra_groups must be >= 0, got {max_extra_groups}")
        if partial_group_min_samples and not 2 <= partial_group_min_samples < group_size:
            raise ValueError(f"partial_group_min_samples must be 0 or in [2, group_size={group_size}), "
                             f"got {partial_group_min_samples}")
        if partial_group_min_samples and (dynamic_sampling or in_launch_order):
            raise ValueError("partial_group_min_samples does not combine with dynamic_sampling or in_launch_order")
        self.partial_k = partial_group_min_samples
        self.runner, self.G, self.K = runner, group_size, max_groups_in_flight
        self.deadline_s, self.infra_policy, self.max_retries = episode_deadline_s, infra_policy, max_infra_retries
        self.update_policy, self.in_launch_order, self.prefetch = update_policy, in_launch_order, prefetch
        self.policy_version, self.seed, self.clock = policy_version, seed, clock
        self.bank = ReadyBank(max_policy_lag, max_mean_token_lag)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent_episodes, thread_name_prefix="episode")
        self._events: queue.Queue = queue.Queue()
        self._pending: list[tuple[str, Any]] = []  # (group_id, task) not yet launched
        self._groups: dict[str, Group] = {}  # launched, not complete, not dropped
        self._running: dict[int, EpisodeJob] = {}  # id(job) -> job
        self._launched = first_launch_index
        self.retry_backoff_s = retry_backoff_s
        self.keep_failed_members = keep_failed_members
        self.dynamic_sampling, self.max_extra_groups = dynamic_sampling, max_extra_groups
        self._delayed: list[tuple[float, Group, int, int]] = []  # (due on the clock, group, sample index, attempt)
        self._launching = True
        self._wanted = 0  # groups the current request still needs (prefetch=False bound)
        self._dropped: list[Group] = []  # dropped for infra since the last batch
        self._stale_seen = 0  # bank.dropped_stale already reported
        self.counters: Counter = Counter()
        self._counters_reported: Counter = Counter()  # the counters when the previous batch was handed out
        self._closed = False
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._pump = threading.Thread(target=self._pump_events, name="scheduler", daemon=True)
        self._pump.start()

    # -- public --------------------------------------------------------------------------
    def submit(self, tasks: list[tuple[str, Any]]) -> None:
        """Queue groups to launch, as ``(group_id, task)``; they start as capacity allows."""
        with self._lock:
            self._pending += tasks
            self._launch()

    def room(self) -> int:
        """Groups that may be submitted now: the in-flight bound less those pending, running or banked.

        Only eligible banked groups count (stale ones never train). With partial groups, parts in flight
        or banked count as their share of G.
        """
        with self._lock:
            banked = (self.bank.eligible_samples(self.policy_version) / self.G if self.partial_k
                      else self.bank.eligible(self.policy_version))
            return max(0, self.K - (len(self._pending) + math.ceil(self._in_flight_weight() + banked)))

    @property
    def in_flight(self) -> int:
        """Groups launched and not yet complete or dropped."""
        return len(self._groups)

    @property
    def pending(self) -> int:
        """Groups submitted and not yet launched."""
        return len(self._pending)

    def next_batch(self, n_groups: int, timeout_s: float | None = None,
                   on_progress: Callable[[int, int], None] | None = None,
                   refill: Callable[[Group], tuple[str, Any] | None] | None = None) -> BatchResult:
        """Wait until ``n_groups`` eligible complete groups are ready and return them.

        Metrics: ``time_to_batch_s`` (call to return), ``episode_s_p50/p90/max`` (batch rows'
        launch-to-finish), ``straggler_tail_s`` (from the moment 90% of the batch's episodes had
        finished to the last one), ``groups_carried_in`` (batch groups complete before the call),
        ``groups_in_bank`` (left for the next batch), ``dropped_stale``, ``dropped_infra``,
        ``deadline_cancels``, ``infra_retries``, ``lag_hist_<k>`` (batch groups by policy lag),
        ``sample_lag_mean`` and ``sample_lag_max`` (versions behind of the batch's sampled tokens,
        token-weighted mean and max), ``batch_samples`` (final rows handed out).
        With ``partial_group_min_samples``: the batch is ``n_groups * G`` samples or a few more (parts of
        groups count by their rows), and ``groups_split`` (groups split at this call),
        ``samples_carried`` (their samples still running, carried), ``remainders_cancelled`` (splits that
        left one running sample: cancelled, as a part of one has no signal) and ``remainder_parts`` (parts
        of the batch that were carried before) are recorded.
        ``on_progress(ready, n)`` is called (without the scheduler's lock) when the count of ready
        groups changes.

        When every submitted group has finished or been dropped and fewer than ``n_groups`` are
        eligible, the batch is short (logged, counted in ``short_batches``) rather than failed.

        With ``dynamic_sampling`` a group counts as ready when it has reward signal, or when it is a
        zero-variance group beyond the ``max_extra_groups`` this batch may skip; when nothing more can
        come, zero-variance groups fill the batch as well (:meth:`ReadyBank.take_with_signal`). Skipped
        groups are in ``dropped`` as ``zero_variance``. Four more metrics then:
        ``groups_skipped_zero_variance``, ``groups_filled_zero_variance`` (zero-variance groups in the
        batch), ``groups_refilled`` (fresh groups submitted through ``refill``, below) and
        ``zero_variance_wait_s``: return time less the moment the ``n_groups``-th eligible group of
        this call (banked at the call counting as complete then) was complete, i.e. the wait a batch
        taking any groups in completion order would not have had (0 if it was not longer).

        ``refill`` (dynamic sampling only; ignored, never called, without it): while the batch waits,
        each banked zero-variance group this batch would skip (:meth:`ReadyBank.skip_candidates`)
        gets one fresh group in its place: ``refill(that group)`` returns the ``(group_id, task)`` to
        submit, or None when there is nothing more (then it is not called again this batch). At most
        ``max_extra_groups`` per call, and only while pending, running and eligible banked groups,
        less those skip candidates (they never train), number fewer than ``max_groups_in_flight``:
        the bound :meth:`room` applies, so a refill launches at once. It is called without the
        scheduler's lock. Refills still in flight when the batch is returned run on and carry over
        like any surplus group. A zero-variance group refilled for may still fill the batch when
        nothing more can come, so ``groups_refilled`` can exceed ``groups_skipped_zero_variance``.

        Raises:
            TimeoutError: not enough groups within ``timeout_s`` (nothing is lost: groups stay banked).
            RuntimeError: nothing is pending or in flight and no group is eligible (the message lists
                the dropped groups and their attempts' reasons).
            ValueError: ``dynamic_sampling`` and a final row without ``reward`` (nothing is lost), or
                ``refill`` returned a group id already pending or in flight.
        """
        start = self.clock()
        with self._changed:
            try:
                counters0 = self._counters_reported
                self.bank.expire(self.policy_version)
                carried_in = self.bank.eligible(self.policy_version)
                self._wanted = n_groups
                need = n_groups * self.G if self.partial_k else n_groups
                self._launch()
                reported = -1
                draw = refill if self.dynamic_sampling else None
                asked_for: list[Group] = []  # zero-variance groups refill was called for, in order
                refilled = 0  # fresh groups submitted
                while (ready := self._ready()) < need:
                    if draw is not None and (owed := self._owed_refill(asked_for)) is not None:
                        asked_for.append(owed)
                        fresh = self._unlocked(draw, owed)
                        if fresh is None:
                            draw = None  # nothing more: wait, then fill, as without refills
                        else:
                            self._submit_refill(fresh)
                            refilled += 1
                        continue  # the state may have changed while the callback ran: look again
                    if on_progress is not None and ready != reported:
                        reported = ready
                        self._unlocked(on_progress, ready, need)
                        continue  # the state may have changed while the callback ran: look again
                    if not self._groups and not self._pending:  # nothing more can come: a short batch, or none
                        eligible = (self.bank.eligible_samples(self.policy_version) if self.partial_k
                                    else self.bank.eligible(self.policy_version))
                        if eligible >= need:  # dynamic sampling: zero-variance groups fill the batch
                            break
                        why = "; ".join(f"{g.group_id}: {g.dropped} ({[r['reason'] for r in g.rows]})"
                                        for g in self._dropped) or "none dropped"
                        if eligible == 0:
                            raise RuntimeError(f"batch of {n_groups} groups impossible: none eligible, nothing "
                                               f"pending or in flight; dropped groups: {why}")
                        log.warning("short batch: %d of %d %s (nothing pending or in flight); dropped: %s",
                                    eligible, need, "samples" if self.partial_k else "groups", why)
                        self.counters["short_batches"] += 1
                        break
                    if timeout_s is not None and self.clock() - start > timeout_s:
                        raise TimeoutError(f"{ready}/{need} {'samples' if self.partial_k else 'groups'} "
                                           f"after {timeout_s} s")
                    self._changed.wait(timeout=0.5)
                skipped: list[Group] = []
                split = carried = lone = 0
                if self.partial_k:
                    groups = self.bank.take_samples(need, self.policy_version)
                    have = sum(len(g.final) for g in groups)
                    for g in self._split_candidates():
                        if have >= need:
                            break
                        groups.append(g.split(self.clock()))
                        have += len(groups[-1].final)
                        split += 1
                        if g.group_size == 1:
                            g.dropped = "lone_remainder"
                            self._cancel(g)
                            if g.attempts:  # its earlier failed attempts: recorded with the dropped groups
                                self._dropped.append(g)
                            lone += 1
                        else:
                            carried += g.group_size
                elif self.dynamic_sampling:
                    groups, skipped = self.bank.take_with_signal(n_groups, self.policy_version,
                                                                 self.max_extra_groups, self.in_launch_order)
                else:
                    groups = self.bank.take(n_groups, self.policy_version, self.in_launch_order)
            finally:
                self._wanted = 0
            end = self.clock()
            self._launch()
            stale = self.bank.dropped_stale
            dropped = self._dropped + stale + skipped
            self._dropped, self.bank.dropped_stale = [], []
            self.counters["dropped_stale"] += len(stale)
            self.counters["skipped_zero_variance"] += len(skipped)
            self.counters["refilled"] += refilled
            self._counters_reported = Counter(self.counters)
            rows = [r for g in groups for r in g.rows]
            metrics = self._metrics(groups, start, end, min(carried_in, n_groups), counters0)
            metrics.update(_dropped_stale_metrics(stale))
            if self.partial_k:
                metrics.update(groups_split=split, samples_carried=carried, remainders_cancelled=lone,
                               remainder_parts=sum(g.part > 0 for g in groups))
            if self.dynamic_sampling:
                metrics.update(self._zero_variance_metrics(n_groups, groups, skipped, start, end))
                metrics["groups_refilled"] = refilled
            return BatchResult(groups, rows, dropped, metrics)

    def run_all(self, on_progress: Callable[[int, int], None] | None = None) -> BatchResult:
        """Run every submitted group to its end (complete, or dropped after its retries) and return them all.

        A one-shot batch (sync mode, evaluation): ``rows`` holds every attempt of every group, dropped
        ones included; ``groups`` the complete ones, in launch order; metrics as :meth:`next_batch`.
        ``on_progress(finished groups, groups)`` is called as groups finish.
        """
        start = self.clock()
        with self._changed:
            counters0 = Counter(self.counters)
            total = len(self._pending) + len(self._groups)
            self._wanted = total
            self._launch()
            reported = -1
            while self._groups or self._pending:
                finished = total - len(self._groups) - len(self._pending)
                if on_progress is not None and finished != reported:
                    reported = finished
                    self._unlocked(on_progress, finished, total)
                    continue
                self._changed.wait(timeout=0.5)
            self._wanted = 0
            groups = self.bank.take(len(self.bank), self.policy_version, in_launch_order=True)
            dropped, self._dropped = self._dropped + self.bank.dropped_stale, []
            self.bank.dropped_stale = []
            rows = [r for g in groups + dropped for r in g.rows]
            result = BatchResult(groups, rows, dropped, self._metrics(groups, start, self.clock(), 0, counters0))
            self._counters_reported = Counter(self.counters)
        if on_progress is not None:
            on_progress(total, total)
        return result

    def update_weights(self, apply: Callable[[], Any], version: int) -> float:
        """Change the policy version, applying ``apply()`` (which loads the weights) per ``update_policy``.

        Returns the time in seconds the collector waited for in-flight episodes (``finish``) plus
        the time ``apply`` took.
        """
        start = self.clock()
        with self._changed:
            aborted: list[EpisodeJob] = []
            try:
                if self.update_policy == "finish":
                    self._launching = False
                    while self._running:
                        self._changed.wait(timeout=0.5)
                elif self.update_policy == "abort":
                    self._launching = False
                    aborted = [j for j in self._running.values() if j.launched_s]  # queued ones just wait
                    for job in aborted:
                        job.cancel.set()
                        self._running.pop(id(job), None)
                    self.counters["aborted_for_update"] += len(aborted)
                self._drain_events()  # results that arrived meanwhile are not deadline victims
                apply()  # raises: the version stays, launching resumes, aborted attempts are relaunched
                self.policy_version = version
            finally:
                self._launching = True
                for job in aborted:
                    if job.group_id in self._groups:
                        self._start(self._groups[job.group_id], job.sample_index, job.attempt)
                self.bank.expire(self.policy_version)
                self._launch()
                self._changed.notify_all()
        return self.clock() - start

    def drain(self, timeout_s: float = 60.0) -> None:
        """Process events until no episode runs or waits for its retry (or ``timeout_s``); stops launching."""
        end = self.clock() + timeout_s
        with self._changed:
            self._launching = False
            while (self._running or self._delayed) and self.clock() < end:
                self._changed.wait(timeout=min(0.5, max(0.001, end - self.clock())))

    def close(self) -> None:
        """Cancel everything in flight and stop the workers (does not wait for stuck runners)."""
        with self._lock:
            self._closed = True
            self._launching = False
            for job in self._running.values():
                job.cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pump.join(timeout=5)

    # -- internals -----------------------------------------------------------------------
    def _in_flight_weight(self) -> float:
        """Groups in flight, a carried remainder counting as its share of G (the over-provisioning bound)."""
        return sum(g.group_size for g in self._groups.values()) / self.G

    def _split_candidates(self) -> list[Group]:
        """In-flight groups whose finished samples may train now, most finished first, then by launch.

        At least ``partial_group_min_samples`` finished, within the bank's lag bounds.
        """
        found = [g for g in self._groups.values()
                 if len(g.final) >= self.partial_k and self.bank.within(g, self.policy_version)]
        return sorted(found, key=lambda g: (-len(g.final), g.launch_index))

    def _ready(self) -> int:
        """Banked groups (samples, with partial groups) the batch asked for can use now (:meth:`next_batch`)."""
        if self.partial_k:
            return self.bank.eligible_samples(self.policy_version) + sum(len(g.final) for g in self._split_candidates())
        if self.dynamic_sampling:
            return self.bank.usable(self.policy_version, self.max_extra_groups)
        return self.bank.eligible(self.policy_version)

    def _owed_refill(self, asked_for: list[Group]) -> Group | None:
        """The first skip candidate of this batch no refill was asked for yet, if a refill may go now.

        None when ``max_extra_groups`` refills were asked for, or when submitting one would break the
        :meth:`room` bound (pending, running and eligible banked groups, skip candidates not counted).
        """
        if len(asked_for) >= self.max_extra_groups:
            return None
        candidates = self.bank.skip_candidates(self.policy_version, self.max_extra_groups, self.in_launch_order)
        held = len(self._pending) + len(self._groups) + self.bank.eligible(self.policy_version) - len(candidates)
        if held >= self.K:
            return None
        asked = set(map(id, asked_for))
        return next((g for g in candidates if id(g) not in asked), None)

    def _submit_refill(self, fresh: tuple[str, Any]) -> None:
        """Queue and launch one refill group (``ValueError`` if its id is already pending or in flight)."""
        group_id = fresh[0]
        if group_id in self._groups or any(gid == group_id for gid, _ in self._pending):
            raise ValueError(f"refill returned group id {group_id!r}, already pending or in flight")
        self._pending.append(fresh)
        self._launch()

    def _zero_variance_metrics(self, n: int, groups: list[Group], skipped: list[Group], start: float,
                               end: float) -> dict[str, float]:
        """Dynamic sampling's figures of one batch (defined in :meth:`next_batch`)."""
        seen = groups + skipped + self.bank.eligible_groups(self.policy_version)  # those left banked too
        done = sorted(max(g.completed_s, start) for g in seen)
        wait_s = max(0.0, end - done[n - 1]) if len(done) >= n else 0.0  # short either way: no wait to blame
        return {"groups_skipped_zero_variance": len(skipped),
                "groups_filled_zero_variance": sum(not g.reward_varies for g in groups),
                "zero_variance_wait_s": wait_s}

    def _launch(self) -> None:
        if not self._launching or self._closed:
            return
        if not self.prefetch and self._wanted == 0:  # launch only while a batch is being asked for
            return
        while self._pending and self._in_flight_weight() + 1 <= self.K:  # a new group weighs 1
            group_id, task = self._pending.pop(0)
            g = Group(group_id, task, self._launched, self.G, self.clock())
            self._launched += 1
            self._groups[group_id] = g
            for i in range(self.G):
                self._start(g, i, 0)

    def _start(self, g: Group, sample_index: int, attempt: int) -> None:
        seed = (self.seed * 1_000_003 + g.launch_index * 101 + sample_index * 7 + attempt * 7919) % (2**31)
        if self._closed:
            return
        job = EpisodeJob(g.group_id, g.task, sample_index, attempt, seed, g.launch_index, queued_s=self.clock())
        self._running[id(job)] = job
        self._pool.submit(self._work, job)

    def _work(self, job: EpisodeJob) -> None:
        job.launched_s = self.clock()  # the deadline runs from here, not from the queue
        if job.cancel.is_set():
            return
        try:
            row = self.runner.run(job)
        except Exception:  # noqa: BLE001 - a runner bug is recorded as an infra failure of this attempt
            log.exception("episode %s/%d attempt %d raised", job.group_id, job.sample_index, job.attempt)
            row = self.runner.failed_row(job, "harness_error")
        self._events.put((job, row, self.clock()))

    def _next_wakeup(self) -> float:
        if self._delayed:
            return max(0.0, min(0.1, min(due for due, *_ in self._delayed) - self.clock()))
        if not self._running:
            return 0.1
        started = [j.launched_s for j in self._running.values() if j.launched_s]
        if not started:
            return 0.5
        return max(0.0, min(0.5, min(started) + self.deadline_s - self.clock()))

    def _pump_events(self) -> None:
        """Scheduler thread: turns finished attempts and deadlines into group state, launches more."""
        while not self._closed:
            with self._lock:
                wait_s = self._next_wakeup()
            try:
                event = self._events.get(timeout=max(wait_s, 0.001))
            except queue.Empty:
                event = None
            with self._changed:
                try:
                    if event is not None:
                        self._event(event)
                    self._drain_events()
                    self._check_deadlines()
                    self._start_due_retries()
                    self._launch()
                except Exception:  # noqa: BLE001 - the pump must outlive any one bad event
                    log.exception("scheduler: pump iteration failed")
                self._changed.notify_all()

    def _drain_events(self) -> None:
        """Process every result already queued (before any deadline is judged)."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            self._event(event)

    def _event(self, event: tuple) -> None:
        job, row, finished_s = event
        if self._running.pop(id(job), None) is None:  # a late result of a cancelled attempt
            return
        try:
            self._finished(job, Attempt(row, finished_s, finished_s - job.launched_s, job.launched_s - job.queued_s))
        except Exception:  # noqa: BLE001 - a bad row must not leave its group waiting forever
            self._drop_after_error(job, "processing a result")

    def _check_deadlines(self) -> None:
        now = self.clock()
        for job in [j for j in self._running.values() if j.launched_s and now - j.launched_s > self.deadline_s]:
            job.cancel.set()
            self._running.pop(id(job), None)
            self.counters["deadline_cancels"] += 1
            try:
                row = self.runner.failed_row(job, "episode_deadline")
                self._finished(job, Attempt(row, now, now - job.launched_s, job.launched_s - job.queued_s))
            except Exception:  # noqa: BLE001 - the group must not wait forever on a lost attempt
                self._drop_after_error(job, "recording a deadline")

    def _unlocked(self, fn: Callable, *args) -> Any:
        """Return ``fn(*args)``, called with the scheduler's lock released (held again on return)."""
        self._changed.release()
        try:
            return fn(*args)
        finally:
            self._changed.acquire()

    def _start_due_retries(self) -> None:
        now = self.clock()
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, g, sample_index, attempt in due:
            if g.group_id in self._groups:  # not dropped meanwhile
                self._start(g, sample_index, attempt)

    def _drop_after_error(self, job: EpisodeJob, what: str) -> None:
        """Log the exception being handled and drop the job's group (``infra_failure:harness_error``)."""
        log.exception("scheduler: %s of %s failed; dropping the group", what, job.group_id)
        g = self._groups.get(job.group_id)
        if g is not None:
            self._drop(g, "infra_failure:harness_error")

    def _finished(self, job: EpisodeJob, attempt: Attempt) -> None:
        g = self._groups.get(job.group_id)
        if g is None:  # the group was dropped meanwhile
            return
        g.attempts.append(attempt)
        row = attempt.row
        if row["outcome"] == "infra_failure":
            if self.infra_policy == "retry" and job.attempt < self.max_retries:
                self.counters["infra_retries"] += 1
                if self.retry_backoff_s > 0:
                    due = self.clock() + self.retry_backoff_s * 2**job.attempt
                    self._delayed.append((due, g, job.sample_index, job.attempt + 1))
                else:
                    self._start(g, job.sample_index, job.attempt + 1)
                return
            if not self.keep_failed_members:
                self._drop(g, f"infra_failure:{row['reason']}")
                return
        g.final[job.sample_index] = attempt
        if g.complete:
            g.completed_s = attempt.finished_s
            del self._groups[g.group_id]
            self.bank.put(g)

    def _drop(self, g: Group, why: str) -> None:
        g.dropped = why
        self._dropped.append(g)
        self.counters["dropped_infra"] += 1
        self._cancel(g)

    def _cancel(self, g: Group) -> None:
        """Stop ``g``: out of flight, its running attempts cancelled (their late results ignored), no retries."""
        self._groups.pop(g.group_id, None)
        self._delayed = [d for d in self._delayed if d[1] is not g]
        for job in [j for j in self._running.values() if j.group_id == g.group_id]:
            job.cancel.set()
            self._running.pop(id(job), None)

    def _metrics(self, groups: list[Group], start: float, end: float, carried_in: int,
                 counters0: Counter) -> dict[str, float]:
        final = [g.final[i] for g in groups for i in sorted(g.final)]
        episode_s = sorted(a.episode_s for a in final)
        done = sorted(max(a.finished_s, start) for a in final)
        at90 = done[max(0, math.ceil(0.9 * len(done)) - 1)] if done else start

        def q(p: float) -> float:
            return episode_s[min(len(episode_s) - 1, int(p * len(episode_s)))] if episode_s else 0.0

        lags = Counter(self.bank.lag(g, self.policy_version) for g in groups)
        m = {"time_to_batch_s": end - start, "batch_samples": len(final), "episode_s_p50": q(0.5),
             "episode_s_p90": q(0.9),
             "episode_s_max": episode_s[-1] if episode_s else 0.0,
             "straggler_tail_s": (done[-1] - at90) if done else 0.0,
             "groups_carried_in": carried_in, "groups_in_bank": len(self.bank)}
        for key in ("dropped_stale", "dropped_infra", "deadline_cancels", "infra_retries", "aborted_for_update",
                    "short_batches"):  # since the previous batch
            m[key] = self.counters[key] - counters0[key]
        for lag, n in sorted(lags.items()):
            m[f"lag_hist_{lag}"] = n
        tokens: Counter = Counter()
        for g in groups:
            tokens.update(g.tokens_by_version())
        total = sum(tokens.values())
        m["sample_lag_mean"] = (sum(n * (self.policy_version - v) for v, n in tokens.items()) / total
                                if total else 0.0)
        m["sample_lag_max"] = max((self.policy_version - v for v in tokens), default=0)
        return m
