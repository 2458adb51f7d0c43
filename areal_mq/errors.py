"""The error tree. Every message says what was wrong and what to do about it."""
from __future__ import annotations

import errno
import importlib
from types import ModuleType

# A full disk, the one definition (issue 52): no space, a quota, a file-size limit. Every writer that can wait for
# space (the sample store's log, the background publisher, the events sink) asks `full_disk_errno`.
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# libraries that raise their own error for a full disk with the OS error in its text (safetensors' SafetensorError:
# the 60-minute soak of 2026-11-28 saw 9 such publishes end the trainer instead of being retried in place)
FULL_DISK_TEXT = {"No space left on device": errno.ENOSPC, "os error 28": errno.ENOSPC,
                  "Disk quota exceeded": errno.EDQUOT, "os error 122": errno.EDQUOT,
                  "File too large": errno.EFBIG, "os error 27": errno.EFBIG}


def full_disk_errno(exc: BaseException) -> int | None:
    """The errno when `exc` is a full disk (an OSError, or a library's error that names one), else None."""
    if isinstance(exc, OSError):
        return exc.errno if exc.errno in FULL_DISK_ERRNOS else None
    text = str(exc)
    return next((code for marker, code in FULL_DISK_TEXT.items() if marker in text), None)


class ArealError(Exception):
    """Base of every areal-mq error."""


class ConfigError(ArealError):
    """A config file, override or CLI argument is invalid."""


class ProtocolError(ArealError):
    """A wire message could not be decoded or validated. `code` is a short machine-readable reason."""

    def __init__(self, message: str, code: str = "bad_message", msg_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.msg_id = msg_id


class BrokerUnavailable(ArealError):
    """A broker could not be reached within the deadline."""


class JobFailed(ArealError):
    """A job was answered with an Error message."""


class EngineRequestError(ArealError):
    """A generation request is invalid (empty prompt, too long, bad sampling parameters)."""


class ModelNotFound(ArealError):
    """A model name or path could not be resolved to weights + tokenizer."""


class WeightsLoadError(ArealError):
    """Published weights could not be loaded (unreadable, or the engine refused them); retrying may help."""


class WeightsBaseMismatch(WeightsLoadError):
    """A LoRA version trained on another base than the worker's: fetching it again cannot help (never retried)."""


class WeightsFetchError(WeightsLoadError):
    """Fetching published weights failed or exceeded its deadline."""


class WeightsRefused(ArealError):
    """A WeightsReady names a path or endpoint outside this run (never loaded, never retried)."""


class RewardError(ArealError):
    """A reward function failed, timed out or was misconfigured."""


class ExportError(ArealError):
    """A checkpoint cannot be exported as asked (missing, unreadable, unknown dtype, an output that exists)."""


class SecurityError(ArealError):
    """Keys are missing or unusable, or a setting would expose a socket without authentication."""


def require_extra(module: str, key: str, field: str | None = None) -> ModuleType:
    """Import `module` for the config field asking for it (default: the sink `metrics.<key>`) whose pip extra is
    `key`, or say what to install and what to unset."""
    field = field or f"metrics.{key}"
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        switch = field.startswith("metrics.")  # a metrics sink is a switch; other fields are set or left out
        raise ConfigError(
            f"{field} is {'true' if switch else 'set'} but {module!r} cannot be imported ({exc}); install it with "
            f"`pip install 'areal-mq[{key}]'` (or `pip install -e '.[{key}]'`), or "
            f"{f'set {field}: false' if switch else f'remove {field}'}"
        ) from None
