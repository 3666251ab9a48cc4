"""URLs of base checkpoints (formats/README.md §2.5): a reference names its base by a URL
relative to the referring checkpoint's root (``../step_100``) or an absolute one in another
place. Plain paths and ``file://`` are local; ``scheme://authority/path`` is a store URL whose
authority (an S3 bucket) a relative URL never leaves."""

from __future__ import annotations

import os
import posixpath
import re

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://[^/]*)(/.*)?$")


def split_url(url: str) -> tuple[str, str]:
    """(authority, absolute '/'-path): ``("s3://bucket", "/a/b")``; ``("", "/abs/path")`` for a
    local path (relative paths made absolute, ``file://`` dropped)."""
    m = _URL.match(url)
    if m is None:
        return "", os.path.abspath(url).replace(os.sep, "/")
    auth, path = m.group(1), posixpath.normpath(m.group(2) or "/")
    return ("" if auth == "file://" else auth), path


def is_absolute(url: str) -> bool:
    """A URL a reference records as it is (not relative to the referring root)."""
    return _URL.match(url) is not None or url.startswith("/")


def resolve_url(root: str, url: str) -> str:
    """``url`` (as an index records it) seen from the checkpoint at ``root``."""
    if is_absolute(url):
        return url
    auth, path = split_url(root)
    return auth + posixpath.normpath(posixpath.join(path, url))


def relative_url(target: str, root: str) -> str:
    """How the checkpoint at ``root`` records ``target``: relative where both are in one place
    (the same local file system, the same bucket), else ``target`` absolute."""
    at, pt = split_url(target)
    ar, pr = split_url(root)
    if at != ar:
        return target
    return posixpath.relpath(pt, pr)
