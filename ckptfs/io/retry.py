"""Retries of transient storage errors: exponential backoff with full jitter, bounded.

Transient: HTTP 5xx, 408/429, throttling (SlowDown), connection resets and drops, timeouts, an
answer's JSON body that does not parse.
Permanent (fail at once): 403, 404, existing objects on create, bad requests. The object-store
engines' own retry loops are turned down to one attempt so that this layer is the one place
where retries happen (and can be tested).
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import random
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ckptfs.errors import StorageError

T = TypeVar("T")

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "TooManyRequestsException", "RequestLimitExceeded", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "BandwidthLimitExceeded",
})
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
              NotADirectoryError, ValueError, TypeError, KeyError)
_STATUS_IN_TEXT = re.compile(r"(?:status(?: code)?|HTTP)[:= ]+(\d{3})\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry a transient error."""

    retries: int = 5  #: extra attempts after the first (0: no retries)
    base_delay: float = 0.2  #: seconds; the cap doubles per attempt
    max_delay: float = 10.0  #: upper bound of one wait

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full-jitter backoff before retry ``attempt`` (0-based): uniform in [0, cap]."""
        cap = min(self.max_delay, self.base_delay * (2 ** attempt))
        return (rng or random).uniform(0.0, cap)


def _chain(exc: BaseException):
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _client_error_transient(e: BaseException) -> bool | None:
    """Classify a botocore ClientError by HTTP status and error code (None: not one)."""
    resp = getattr(e, "response", None)
    if not isinstance(resp, dict) or "Error" not in resp:
        return None
    code = str(resp.get("Error", {}).get("Code", ""))
    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in TRANSIENT_CODES:
        return True
    if isinstance(status, int):
        return status in TRANSIENT_STATUS
    return code.isdigit() and int(code) in TRANSIENT_STATUS


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of the botocore ClientError in ``exc``'s chain, or None."""
    for e in _chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def _network_types() -> tuple[type[BaseException], ...]:
    # a JSON answer that does not parse (gcsfs reads every answer of GCS's JSON API) was
    # damaged on the way: inside a store request no other JSON is parsed
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError,
                                         socket.timeout, http.client.IncompleteRead,
                                         http.client.RemoteDisconnected, json.JSONDecodeError]
    try:
        import aiohttp

        types.append(aiohttp.ClientError)
    except ImportError:  # pragma: no cover
        pass
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import (
            FlexibleChecksumError,
            HTTPClientError,
            IncompleteReadError,
            ResponseStreamingError,
        )

        # a body whose checksum does not match the one the response announced was damaged or
        # cut on the way (or read while the object was being replaced): read it again
        types += [BotoConnectionError, HTTPClientError, ResponseStreamingError, IncompleteReadError,
                  FlexibleChecksumError]
    except ImportError:  # pragma: no cover
        pass
    try:
        from fsspec.exceptions import FSTimeoutError

        types.append(FSTimeoutError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_NETWORK: tuple[type[BaseException], ...] | None = None


def is_transient(exc: BaseException) -> bool:
    """True if retrying ``exc`` may succeed (5xx, throttling, drops, timeouts). The first error
    of ``exc``'s chain (itself, then its causes and contexts) that says either way decides: an
    error raised while handling another (a re-read after a refused create) is judged by itself,
    not by the one it was raised during."""
    global _NETWORK
    if _NETWORK is None:
        _NETWORK = _network_types()
    for i, e in enumerate(_chain(exc)):
        verdict = _client_error_transient(e)
        if verdict is None and isinstance(e, _NETWORK):
            verdict = True
        if verdict is None:
            verdict = _obstore_transient(e)
        if verdict is None and isinstance(e, OSError) and e.errno in (
                errno.EBUSY, errno.EREMOTEIO, errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE):
            verdict = True
        if verdict is None and i == 0 and isinstance(e, _PERMANENT) and not _cause_is_client(e):
            verdict = False
        if verdict is not None:
            return verdict
    return False


def _cause_is_client(e: BaseException) -> bool:
    """``e`` translates a botocore ClientError (s3fs: its status then decides)."""
    return any(_client_error_transient(x) is not None for x in _chain(e))


def status_in_text(e: BaseException) -> int | None:
    """The HTTP status an error's message names ("status code: 403"), or None."""
    m = _STATUS_IN_TEXT.search(str(e))
    return int(m.group(1)) if m else None


def _obstore_transient(e: BaseException) -> bool | None:
    mod = type(e).__module__ or ""
    if not mod.startswith("obstore"):
        return None
    name = type(e).__name__
    if name in ("NotFoundError", "AlreadyExistsError", "PermissionDeniedError",
                "UnauthenticatedError", "PreconditionError", "NotModifiedError",
                "NotSupportedError", "InvalidPathError", "UnknownConfigurationKeyError"):
        return False
    text = str(e)
    m = _STATUS_IN_TEXT.search(text)
    if m:
        return int(m.group(1)) in TRANSIENT_STATUS or int(m.group(1)) >= 500
    # a GenericError without a status: connection errors, timeouts, body errors
    return name == "GenericError"


async def retrying(op: Callable[[], Awaitable[T]], what: str, policy: RetryPolicy, *,
                   on_retry: Callable[[BaseException], None] | None = None,
                   sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> T:
    """Await ``op()``; retry transient failures per ``policy``. Permanent errors propagate at
    once; exhausted retries raise StorageError naming ``what`` and the last error."""
    attempt = 0
    while True:
        try:
            return await op()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not is_transient(e):
                raise
            if attempt >= policy.retries:
                raise StorageError(
                    f"{what}: still failing after {attempt + 1} attempt(s): {type(e).__name__}: {e}"
                ) from e
            if on_retry is not None:
                on_retry(e)
            await sleep(policy.delay(attempt))
            attempt += 1
