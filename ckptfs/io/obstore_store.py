"""s3:// (and gs://, az://) through obstore, selected with ``StoreOptions(client="obstore")``.

Each request is retried by one layer only (``StoreOptions.retries/retry_delay/retry_max_delay``):
single requests (GET, HEAD, single PUT, create, list, delete) by ckptfs's retry layer, with
obstore's own retries turned off; a multipart upload by obstore's per-request retries (it
streams the parts itself: ``put_async`` with an iterator of zero-copy views,
``chunk_size=part_size``, ``max_concurrency=upload_concurrency``), which ckptfs does not repeat.
Either way permanent errors (403, 404) fail at once with the URL in the message, and exhausted
retries raise ``StorageError``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from ckptfs.errors import StorageError
from ckptfs.io.options import StoreOptions
from ckptfs.io.parts import joined, part_size_for, pieces_async, total_bytes
from ckptfs.io.retry import RetryPolicy, is_transient, retrying, status_in_text
from ckptfs.io.store import Buffer, Part, Store, inside_root

if TYPE_CHECKING:  # obstore's config types exist in its stubs only
    from obstore.store import ClientConfig, ObjectMeta, RetryConfig

    from ckptfs.io.registry import StoreRequest

T = TypeVar("T")

#: s3fs-style storage_options and the obstore S3Config key each one becomes
S3FS_KEYS = {"endpoint_url": "endpoint", "key": "access_key_id", "secret": "secret_access_key",
             "token": "session_token", "region_name": "region"}
#: s3fs transport tuning with no obstore meaning; dropped so one options dict serves both engines
S3FS_ONLY = frozenset({"config_kwargs", "skip_instance_cache", "use_listings_cache", "asynchronous",
                       "s3_additional_kwargs", "max_concurrency", "default_block_size", "retries",
                       "default_fill_cache", "default_cache_type", "listings_expiry_time",
                       "cache_regions", "version_aware", "fixed_upload_size"})


def s3_config(storage_options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(S3Config kwargs, client_options) from s3fs-style or obstore-style storage_options."""
    opts = dict(storage_options)
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    client_options = dict(opts.pop("client_options", None) or {})
    cfg: dict[str, Any] = {}
    for k, v in {**client_kwargs, **opts}.items():
        if k in S3FS_ONLY or v is None:
            continue
        if k == "anon":
            if v:
                cfg["skip_signature"] = True
            continue
        if k == "use_ssl":
            continue
        cfg[S3FS_KEYS.get(k, k)] = v
    if str(cfg.get("endpoint", "")).startswith("http://"):
        client_options.setdefault("allow_http", True)
    return cfg, client_options


def retry_config(policy: RetryPolicy) -> RetryConfig:
    """obstore's RetryConfig for ``policy`` (``RetryPolicy(0)`` turns its retries off)."""
    return {"max_retries": policy.retries,
            "backoff": {"init_backoff": timedelta(seconds=policy.base_delay),
                        "max_backoff": timedelta(seconds=policy.max_delay), "base": 2},
            "retry_timeout": timedelta(minutes=3)}


async def open_request(request: StoreRequest) -> ObstoreStore:
    """The opener of every remote URL with ``StoreOptions(client="obstore")``."""
    return await open_obstore(request.url, request.storage_options, request.options)


async def open_obstore(url: str, storage_options: Mapping[str, Any], options: StoreOptions) -> ObstoreStore:
    """An ObstoreStore for ``url``; s3fs-style storage_options are translated for s3://."""
    from obstore.store import S3Store, from_url

    proto, rest = url.split("://", 1)

    def client(policy: RetryPolicy) -> Any:
        rc = retry_config(policy)
        if proto in ("s3", "s3a"):
            bucket, _, prefix = rest.partition("/")
            cfg, client_options = s3_config(storage_options)
            return S3Store(bucket, prefix=prefix.strip("/") or None,
                           client_options=cast("ClientConfig", client_options), retry_config=rc, **cfg)
        opts = dict(storage_options)
        return from_url(url, client_options=opts.pop("client_options", None), retry_config=rc,
                        **opts)

    policy = options.retry_policy
    # one client without retries (ckptfs retries each request), one whose per-request retries
    # serve multipart uploads (ckptfs cannot retry a part of obstore's streaming upload)
    return ObstoreStore(client(RetryPolicy(0)), url, options, multipart_store=client(policy))


class ObstoreStore(Store):
    """A checkpoint root on an obstore ObjectStore (its prefix is the root)."""

    def __init__(self, store: Any, url: str, options: StoreOptions | None = None, *,
                 multipart_store: Any = None) -> None:
        """``store`` must not retry (ckptfs's retry layer does); ``multipart_store`` (default:
        ``store``) is the same root with obstore's retries on, used for multipart uploads only,
        which ckptfs does not retry again."""
        super().__init__(url, options)
        self.store = store
        self.multipart_store = store if multipart_store is None else multipart_store

    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        if end <= start:
            return b""
        async with self.budget.hold(end - start), self.semaphore:
            data = await self._call(path, lambda: obstore.get_range_async(
                self.store, path, start=start, end=end))
            out = bytes(data)
        self.stats.add_read(len(out))
        return out

    async def get(self, path: str) -> Buffer:
        async def fetch():
            r = await obstore.get_async(self.store, path)
            return await r.bytes_async()

        async with self.semaphore:
            out = bytes(await self._call(path, fetch))
        self.stats.add_read(len(out))
        return out

    streams_parts = True

    async def put(self, path: str, parts: Sequence[Part]) -> None:
        """One PUT up to ``part_size``; above, obstore's streaming multipart upload fed with
        zero-copy views (at most ``upload_concurrency`` parts buffered)."""
        total = total_bytes(parts)
        size = part_size_for(total, self.options.part_size)
        if total <= size:
            async with self.budget.hold(total), self.semaphore:
                data = await joined(parts)
                await self._call(path, lambda: obstore.put_async(self.store, path, data,
                                                                  use_multipart=False))
        else:
            held = min(total, size * self.options.upload_concurrency)

            async def views():
                async for piece in pieces_async(parts, size):
                    for v in piece:
                        yield v

            try:
                async with self.budget.hold(held), self.semaphore:
                    await self._call(path, lambda: obstore.put_async(
                        self.multipart_store, path, views(), chunk_size=size,
                        max_concurrency=self.options.upload_concurrency), retry=False)
            except FileNotFoundError:
                # NoSuchUpload: obstore retried a completion whose first attempt landed
                if await self._size_or_none(path) != total:
                    raise
        self.stats.write_requests += 1
        self.stats.bytes_written += total

    async def put_if_absent(self, path: str, data: Buffer) -> None:
        data = bytes(data)
        try:
            async with self.semaphore:
                await self._call(path, lambda: obstore.put_async(self.store, path, data, mode="create"))
        except FileExistsError:
            # obstore retried a create whose first attempt landed (answer lost)
            if not await self.holds(path, data):
                raise
        self.stats.write_requests += 1
        self.stats.bytes_written += len(data)

    async def exists(self, path: str) -> bool:
        try:
            await self._head(path)
            return True
        except FileNotFoundError:
            return False

    async def size(self, path: str) -> int:
        return int((await self._head(path))["size"])

    async def version_tag(self, path: str) -> str:
        meta = await self._head(path)
        return f"size={meta['size']};ETag={meta.get('e_tag')};mtime={meta.get('last_modified')}"

    async def _size_or_none(self, path: str) -> int | None:
        try:
            return await self.size(path)
        except FileNotFoundError:
            return None

    async def _head(self, path: str) -> ObjectMeta:
        async with self.semaphore:
            return await self._call(path, lambda: obstore.head_async(self.store, path))

    async def list(self, prefix: str = "") -> list[str]:
        async def collect():
            return await obstore.list(self.store, prefix=prefix.strip("/") or None).collect_async()

        try:
            metas = await self._call(prefix, collect)
        except FileNotFoundError:
            return []
        return sorted(m["path"] for m in metas)

    async def delete(self, paths: Sequence[str]) -> None:
        if not paths:
            return
        for p in paths[1:]:  # the first is checked by _call
            inside_root(p, self.url)
        async with self.semaphore:
            try:
                await self._call(paths[0], lambda: obstore.delete_async(self.store, list(paths)))
            except FileNotFoundError:
                pass

    # -- helpers -----------------------------------------------------------------------------
    def _count_retry(self, _: BaseException) -> None:
        self.stats.retries += 1

    async def _call(self, path: str, op: Callable[[], Awaitable[T]], retry: bool = True) -> T:
        """Run ``op``, retried by ckptfs unless ``retry`` is False (obstore retried its requests
        already); obstore's errors become the builtin ones, naming the URL. A path that could
        leave the root is refused before any request."""
        url = self.full_path(inside_root(path, self.url))
        policy = self.options.retry_policy
        try:
            if retry:
                return await retrying(op, url, policy, on_retry=self._count_retry)
            try:
                return await op()
            except Exception as e:
                if not is_transient(e):
                    raise
                raise StorageError(f"{url}: still failing after {policy.retries + 1} attempt(s) "
                                   f"(obstore's retries): {type(e).__name__}: {e}") from e
        except (NotFoundError, FileNotFoundError):  # some calls raise the builtin
            raise FileNotFoundError(f"{url}: no such file") from None
        except (AlreadyExistsError, PreconditionError, FileExistsError):
            raise FileExistsError(f"{url} already exists") from None
        except (PermissionDeniedError, UnauthenticatedError, PermissionError) as e:
            raise PermissionError(f"{url}: access denied ({_first_line(e)})") from e
        except Exception as e:
            if not (type(e).__module__ or "").startswith("obstore"):
                raise
            # obstore's GenericError (a listing's 403 among them): a builtin error naming the URL
            if status_in_text(e) in (401, 403):
                raise PermissionError(f"{url}: access denied ({_first_line(e)})") from e
            raise OSError(f"{url}: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
