"""s3:// through s3fs (the default engine): multipart uploads with bounded memory, bulk deletes.

The s3fs instance is asynchronous and built inside the ckptfs I/O loop. Its own retry loops
(s3fs ``retries`` and botocore's ``retries`` config) are set to one attempt unless the caller
passes them, so transient errors are retried once, in ckptfs's retry layer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptfs.errors import StorageError
from ckptfs.io.fsspec_store import FsspecStore
from ckptfs.io.options import StoreOptions
from ckptfs.io.parts import join, joined, part_size_for, pieces_async, total_bytes
from ckptfs.io.store import Buffer, Part
from ckptfs.io.tasks import gather_all
from ckptfs.runtime import RUNTIME, Resource

if TYPE_CHECKING:
    from ckptfs.io.registry import StoreRequest

async def open_request(request: StoreRequest) -> S3FsStore:
    """The opener of s3:// with ``StoreOptions(client="fsspec")``: ``open_s3fs``."""
    return await open_s3fs(request.url, request.storage_options, request.options)


#: botocore's pool is 10 by default; keep a few connections beyond the request semaphore
POOL_HEADROOM = 4


async def open_s3fs(url: str, storage_options: Mapping[str, Any], options: StoreOptions) -> S3FsStore:
    """An S3FsStore for ``url``; ``storage_options`` go to ``s3fs.S3FileSystem``."""
    import s3fs

    opts = dict(storage_options)
    retries = opts.pop("retries", 1)  # s3fs's own loop: off, ckptfs retries
    opts["asynchronous"] = True
    opts.setdefault("skip_instance_cache", True)
    opts.setdefault("use_listings_cache", False)
    ck = dict(opts.get("config_kwargs") or {})
    ck.setdefault("max_pool_connections", options.max_concurrency + POOL_HEADROOM)
    ck.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    opts["config_kwargs"] = ck
    if "session" not in opts and not opts.get("profile"):
        opts["session"] = _shared_session()
    fs = s3fs.S3FileSystem(**opts)
    fs.retries = int(retries)
    await fs.set_session()
    return S3FsStore(fs, fs._strip_protocol(url), url, options)


def _new_session() -> Any:
    import aiobotocore.session

    return aiobotocore.session.AioSession()


#: one aiobotocore session per process: it caches the parsed S3 service model, so opening a
#: store does not parse it again (clients stay per store and per loop); dropped by
#: ``ckptfs.close()`` and in a forked child
SESSION: Resource[Any] = Resource("the aiobotocore session", _new_session, close=lambda _: None)


def _shared_session() -> Any:
    """The process's aiobotocore session (``SESSION``)."""
    return RUNTIME.get(SESSION)


class S3FsStore(FsspecStore):
    """A checkpoint root in an S3 bucket, through an asynchronous ``s3fs.S3FileSystem``."""

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self._p(path))
        return bucket, key

    async def get(self, path: str) -> Buffer:
        """One GET (s3fs would HEAD first to split large objects; whole-file reads here are
        indexes, metadata and encoded chunks)."""
        async with self.semaphore:
            data = await self._call(self.fs._cat_file, path, max_concurrency=1)
        self.stats.add_read(len(data))
        return data

    streams_parts = True

    async def put(self, path: str, parts: Sequence[Part]) -> None:
        """One PUT up to ``part_size`` bytes; above, a multipart upload that copies one part at a
        time (``upload_concurrency`` per file, all within the store's byte budget)."""
        total = total_bytes(parts)
        size = part_size_for(total, self.options.part_size)
        if total <= size:
            async with self.budget.hold(total):
                data = await joined(parts)
                async with self.semaphore:
                    await self._call(self.fs._pipe_file, path, data, chunksize=max(total, 1))
        else:
            await self._multipart(path, parts, size)
        self._wrote(path, total)

    async def _multipart(self, path: str, parts: Sequence[Part], size: int) -> None:
        bucket, key = self._split(path)
        mpu = await self._s3("create_multipart_upload", path, Bucket=bucket, Key=key)
        upload_id = mpu["UploadId"]
        etags: dict[int, str] = {}
        slots = asyncio.Semaphore(self.options.upload_concurrency)

        async def upload(number: int, piece: list[memoryview]) -> None:
            try:
                nbytes = sum(v.nbytes for v in piece)
                async with self.budget.hold(nbytes):
                    body = join(piece)
                    r = await self._s3("upload_part", path, Bucket=bucket, Key=key,
                                       UploadId=upload_id, PartNumber=number, Body=body)
                etags[number] = r["ETag"]
            finally:
                slots.release()

        tasks: list[asyncio.Task] = []
        try:
            number = 0
            async for piece in pieces_async(parts, size):
                number += 1
                await slots.acquire()  # at most upload_concurrency pieces exist at once
                if any(t.done() and t.exception() for t in tasks):
                    break
                tasks.append(asyncio.create_task(upload(number, piece)))
            await asyncio.gather(*tasks)
            done = {"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]}
            await self._complete(path, bucket, key, upload_id, done, total_bytes(parts))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                                       UploadId=upload_id)
            except Exception:
                pass  # best effort; a lifecycle rule reaps what is left
            raise

    async def _complete(self, path: str, bucket: str, key: str, upload_id: str,
                        done: dict, total: int) -> None:
        attempts = 0

        async def once():
            nonlocal attempts
            attempts += 1
            async with self.semaphore:
                return await self.fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key,
                                              UploadId=upload_id, MultipartUpload=done)

        try:
            await self._retry(once, path)
        except FileNotFoundError:
            # NoSuchUpload after a retry: the first attempt completed but its answer was lost
            if attempts < 2 or await self.size(path) != total:
                raise

    async def _s3(self, method: str, path: str, **kwargs) -> Any:
        async def once():
            async with self.semaphore:
                return await self.fs._call_s3(method, **kwargs)

        try:
            return await self._retry(once, path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.full_path(path)}: no such file or bucket") from None
        except PermissionError as e:
            raise PermissionError(f"{self.full_path(path)}: access denied ({e})") from e

    async def delete(self, paths: Sequence[str]) -> None:
        """Bulk DeleteObjects, 1000 keys per request; missing keys are ignored, other per-key
        failures raise naming the key."""
        if not paths:
            return
        bucket, _ = self._split(paths[0])
        keys = [self._split(p)[1] for p in paths]

        async def batch(ks: list[str]) -> None:
            out = await self._s3("delete_objects", paths[0], Bucket=bucket,
                                 Delete={"Objects": [{"Key": k} for k in ks], "Quiet": True})
            errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                e = errors[0]
                raise StorageError(f"s3://{bucket}/{e.get('Key')}: delete failed: {e.get('Code')} "
                              f"{e.get('Message', '')} ({len(errors)} key(s) failed)")

        await gather_all(*(batch(keys[i:i + 1000]) for i in range(0, len(keys), 1000)))
        self.fs.invalidate_cache()
