"""Fixtures shared by the test modules (and usable by tutorials run by the suite)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _profiles import load_selected_profile
from _s3 import CREDENTIALS, FaultyProxy, S3Server

from infinibatch_like.io import reset_retry_counts, reset_storage_counts

load_selected_profile()


@dataclass
class S3Bucket:
    """A fresh bucket on the loopback S3 server; the environment points boto3/s3fs at it."""

    server: S3Server
    name: str
    client: Any  # a boto3 S3 client of the server

    def url(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def put(self, key: str, data: bytes) -> str:
        """Store `data` at `key`; return its s3:// URL."""
        self.client.put_object(Bucket=self.name, Key=key, Body=data)
        return self.url(key)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (a free port), for the whole session."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket, with AWS_ENDPOINT_URL and credentials in the environment as a user
    would set them; s3fs's cached file systems are dropped before and after."""
    import s3fs

    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    yield S3Bucket(s3_server, s3_server.new_bucket(), s3_server.client())
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_proxy(s3: S3Bucket) -> Iterator[FaultyProxy]:
    """A fault-injecting HTTP proxy in front of the S3 server (pass ``endpoint_url`` =
    ``s3_proxy.endpoint`` in storage_options to go through it)."""
    proxy = FaultyProxy(s3.server.endpoint)
    yield proxy
    proxy.stop()


@pytest.fixture
def fresh_storage_counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Storage and retry counters at zero, and no INFINIBATCH_LIKE_* setting from the
    environment, for the test; the counters are reset again after it."""
    for name in list(os.environ):
        if name.startswith("INFINIBATCH_LIKE_"):
            monkeypatch.delenv(name)
    reset_retry_counts()
    reset_storage_counts()
    yield
    reset_retry_counts()
    reset_storage_counts()
