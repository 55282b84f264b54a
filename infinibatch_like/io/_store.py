"""`Store`: how references are reached (fsspec options, the retry policy, fetch options),
built once where a public function is called and passed inward.

A reference with a scheme (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``memory://``,
``file://``) goes to the fsspec file system of that protocol, which takes credentials and
endpoints from its usual places (environment variables such as ``AWS_ENDPOINT_URL``, fsspec
configuration files) and from the storage options. For ``s3://`` the retries of s3fs (its
file system's ``retries``) and of botocore (unless ``config_kwargs`` in the storage options
sets ``retries``) are turned off, so that every retry is this package's: backoff with
jitter, by `RetryPolicy`, counted in `retry_counts`. Local paths go through the operating
system and are never retried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from threading import Event
from typing import Any, TypeVar

from .._core.extras import missing_extra
from .fetch_options import OPTION, FetchOptions
from .retry import DEFAULT_RETRY, RetryPolicy, call_with_retries

T = TypeVar("T")
StorageOptions = Mapping[str, Any]
"""What every public function takes as ``storage_options=``: options of the fsspec file
system of URLs (credentials, endpoint, ...), and optionally the library's own entry
``"infinibatch_like"`` (a `FetchOptions`, or a dict of some of its fields)."""

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")
S3_PROTOCOLS = ("s3", "s3a")
_S3_CONNECTIONS = 64
"""botocore's connection pool for s3:// (its default, 10, would queue the ranges in flight
of a few chunks read at once)."""
_BUCKET_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")
"""Protocols whose URLs start with a bucket (or container) name: ``s3://BUCKET/key``."""


def is_url(ref: str) -> bool:
    """Whether `ref` is a URL (``scheme://...``) rather than a local path."""
    return _URL.match(ref) is not None


def protocol_of(ref: str) -> str:
    return ref.split("://", 1)[0].lower()


@dataclass(frozen=True)
class Store:
    """How the references of one call are reached: the options of their fsspec file system,
    the retry policy of transient failures and how objects are fetched. Plain, picklable
    data: it travels to worker processes and Dask tasks with the work.

    Build it with `Store.of` from a public function's ``storage_options=`` and ``retry=``.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    """The options of the fsspec file system (without the library's own entry)."""
    retry: RetryPolicy = DEFAULT_RETRY
    fetch: FetchOptions = field(default_factory=FetchOptions.from_environment)

    @classmethod
    def of(
        cls, storage_options: StorageOptions | None = None, retry: RetryPolicy | None = None
    ) -> Store:
        """The store of `storage_options` (its ``"infinibatch_like"`` entry over the
        environment's fetch options) and `retry` (`DEFAULT_RETRY` if None).

        Raises:
            TypeError, ValueError: for a bad ``"infinibatch_like"`` entry, naming it.
        """
        given = storage_options or {}
        options = {key: value for key, value in given.items() if key != OPTION}
        return cls(options, DEFAULT_RETRY if retry is None else retry, _fetch_options(given))

    def filesystem(self, ref: str) -> tuple[Any, str]:
        """The fsspec file system for URL `ref` and the path within it.

        Raises:
            MissingExtraError: without fsspec, or without s3fs for ``s3://``.
            ImportError: without the fsspec backend of another protocol (e.g. gcsfs).
        """
        protocol = protocol_of(ref)
        try:
            import fsspec
        except ImportError as error:
            raise missing_extra("fsspec", "remote", f"reading {protocol}:// URLs") from error
        options = dict(self.options)
        if protocol in S3_PROTOCOLS:
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})  # botocore's: none
            config.setdefault("max_pool_connections", _S3_CONNECTIONS)
            options["config_kwargs"] = config
        try:
            fs, path = fsspec.core.url_to_fs(ref, **options)
        except ImportError as error:
            if protocol in S3_PROTOCOLS:
                raise missing_extra("s3fs", "remote", "reading s3:// URLs") from error
            raise ImportError(
                f"{ref}: no fsspec backend for {protocol}:// URLs: {error}"
            ) from error
        if protocol in S3_PROTOCOLS:
            fs.retries = 1  # s3fs's own retries (a class attribute, not an option): none
        return fs, path

    def call(self, action: Callable[[], T], ref: str, doing: str, stop: Event | None = None) -> T:
        """``action()`` under this store's retry policy (see `call_with_retries`)."""
        return call_with_retries(action, ref, doing, self.retry, stop)

    def info(self, ref: str) -> Mapping[str, Any]:
        """What the store says of the object of URL `ref` (``size``, ``ETag``, ...), fresh.

        Raises:
            ChunkNotFoundError, ChunkAccessError, ChunkReadError: naming `ref`.
        """
        fs, path = self.filesystem(ref)

        def info() -> Mapping[str, Any]:
            fs.invalidate_cache(path)
            found: Mapping[str, Any] = fs.info(path)
            return found

        return self.call(info, ref, "looking up")

    def size(self, ref: str) -> int:
        """The size in bytes of the file or object `ref` as stored (compressed).

        Raises:
            FileNotFoundError: if it does not exist (a `ChunkNotFoundError` for a URL).
        """
        if not is_url(ref):
            return os.path.getsize(ref)
        return int(self.info(ref)["size"])

    def remove(self, ref: str) -> None:
        """Remove the file or object `ref`; one that is already gone is no error."""
        if not is_url(ref):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ref)
            return
        fs, path = self.filesystem(ref)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):  # gone already (or by a retried try)
                fs.rm_file(path)

        self.call(remove, ref, "removing")

    def missing_bucket(self, ref: str) -> str | None:
        """``"the bucket 'NAME' does not exist"`` where the store of URL `ref` says that its
        bucket (or container) is absent; None where it exists, for local paths and other
        protocols, and where the store does not say (e.g. access refused)."""
        if not is_url(ref) or protocol_of(ref) not in _BUCKET_STORES:
            return None
        fs, path = self.filesystem(ref)
        bucket = path.split("/", 1)[0]
        try:
            fs.invalidate_cache(bucket)
            fs.info(bucket)
        except FileNotFoundError:
            return f"the bucket {bucket!r} does not exist"
        except Exception:  # access refused, no connection: the caller's own error tells more
            return None
        return None


def _fetch_options(storage_options: StorageOptions) -> FetchOptions:
    """The `FetchOptions` of `storage_options` (its ``"infinibatch_like"`` entry) over those
    of the environment.

    Raises:
        TypeError, ValueError: for an entry that is neither a `FetchOptions` nor a dict of
            its fields, naming the bad key or value.
    """
    given = storage_options.get(OPTION)
    if isinstance(given, FetchOptions):
        return given
    base = FetchOptions.from_environment()
    if given is None:
        return base
    if not isinstance(given, Mapping):
        raise TypeError(
            f"storage option {OPTION!r} must be a FetchOptions or a dict of its fields, "
            f"got {type(given).__name__}"
        )
    fields = {field.name for field in dataclasses.fields(FetchOptions)}
    unknown = sorted(set(map(str, given)) - fields)
    if unknown:
        raise ValueError(
            f"storage option {OPTION!r}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(fields))}"
        )
    return dataclasses.replace(base, **given)
