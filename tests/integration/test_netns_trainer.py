"""Two DeepSpeed ranks on two machines (network namespaces): the step equals the one-rank step.

Rank 0 runs the trainer as a run would (``GRPOTrainer(world_size=2, master=...)``); rank 1 is
``python -m infra.train.ranks`` on the other node, with nothing but rank 0's address: the trainer's
arguments, the model's config and its weights come from rank 0 over the group (gloo on the bridge).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.net import free_port
from tests.integration import netns

pytestmark = pytest.mark.integration  # DeepSpeed ranks in network namespaces (root)

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.231.8"  # not test_netns_engine's: the two files may run at once


def _step(launcher: tuple, model_dir, out: Path, *args: str) -> subprocess.Popen:
    cmd = [*launcher, sys.executable, "-m", "tests.integration.dp_step", str(model_dir), str(out), *args]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)


def _follower(launcher: tuple, master: str, log: Path) -> subprocess.Popen:
    cmd = [*launcher, sys.executable, "-m", "infra.train.ranks", "--master", master, "--rank", "1", "--world-size",
           "2", "--timeout-s", "120"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)  # noqa: SIM115


def _result(out: Path) -> tuple[dict, dict, list]:
    from safetensors.torch import load_file

    return (load_file(out / "weights.safetensors"), json.loads((out / "metrics.json").read_text()),
            json.loads((out / "decisions.json").read_text()))


def _assert_same_step(one: Path, two: Path) -> None:
    import torch

    w1, m1, d1 = _result(one)
    w2, m2, d2 = _result(two)
    assert m2["loss_tokens"] == m1["loss_tokens"] and m2["rows_with_signal"] == m1["rows_with_signal"] == 6
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-6)
    # without the world-size factor DeepSpeed's averaging halves it (and the weights move otherwise)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    assert m2["update_norm"] == pytest.approx(m1["update_norm"], rel=1e-5)
    for key in ("kl_k1", "kl_k3", "logprob_abs_diff", "ratio_p05", "ratio_p50", "ratio_p95", "tis_capped_frac"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5), key
    assert [(d["episode_id"], d["decision"]) for d in d2] == [(d["episode_id"], d["decision"]) for d in d1]
    assert w2.keys() == w1.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=2e-5, msg=key)  # an update moves ~1e-3


def test_two_ranks_across_namespaces_step_save_and_resume_as_one_rank_does(tiny_model, tmp_path):
    """ZeRO-2, fp32. Step 1 on 2 ranks equals step 1 on 1 (same loss, same gradient norm: the loss scale,
    as DeepSpeed averages over ranks; same weights within float tolerance: the micro-batches differ, 9
    rows as 2-row micro-batches on 1 rank, as token-balanced shards on 2, a short rank repeating a row at
    weight 0). Its saved state (one folder on rank 0's node: rank 1 sent its optimizer shard) restores a
    new group whose rank 1 starts on the other node with nothing, and step 2 equals the 1-rank run's."""
    for phase, args in (("1", ("--save-state", str(tmp_path / "state-{n}"))),
                        ("2", ("--load-state", str(tmp_path / "state-{n}"), "--rows-seed", "1"))):
        one = _step((), tiny_model, tmp_path / f"one{phase}", *(x.format(n=1) for x in args))
        assert one.wait(300) == 0, (tmp_path / f"one{phase}.log").read_text()[-3000:]
        with netns.nodes(2, SUBNET) as (a, b):
            master = f"{a.address}:{free_port()}"
            rank0 = _step(a.launcher, tiny_model, tmp_path / f"two{phase}", "--world-size", "2", "--master", master,
                          *(x.format(n=2) for x in args))
            rank1 = _follower(b.launcher, master, tmp_path / f"rank1-{phase}.log")
            assert rank0.wait(300) == 0, (tmp_path / f"two{phase}.log").read_text()[-3000:]
            assert rank1.wait(60) == 0, (tmp_path / f"rank1-{phase}.log").read_text()[-3000:]  # ended by rank 0's close
        assert f"rank 1 of 2: trainer built, following {master}" in (tmp_path / f"rank1-{phase}.log").read_text()
        _assert_same_step(tmp_path / f"one{phase}", tmp_path / f"two{phase}")
        if phase == "1":
            assert sorted(p.name for p in (tmp_path / "state-2" / "s").iterdir()) == [
                "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_a_follower_exits_when_rank_0_is_killed_and_rank_0_fails_when_no_follower_joins(tiny_model, tmp_path):
    """Crash hygiene: a rank waiting for commands leaves with an error when rank 0 is SIGKILLed, rather than
    waiting out its 7-day command timeout; and rank 0 alone gives up after its join timeout with a clear error."""
    with netns.nodes(2, SUBNET) as (a, b):
        master = f"{a.address}:{free_port()}"
        rank0 = _step(a.launcher, tiny_model, tmp_path / "held", "--world-size", "2", "--master", master,
                      "--hold-s", "600")
        rank1 = _follower(b.launcher, master, tmp_path / "rank1.log")
        deadline = time.monotonic() + 240
        while "trainer built, following" not in (tmp_path / "rank1.log").read_text():
            assert time.monotonic() < deadline and rank1.poll() is None, (tmp_path / "rank1.log").read_text()[-3000:]
            time.sleep(0.5)
        rank0.kill()
        rank0.wait(30)
        killed_at = time.monotonic()
        assert rank1.wait(60) == 1
        assert time.monotonic() - killed_at < 60
        assert "error: rank 1:" in (tmp_path / "rank1.log").read_text()
        assert not b.pids()

        alone = _step(a.launcher, tiny_model, tmp_path / "alone", "--world-size", "2", "--master",
                      f"{a.address}:{free_port()}", "--timeout-s", "5")
        assert alone.wait(120) != 0
    log = (tmp_path / "alone.log").read_text()
    assert "the trainer group at" in log and "did not form within 5 s" in log, log[-3000:]


def test_ranks_launched_as_ray_actors_step_as_one_rank_does(tiny_model, tmp_path):
    """``train.launch = "ray"``: rank 1 is a Ray actor (a local Ray instance here) in a placement group."""
    one = _step((), tiny_model, tmp_path / "one")
    two = _step((), tiny_model, tmp_path / "two", "--world-size", "2", "--master", f"127.0.0.1:{free_port()}", "--ray")
    assert one.wait(300) == 0, (tmp_path / "one.log").read_text()[-3000:]
    assert two.wait(300) == 0, (tmp_path / "two.log").read_text()[-3000:]
    (actor,) = json.loads((tmp_path / "two" / "ray_ranks.json").read_text())
    assert int(actor.rsplit(":", 1)[1]) != two.pid  # rank 1 ran in a Ray worker process
    _assert_same_step(tmp_path / "one", tmp_path / "two")
