"""Error types. Each message is one line: what is wrong and what to do."""

from __future__ import annotations


class LivemigError(Exception):
    """Base class; the CLI prints `str(err)` as one line and exits non-zero."""

    exit_code = 1


class ConfigError(LivemigError):
    """Bad user input (URL, job name, flag); nothing was changed."""

    exit_code = 2


class EtcdUnavailableError(LivemigError):
    """No etcd endpoint answered in time (down, unreachable, or no quorum)."""

    exit_code = 2


class EtcdAccessError(LivemigError):
    """etcd answered and refused: wrong password, no permission, or a TLS setting it rejects.
    Not an outage: retrying does not help, so nobody rides it out."""

    exit_code = 2


class CorruptStateError(LivemigError):
    """A key only the coordinator writes, by CAS (the membership table), holds no valid
    record: nothing can be decided from it, so the run ends with this one line."""

    exit_code = 4


class EtcdBinaryNotFound(LivemigError):
    exit_code = 2


class FencedError(LivemigError):
    """The caller's incarnation was fenced: it was replaced and must stop.

    A fenced process must not write job state, serve state or join a
    communicator; the only correct reaction is to exit.
    """

    exit_code = 3


class StaleGenerationError(FencedError):
    """The caller presented an old generation: re-read the membership."""


class NotLeaderError(LivemigError):
    """A coordinator write was refused because another candidate leads."""


class RecoveryError(LivemigError):
    """A recovery could not complete (no spare, timeout, lost shard)."""

    exit_code = 4


class TransferError(LivemigError):
    """A state transfer failed (source died, checksum mismatch, refused)."""


class WithdrawnError(TransferError):
    """Every source said the item was served once and withdrawn: waiting will not bring it
    back (a migrating spare that fell behind the averages its source still keeps)."""
