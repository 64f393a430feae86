"""The retry policy of the stage tasks: exponential backoff, for transient failures only (I/O,
network, S3); a missing file, a permission error or a full disk fails at once."""

from __future__ import annotations

import errno
import logging
from typing import Any

from hybrid_engine.config import HybridConfig


def task_options(cfg: HybridConfig) -> dict[str, Any]:
    """Retries with exponential backoff, for transient failures only."""
    p = cfg.pipeline
    return {
        "retries": p.retries,
        "retry_delay_seconds": [p.retry_delay_s * 2**i for i in range(p.retries)] or 0,
        "retry_condition_fn": retry_if_transient,
    }


NOT_TRANSIENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)


STORAGE_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def is_transient(e: BaseException) -> bool:
    """Worth retrying: I/O and network errors (S3, a connection reset, a timeout); not a
    full or read-only disk."""
    if isinstance(e, NOT_TRANSIENT) or getattr(e, "errno", None) in STORAGE_FULL:
        return False
    if isinstance(e, OSError):  # ConnectionError, TimeoutError, socket errors
        return True
    return type(e).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp")


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    error = state.result(raise_on_failure=False)
    retry = isinstance(error, BaseException) and is_transient(error)
    if not retry:
        logging.getLogger("hybridrl").error("%s failed for good: %r", task_run.name, error)
    return retry
