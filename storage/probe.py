"""What `storage.root` can do, checked in seconds before a run starts (`check_storage`),
and whether it can give a run one writer (`check_conditional_create`)."""

from __future__ import annotations

import os
import tempfile
import uuid

import fsspec

from hybrid_engine.config import StorageConfig
from storage.errors import ConditionalWriteError, unfit_line
from storage.store import RunStore, storage_options


def check_conditional_create(store: RunStore, rel: str) -> None:
    """Create the object `rel` of `store` twice, conditionally, then delete it: the first
    must succeed and the second find it there. Raises ConditionalWriteError (one line
    naming storage.root) for a store that ignores the condition or rejects it."""
    try:
        if not store.create(rel, b"first"):
            raise ConditionalWriteError(
                f"storage.root={store.cfg.root!r}: the probe object {store.uri(rel)} exists"
            )
        if store.create(rel, b"second"):
            raise ConditionalWriteError(unfit_line(store.cfg.root, "ignores"))
    finally:
        store.remove(rel)


def check_storage(cfg: StorageConfig) -> None:
    """`storage.root` can take a run, checked in seconds: a local directory is created if
    missing and must be writable; on S3 the bucket must answer within storage.timeout_s
    (one attempt); either must create an object only if none exists, unless
    storage.single_driver (`check_conditional_create`). Raises one line naming
    storage.root."""
    root = cfg.root
    if not root.startswith("s3://"):
        path = os.path.abspath(root)
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
                pass
        except OSError as e:
            raise PermissionError(f"storage.root={root!r} is not writable: {e.strerror}") from None
        _probe(cfg)
        return
    opts = storage_options(cfg)
    opts["config_kwargs"]["retries"] = {"max_attempts": 1, "mode": "standard"}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    bucket = root.removeprefix("s3://").split("/")[0]
    where = f" at {opts['endpoint_url']}" if "endpoint_url" in opts else ""
    try:
        fs.ls(bucket, refresh=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"storage.root={root!r}: no bucket {bucket!r}{where}") from None
    except PermissionError as e:
        raise PermissionError(f"storage.root={root!r}: access denied{where} ({e})") from None
    except Exception as e:  # connection refused, timeouts, DNS: botocore's and aiohttp's own
        raise ConnectionError(
            f"storage.root={root!r}: the S3 endpoint{where} does not answer "
            f"({type(e).__name__}; storage.timeout_s={cfg.timeout_s:g})"
        ) from None
    _probe(cfg)


def _probe(cfg: StorageConfig) -> None:
    if cfg.single_driver:
        return
    probe = RunStore(cfg, f"hybridrl-probe-{uuid.uuid4().hex[:12]}")
    try:
        check_conditional_create(probe, "conditional-create")
    finally:
        probe.remove("")
