"""Prefect's persisted task and flow results on S3, so a stage's result is readable from any machine.

Prefect writes persisted results to its default result storage: the block named by
``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK``, else the local folder ``PREFECT_LOCAL_STORAGE_PATH``, which no
other machine reads. :func:`save_s3_result_storage` saves Prefect's own ``RemoteFileSystem`` block
(fsspec, s3fs) on ``s3://<bucket>/prefect-results`` with the endpoint and no keys: each machine's s3fs
takes its own ``AWS_*`` credentials from its environment, so none are stored on the Prefect server.
Every machine that runs flows or workers then sets ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK`` to the
printed slug, and ``PREFECT_RESULTS_PERSIST_BY_DEFAULT=true`` where a flow's own return value must be
read back (a stage run from a deployment)::

    python -m infra.prefect_results --endpoint http://10.0.0.2:8333   # bucket: $AGENTRL_BUCKET or agentrl
"""

from __future__ import annotations

import argparse
import os
import sys

BLOCK_NAME = "agentrl-results"
SLUG = f"remote-file-system/{BLOCK_NAME}"
"""What ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK`` names."""


def save_s3_result_storage(bucket: str, endpoint: str) -> str:
    """Save (or replace) the ``agentrl-results`` block on the current Prefect API; returns its slug.

    ``endpoint``: the S3 endpoint URL as every machine reaches it (empty: AWS's own).
    """
    from prefect.filesystems import RemoteFileSystem

    settings = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    RemoteFileSystem(basepath=f"s3://{bucket}/prefect-results", settings=settings).save(BLOCK_NAME, overwrite=True)
    return SLUG


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.prefect_results``: save the block; print the environment line to set on every machine."""
    parser = argparse.ArgumentParser(prog="python -m infra.prefect_results", description=__doc__.split("\n")[0])
    parser.add_argument("--bucket", default=os.environ.get("AGENTRL_BUCKET", "agentrl"))
    parser.add_argument("--endpoint", default=os.environ.get("AGENTRL_S3_ENDPOINT", ""),
                        help="the S3 endpoint every machine reaches (default $AGENTRL_S3_ENDPOINT)")
    a = parser.parse_args(argv)
    slug = save_s3_result_storage(a.bucket, a.endpoint)
    print(f"PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK={slug}")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
