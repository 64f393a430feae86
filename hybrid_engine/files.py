"""Objects on any fsspec URL, as checkpoints and stage state store them: write one (its
sha256 returned; a full storage leaves no partial object and raises one line naming it),
read one back checked against the sha256 recorded when it was written (`CorruptObject`).
`models/sharding.py` writes a role's state with these and `storage/` its objects."""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any

import fsspec

from hybrid_engine.errors import NO_SPACE


class CorruptObject(ValueError):
    """A stored object whose bytes do not match the sha256 recorded when it was written."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pipe(fs: Any, path: str, data: bytes, where: str) -> str:
    """Write `data` at `path` of filesystem `fs`; returns its sha256. Out of space (or
    quota, or file size): the partial object is removed and the error names `where`."""
    try:
        fs.pipe_file(path, data)
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        with contextlib.suppress(OSError):  # a partial object would only hold space
            fs.rm(path)
        raise OSError(e.errno, f"{e.strerror}: writing {where}") from None
    return sha256(data)


def write_object(url: str, data: bytes, options: dict | None = None) -> str:
    """Write `data` to `url` (its folders made); returns its sha256."""
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    return pipe(fs, path, data, f"{url} ({len(data) / 1e6:.1f} MB)")


def read_object(url: str, options: dict | None = None, expected: dict | None = None) -> bytes:
    """Read `url`; with `expected` ({file name: sha256}) the bytes must match."""
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    data = fs.cat_file(path)
    name = url.rsplit("/", 1)[-1]
    if expected is not None and expected.get(name) != sha256(data):
        raise CorruptObject(f"{url}: sha256 differs from the one recorded at save")
    return data
