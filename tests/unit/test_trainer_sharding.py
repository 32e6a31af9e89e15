"""Row shards of a data-parallel step (``infra.train.trainer.shard_rows``)."""

from __future__ import annotations

import pytest

from infra.train.trainer import shard_rows


def test_shards_cover_every_row_once_keep_order_and_balance_tokens():
    lengths = [40, 8, 33, 21, 14, 27, 20, 34]
    indices = sorted(range(8), key=lambda i: lengths[i])
    shards = shard_rows(indices, lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(8))
    for s in shards:
        assert s == [i for i in indices if i in s]  # each shard keeps the caller's order
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= max(lengths)
    assert shard_rows(indices, lengths, 2) == shards  # deterministic: every rank computes the same


@pytest.mark.parametrize("world", [1, 3, 5])
def test_one_rank_gets_everything_and_more_ranks_than_rows_leaves_some_empty(world):
    lengths = [5, 9, 7]
    shards = shard_rows([0, 1, 2], lengths, world)
    assert len(shards) == world
    if world == 1:
        assert shards == [[0, 1, 2]]
    else:
        assert sorted(len(s) for s in shards)[-1] == 1 and sum(map(len, shards)) == 3
