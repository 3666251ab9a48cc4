"""Optional dependencies: a missing one raises ``MissingExtraError`` naming the extra to install.

The core install (``pip install ckptfs``) covers local files and every fsspec protocol whose
client is installed. S3 through s3fs, obstore and the zarr backends need their extras; their
modules are imported only on the code path that uses them, inside ``optional_dependency()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from ckptfs.errors import ConfigError

#: top-level module -> the extra of ``pip install 'ckptfs[<extra>]'`` that provides it
EXTRAS: dict[str, str] = {
    "s3fs": "s3",
    "aiobotocore": "s3",
    "botocore": "s3",
    "obstore": "obstore",
    "zarr": "zarr",
    "numcodecs": "zarr",
    "ml_dtypes": "zarr",
    "huggingface_hub": "hf",
}


class MissingExtraError(ConfigError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it.

    Also an ``ImportError``, so code that skips an unusable plugin skips this one too.
    """


def extra_for(module: str) -> str | None:
    """The extra that installs ``module`` (a dotted name), or None if it is not optional."""
    return EXTRAS.get(module.split(".")[0])


def missing_extra(module: str, needed_for: str = "") -> MissingExtraError:
    """The error for a missing optional ``module``."""
    extra = extra_for(module) or "all"
    what = f" (needed for {needed_for})" if needed_for else ""
    return MissingExtraError(
        f"the optional dependency {module.split('.')[0]!r} is not installed{what}: "
        f"pip install 'ckptfs[{extra}]'"
    )


@contextmanager
def optional_dependency(needed_for: str = "") -> Iterator[None]:
    """Turn a ModuleNotFoundError of an optional module inside the block into MissingExtraError."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name is None or extra_for(e.name) is None:
            raise
        raise missing_extra(e.name, needed_for) from e


def import_optional(module: str, needed_for: str = "") -> ModuleType:
    """``importlib.import_module(module)``, a missing optional dependency raising MissingExtraError."""
    with optional_dependency(needed_for):
        return importlib.import_module(module)
