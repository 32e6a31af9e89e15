"""Task difficulty from past episodes, and the per-step task sample.

Pass rates come from the trajectory store (infra failures do not count as attempts). A task is
*saturated* when its last ``window`` attempts all passed, *hopeless* when it has at least
``hopeless_min_attempts`` attempts and none passed; both are skipped, except that a task with
fewer than ``explore_min_attempts`` attempts is always eligible (exploration floor). Eligible
tasks are drawn without replacement, rarely tried ones first, then by ``p(1-p)`` (the variance of
a Bernoulli reward: groups where GRPO advantages are non-zero), ties broken by a seeded shuffle.

Skipping is not forever: the policy changes, so a share ``revisit_frac`` of each step's slots goes
to skipped tasks, the one attempted longest ago first. Without it a skipped task would get no new
attempts, its stats could never change, and it would stay skipped for the rest of the run. The
share is kept in expectation: ``count * revisit_frac`` slots, the fractional part drawn with the
step's seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskStats:
    """Attempts and passes of one task (recent = the last ``window`` attempts, by step)."""

    attempts: int
    passes: int
    recent_attempts: int
    recent_passes: int
    last_step: int = -1
    """Step of the newest attempt (-1: never attempted)."""

    @property
    def pass_rate(self) -> float:
        """Recent pass rate; 0.5 (maximal uncertainty) for a task never tried."""
        return self.recent_passes / self.recent_attempts if self.recent_attempts else 0.5


def pass_stats(records: list[tuple[str, int, float, str]], window: int) -> dict[str, TaskStats]:
    """Per-task stats from ``(task_id, step, reward, outcome)`` records.

    A pass is ``outcome == "success"``; ``infra_failure`` records are ignored.
    """
    by_task: dict[str, list[tuple[int, bool]]] = {}
    for task_id, step, _reward, outcome in records:
        if outcome == "infra_failure":
            continue
        by_task.setdefault(task_id, []).append((step, outcome == "success"))
    stats = {}
    for task_id, attempts in by_task.items():
        attempts.sort(key=lambda a: a[0])
        recent = attempts[-window:]
        stats[task_id] = TaskStats(len(attempts), sum(p for _, p in attempts), len(recent), sum(p for _, p in recent),
                                   attempts[-1][0])
    return stats


@dataclass(frozen=True)
class Selection:
    """The tasks chosen for a step and why the others were skipped."""

    chosen: list[str]
    skipped: dict[str, str]  # task_id -> "saturated" | "hopeless" (revisited ones excluded)
    revisited: list[str] = field(default_factory=list)  # skipped tasks chosen anyway this step (``revisit_frac``)


def select_tasks(task_ids: list[str], stats: dict[str, TaskStats], count: int, window: int,
                 hopeless_min_attempts: int, explore_min_attempts: int, seed: int,
                 revisit_frac: float = 0.0) -> Selection:
    """Choose up to ``count`` tasks for a step (see the module docstring for the rule).

    When fewer than ``count`` tasks are eligible, all eligible ones are chosen; when none is,
    the skipped tasks are used after all rather than returning an empty step. Of the ``count``
    slots, ``count * revisit_frac`` in expectation go to skipped tasks, oldest last attempt first.

    Raises:
        ValueError: ``revisit_frac`` outside [0, 1].
    """
    if not 0.0 <= revisit_frac <= 1.0:
        raise ValueError(f"revisit_frac must be in [0, 1], got {revisit_frac}")
    empty = TaskStats(0, 0, 0, 0)
    eligible, skipped = [], {}
    for task_id in task_ids:
        s = stats.get(task_id, empty)
        if s.attempts < explore_min_attempts:
            eligible.append(task_id)
        elif s.recent_attempts >= window and s.recent_passes == s.recent_attempts:
            skipped[task_id] = "saturated"
        elif s.attempts >= hopeless_min_attempts and s.passes == 0:
            skipped[task_id] = "hopeless"
        else:
            eligible.append(task_id)
    rng = random.Random(seed)
    if not eligible:
        pool = list(skipped)
        rng.shuffle(pool)
        return Selection(sorted(pool, key=lambda t: _priority(stats.get(t, empty), explore_min_attempts))[:count], {})
    rng.shuffle(eligible)
    revisited: list[str] = []
    if skipped and revisit_frac > 0:
        whole, frac = divmod(count * revisit_frac, 1.0)
        n = min(len(skipped), int(whole) + (rng.random() < frac))
        oldest = list(skipped)
        rng.shuffle(oldest)
        oldest.sort(key=lambda t: stats.get(t, empty).last_step)  # stable: the shuffle breaks ties
        revisited = oldest[:n]
    eligible.sort(key=lambda t: _priority(stats.get(t, empty), explore_min_attempts))  # stable
    chosen = revisited + eligible[:count - len(revisited)]
    return Selection(chosen, {t: r for t, r in skipped.items() if t not in revisited}, revisited)


def _priority(s: TaskStats, explore_min_attempts: int) -> tuple[int, float]:
    """Sort key: rarely tried first, then by ``-p(1-p)`` (most reward variance first)."""
    p = s.pass_rate
    return (0 if s.attempts < explore_min_attempts else 1, -p * (1 - p))
