"""The S3 server fixtures: one SeaweedFS per test session (megatron_ucp.testing.s3_server); each
test writes under its own prefix of the bucket."""

from __future__ import annotations

import uuid

import pytest

from megatron_ucp.testing.s3_server import ServerError, seaweedfs


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """(endpoint URL, `s3://ckpt`); AWS_* set for this process and every launched rank."""
    try:
        server = seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
        endpoint = server.__enter__()
    except ServerError as e:
        pytest.fail(str(e))
    try:
        yield endpoint
    finally:
        server.__exit__(None, None, None)


@pytest.fixture
def s3_prefix(s3_server) -> str:
    """A fresh prefix of the test bucket for one test."""
    return f"{s3_server[1]}/{uuid.uuid4().hex[:12]}"
