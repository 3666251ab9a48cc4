"""The ckptfs exception hierarchy: every error names the key, file or field at fault."""

from __future__ import annotations


class CkptfsError(Exception):
    """Base class of every error ckptfs raises on purpose."""


class CheckpointNotFoundError(CkptfsError, FileNotFoundError):
    """No committed checkpoint (no index) at the URL."""


class CheckpointExistsError(CkptfsError, FileExistsError):
    """A committed checkpoint already exists and overwrite was not requested."""


class ReferencedCheckpointError(CkptfsError):
    """A checkpoint to delete is the base of another (a delta checkpoint references its files);
    nothing was deleted. The message names the referencing checkpoints."""


class SaveInProgressError(CheckpointExistsError):
    """Another save to the same URL holds its lock (it runs now, or died within the lease)."""


class FormatVersionError(CkptfsError):
    """The index has a format version, feature or backend this reader does not know."""


class UnknownBackendError(FormatVersionError):
    """No backend is registered for a (name, version) pair."""


class ConfigError(CkptfsError, ValueError):
    """An argument or setting has a bad value (option fields, throttle_uploads, work_dir...)."""


class BackendOptionsError(ConfigError):
    """A backend option is unknown or has a bad value."""


class UsageError(ConfigError):
    """A tool's arguments cannot work together (the ``ckptfs`` command exits with status 2)."""


class MalformedIndexError(CkptfsError):
    """The index file is malformed: a field is missing or has the wrong type."""


class ForbiddenGlobalError(CkptfsError):
    """A foreign pickle names a global outside the allowlist; nothing from it was executed."""


class UnsupportedValueError(CkptfsError, TypeError):
    """A state-dict entry has a type ckptfs cannot store."""


class MismatchError(CkptfsError, ValueError):
    """Shape, dtype or kind of a target entry differs from the checkpoint."""


class ShardingError(CkptfsError, ValueError):
    """The shards of a key do not tile its global tensor, or ranks disagree about it."""


class MissingKeysError(CkptfsError, KeyError):
    """strict=True and keys of the target state dict are not in the checkpoint."""

    def __init__(self, url: str, keys: list[str]) -> None:
        self.keys = keys
        shown = ", ".join(repr(k) for k in keys[:20])
        more = f" (+{len(keys) - 20} more)" if len(keys) > 20 else ""
        super().__init__(f"checkpoint {url} lacks {len(keys)} key(s) of the target: {shown}{more}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class IntegrityError(CkptfsError):
    """Stored bytes do not match their checksum or their recorded size."""


class StorageError(CkptfsError, OSError):
    """A storage request failed: still failing after all retries, or refused for good."""


class AccessDeniedError(StorageError, PermissionError):
    """The storage refused access (HTTP 403, a local permission error): not retried."""


class ReadOnlyStoreError(StorageError, PermissionError):
    """A write or delete reached a read-only store; refused before any request."""


class RankError(CkptfsError):
    """One or more ranks failed; the message lists each rank's error."""

    def __init__(self, what: str, errors: dict[int, str]) -> None:
        self.errors = errors
        lines = "\n".join(f"  rank {r}: {msg}" for r, msg in sorted(errors.items()))
        super().__init__(f"{what} failed on {len(errors)} rank(s):\n{lines}")


class CollectiveError(RankError):
    """A collective of a phase failed: a rank died, hung, or never joined within the timeout."""

    def __init__(self, what: str, cause: str) -> None:
        self.errors = {}
        CkptfsError.__init__(self, f"{what}: {cause}")


class NonFiniteError(CkptfsError, ValueError):
    """A save with ``check_finite=True`` found NaN or infinite elements: nothing was committed.
    ``found`` maps each key to its (NaN count, infinity count) over the chunks checked."""

    def __init__(self, found: dict[str, tuple[int, int]]) -> None:
        self.found = found
        keys = sorted(found)
        shown = ", ".join(f"{k!r} ({found[k][0]} NaN, {found[k][1]} inf)" for k in keys[:20])
        more = f" (+{len(keys) - 20} more)" if len(keys) > 20 else ""
        super().__init__(f"check_finite: {len(keys)} tensor(s) hold NaN or infinite elements, "
                         f"nothing was saved: {shown}{more}")


class WriterError(CkptfsError):
    """A save's writer process died or could not be started: nothing of that save was
    committed; the next save starts a new writer."""
