"""Object storage access (s3fs against SeaweedFS or any S3-compatible endpoint).

The endpoint and keys come from the environment that ``make up`` writes (``.state/services.env``):
``AGENTRL_S3_ENDPOINT``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``.
"""

from __future__ import annotations

import os

import s3fs


class StorageError(RuntimeError):
    """Object storage is not configured or not reachable; the message names the endpoint."""


def s3_filesystem(bucket: str) -> s3fs.S3FileSystem:
    """An s3fs filesystem for the configured endpoint, checked to reach ``bucket``.

    Raises:
        StorageError: ``AGENTRL_S3_ENDPOINT`` unset, endpoint unreachable, or bucket missing.
    """
    endpoint = os.environ.get("AGENTRL_S3_ENDPOINT")
    if not endpoint:
        raise StorageError("AGENTRL_S3_ENDPOINT is not set: run `make up` and source .state/services.env, "
                           "or point it at an S3-compatible endpoint")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    fs = s3fs.S3FileSystem(
        key=os.environ.get("AWS_ACCESS_KEY_ID"), secret=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        client_kwargs={"endpoint_url": endpoint},
        config_kwargs={"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}},
        skip_instance_cache=True,
    )
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError as e:
        raise StorageError(f"S3 endpoint {endpoint}: bucket '{bucket}' does not exist "
                           "(expected `make up` to create it)") from e
    except Exception as e:  # botocore raises many unrelated types for a dead endpoint
        raise StorageError(f"S3 endpoint {endpoint} not reachable (bucket '{bucket}'): {e}") from e
    return fs
