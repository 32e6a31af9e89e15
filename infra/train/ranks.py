"""Data-parallel trainer ranks: rank 0 is the run's trainer, the others follow it from any machine.

Rank 0 (:class:`~infra.train.trainer.GRPOTrainer` with ``world_size`` > 1, inside the run's flow) binds
``master``; every other rank is one process started on its machine, by hand, by a scheduler or by
``torchrun``-style tooling::

    python -m infra.train.ranks --master 10.0.0.1:29500 --rank 1 --world-size 2

or, with ``train.launch = "ray"``, as Ray actors the run starts itself (:func:`start_ray_ranks`).
It joins the group, receives the trainer's arguments and the model's config from rank 0, builds the
same DeepSpeed engine (weights: DeepSpeed broadcasts rank 0's at ``initialize``), then runs each method
rank 0 runs (``step`` with the whole batch, ``save_state``, ``load_state``, ``fp32_state_dict``) until
rank 0 closes the trainer; it then exits 0. It exits 1 when rank 0 goes away (its socket closes) or a
command fails, which in turn fails rank 0's next collective rather than hanging it. Commands travel on
a gloo group of their own whose timeout is long (a rank waits for the next step while the run
collects rollouts); the default group's timeout (``--timeout-s``) bounds the join and each collective.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

log = logging.getLogger(__name__)

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
"""What :func:`join_ranks` sets in the environment."""
COMMAND_TIMEOUT = timedelta(days=7)  # the longest a rank waits for rank 0's next command


def join_ranks(rank: int, world_size: int, master: str, timeout_s: float):
    """Join the data-parallel group ``world_size`` at ``master`` as ``rank``; returns the command group.

    Sets the environment DeepSpeed reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` unless set,
    ``MASTER_ADDR``, ``MASTER_PORT``) and gloo's interface (``GLOO_SOCKET_IFNAME``, unless set: the
    one this machine reaches the master through), then initializes torch.distributed (gloo on CPU,
    NCCL on GPU) and a gloo group for commands.

    Raises:
        ValueError: ``master`` is not ``host:port``.
        RuntimeError: the group did not form within ``timeout_s`` (a rank missing or unreachable).
    """
    import deepspeed
    import torch
    import torch.distributed as dist

    from infra.net import interface_toward

    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"train.master {master!r}: expected host:port, an address every rank reaches")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=host, MASTER_PORT=port)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_toward(host))
    if not torch.cuda.is_available():
        from infra.train.trainer import _skip_shm_comm_op

        _skip_shm_comm_op()
    try:
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl",
                                   timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # torch raises DistStoreError / RuntimeError on a join that timed out
        raise RuntimeError(f"rank {rank} of {world_size}: the trainer group at {master} did not form within "
                           f"{timeout_s:.0f} s ({type(e).__name__}: {e}); is every rank started and reachable?") from e
    return dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)


def send_command(group, command: str, *args) -> None:
    """Rank 0: broadcast ``(command, args)`` to the other ranks on the command group."""
    import torch.distributed as dist

    dist.broadcast_object_list([(command, args)], src=0, group=group)


def _receive(group) -> tuple[str, tuple]:
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def follow(rank: int, world_size: int, master: str, timeout_s: float) -> None:
    """Run as ``rank`` of the group at ``master`` until rank 0 closes its trainer.

    Raises:
        RuntimeError: the group did not form, or rank 0 sent something other than ``init`` first.
    """
    from infra.train.trainer import GRPOTrainer

    commands = join_ranks(rank, world_size, master, timeout_s)
    command, args = _receive(commands)
    if command != "init":
        raise RuntimeError(f"rank {rank}: expected rank 0's init, got {command!r}")
    hyper, model_config = args
    trainer = GRPOTrainer(None, **hyper, world_size=world_size, model_config=model_config, command_group=commands)
    log.info("rank %d of %d: trainer built, following %s", rank, world_size, master)
    while True:
        command, args = _receive(commands)
        if command == "close":
            trainer.close()
            return
        log.info("rank %d: %s", rank, command)
        getattr(trainer, command)(*args)


class _RayRank:
    """A Ray actor holding one rank > 0 (its own worker process, as ``python -m infra.train.ranks`` would be)."""

    def follow(self, rank: int, world_size: int, master: str, timeout_s: float) -> str:
        import socket

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        follow(rank, world_size, master, timeout_s)
        return f"{socket.gethostname()}:{os.getpid()}"


class RayRanks:
    """Ranks 1 .. world_size - 1 as Ray actors in one placement group (one CPU each, spread over nodes)."""

    def __init__(self, world_size: int, master: str, timeout_s: float, address: str = ""):
        """Start the actors; each joins rank 0 at ``master`` (which must be up within ``timeout_s``).

        ``address``: the Ray cluster (``ray://`` or ``host:port``); empty: the cluster this process is
        connected to, else a local Ray instance.

        Raises:
            RuntimeError: the placement group could not be placed within ``timeout_s`` (too few CPUs).
        """
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            local = {} if address else {"include_dashboard": False, "object_store_memory": 256 * 1024**2}
            # "local": a new instance even when this machine runs a cluster (`ray start`), which ray.init() would join
            ray.init(address=address or "local", log_to_driver=False, **local)
        self._pg = placement_group([{"CPU": 1}] * (world_size - 1), strategy="SPREAD")
        try:
            ray.get(self._pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            ray.util.remove_placement_group(self._pg)
            raise RuntimeError(f"train.launch = \"ray\": {world_size - 1} rank(s) of 1 CPU each could not be placed "
                               f"on the Ray cluster within {timeout_s:.0f} s") from e
        actor = ray.remote(num_cpus=1)(_RayRank)
        self.actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, i)).remote()
                       for i in range(world_size - 1)]
        self._done = [a.follow.remote(i + 1, world_size, master, timeout_s) for i, a in enumerate(self.actors)]

    def close(self, timeout_s: float = 60.0) -> list[str]:
        """Wait for the actors to end (after rank 0's trainer closed), then free them; returns ``host:pid`` of each.

        Raises:
            RuntimeError: an actor failed (its error), or did not end within ``timeout_s``.
        """
        import ray

        try:
            return ray.get(self._done, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - RayTaskError, GetTimeoutError: reported with the rank's cause
            raise RuntimeError(f"a Ray trainer rank did not end cleanly: {type(e).__name__}: {e}") from e
        finally:
            for a in self.actors:
                ray.kill(a)
            ray.util.remove_placement_group(self._pg)


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.train.ranks``: one trainer rank > 0 (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m infra.train.ranks", description=__doc__.split("\n")[0])
    parser.add_argument("--master", required=True, help="rank 0's host:port (the run's train.master)")
    parser.add_argument("--rank", type=int, required=True, help="this process's rank, 1 .. world size - 1")
    parser.add_argument("--world-size", type=int, required=True, help="the run's train.world_size")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="wait this long for the group to form")
    a = parser.parse_args(argv)
    if not 0 < a.rank < a.world_size:
        parser.error(f"--rank {a.rank}: expected 1 .. {a.world_size - 1} (rank 0 is the run's trainer)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        follow(a.rank, a.world_size, a.master, a.timeout_s)
    except Exception as e:  # noqa: BLE001 - one line for the operator; rank 0 sees its collective fail
        print(f"error: rank {a.rank}: {type(e).__name__}: {e}", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
