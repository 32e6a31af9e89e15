"""DeepSpeed's ``init_distributed`` for the one-rank CPU trainer, with and without its shared-memory op.

Each variant runs in a fresh process with an empty ``TORCH_EXTENSIONS_DIR`` (as on a machine that never
built DeepSpeed's ops): ``build`` is DeepSpeed's default (it JIT-compiles ``deepspeed_shm_comm``),
``skip`` is what ``infra.train.trainer.Trainer`` does for one rank (``_skip_shm_comm_op``). Both then
all-reduce a tensor through the group, so the fallback is shown to work. Prints each variant's seconds
and the ratio skip / build, measured in the same run.

Usage: ``python -m benchmarks.trainer_init [--rounds 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from infra.net import free_port

_CHILD = """
import json, sys, time
import deepspeed, torch
import deepspeed.comm as dc
if sys.argv[1] == "skip":
    from infra.train.trainer import _skip_shm_comm_op
    _skip_shm_comm_op()
t1 = time.monotonic()
deepspeed.init_distributed(dist_backend="gloo")
t2 = time.monotonic()
x = torch.ones(4)
dc.all_reduce(x)
print(json.dumps({"init_distributed_s": t2 - t1, "all_reduce": x.tolist(),
                  "shm_op": dc.comm.cdb.shm_comm_op is not None}))
"""


def run_variant(variant: str) -> dict:
    """One fresh process of ``variant`` (``build`` or ``skip``); its JSON result."""
    with tempfile.TemporaryDirectory() as ext:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": ext, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        out = subprocess.run([sys.executable, "-c", _CHILD, variant], env=env, capture_output=True, text=True,
                             check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    for r in range(args.rounds):
        t0 = time.monotonic()
        build, skip = run_variant("build"), run_variant("skip")
        assert build["all_reduce"] == skip["all_reduce"] == [1.0] * 4
        ratio = skip["init_distributed_s"] / build["init_distributed_s"]
        print(f"round {r}: init_distributed build {build['init_distributed_s']:.1f} s (shm op {build['shm_op']}), "  # noqa: T201
              f"skip {skip['init_distributed_s']:.2f} s (shm op {skip['shm_op']}); ratio skip/build {ratio:.3f} "
              f"({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
