"""Trajectory store: row invariants checked before anything is written (no S3)."""

from __future__ import annotations

import pytest

from infra.store import SchemaError, validate_rows
from tests.helpers import make_row


def test_validate_rows_invariants():
    validate_rows([make_row()])
    with pytest.raises(SchemaError, match="'loss_mask' has 3 entries, token_ids has 4"):
        validate_rows([make_row(loss_mask=[0, 1, 1])])
    with pytest.raises(SchemaError, match="min/max_policy_version 0/4 != tokens' 3/4"):
        validate_rows([make_row(min_policy_version=0)])
    with pytest.raises(SchemaError, match="unknown columns \\['extra'\\]"):
        validate_rows([make_row(extra=1)])
    with pytest.raises(SchemaError, match="NaN rollout logprob"):
        validate_rows([make_row(rollout_logprobs=[0.0, 0.0, float("nan"), -1.0])])
