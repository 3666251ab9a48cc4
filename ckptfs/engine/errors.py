"""The public API's error boundary: every failure leaves ckptfs as a ``CkptfsError``.

Layers below raise ckptfs errors where they know what is at fault (a key, a chunk, a file).
What still escapes as a builtin error at the boundary is storage's: a permission refusal
becomes ``AccessDeniedError``, any other ``OSError`` a ``StorageError``, a short read an
``IntegrityError``; each keeps the original as ``__cause__`` and its message (which names the
URL or file).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ckptfs.errors import AccessDeniedError, CkptfsError, IntegrityError, StorageError


def translate(e: BaseException, url: str) -> BaseException:
    """The ckptfs error for ``e`` (itself when it already is one, or is not an I/O failure)."""
    if isinstance(e, CkptfsError):
        return e
    if isinstance(e, PermissionError):
        return AccessDeniedError(f"{url}: {e}")
    if isinstance(e, EOFError):
        return IntegrityError(f"{url}: {e}")
    if isinstance(e, OSError):
        return StorageError(f"{url}: {type(e).__name__}: {e}")
    return e


@contextmanager
def public_errors(url: str) -> Iterator[None]:
    """Raise what escapes the block as a ckptfs error (see ``translate``)."""
    try:
        yield
    except Exception as e:
        out = translate(e, url)
        if out is e:
            raise
        raise out from e
