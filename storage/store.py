"""A run's stage state on any fsspec URL: a local directory (default `runs`) or
`s3://bucket/prefix` (s3fs, any S3-compatible endpoint).

    <root>/<run_id>/
      run.json                     resolved config, code version, created time
      steps/<N>/<stage>/           batch.safetensors + batch.json (the stage's output batch),
                                   meta.json (metrics, small facts), COMMITTED
      checkpoints/step_<N>/        actor/ (critic/) weights, optimizer, scheduler, RNG,
                                   meta.json (step, weights version, driver state), COMMITTED
      latest.json                  last committed (step, stage) and last checkpoint
      final/                       the trained policy (HF safetensors + tokenizer), summary.json

A fork (`storage.lineage`) holds only what it computed itself; the stages and checkpoints it
inherits are read from its parent's objects, which its run.json references by their sums.

A stage is written object by object, then committed by one `COMMITTED` object holding the
sha256 of every object (one PUT on S3; write-then-rename on a local disk). Readers trust
only committed stages and check every object against its sum: a half-written stage is
invisible, a corrupted one is reported (naming the object) and redone. Tensors go to
safetensors, the rest to JSON: nothing stored can run code when read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hybrid_engine.batch import JSON_FILE, TENSORS_FILE, Batch
from hybrid_engine.config import StorageConfig
from hybrid_engine.errors import NO_SPACE
from hybrid_engine.files import pipe, sha256
from storage.errors import ConditionalWriteError, LeaseHeld, unfit_line
from storage.faults import fault_point
from storage.lineage import Lineage

log = logging.getLogger("hybridrl.storage")

MARKER = "COMMITTED"
# how a store that cannot create conditionally answers (S3 501 NotImplemented is ENOSYS,
# 400 InvalidRequest EINVAL; a filesystem without hard links EPERM or EOPNOTSUPP)
UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}
LEASE_DIR = "lease"  # the run's lease (storage.lease): the one prefix its guard lets through
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class _Critical(threading.local):
    """`with critical():` a storage write that a SIGTERM must not interrupt: the handler
    (tasks.preemption.preemption) sees `depth` and leaves `pending` set, and the write's end
    calls `on_exit`, which raises then. Per thread: the handler runs in the main thread and
    waits only for its writes (a rollout committing in another thread is not interrupted)."""

    def __init__(self) -> None:
        self.depth, self.pending = 0, False
        self.on_exit: Any = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.on_exit is not None:
                self.on_exit()


critical = _Critical()


def validate_run_id(run_id: str) -> str:
    """A run id is one path segment: 1-128 of [A-Za-z0-9._-], starting with a letter or digit."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id) or ".." in run_id:
        raise ValueError(
            f"run id {run_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (no '/', no '..')"
        )
    return run_id


def new_run_id(config_path: str | None) -> str:
    """`<preset>-<YYYYmmdd-HHMMSS>` for a run started without a given id."""
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "run"
    return validate_run_id(f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")


def storage_options(cfg: StorageConfig, credentials: bool = False) -> dict[str, Any]:
    """fsspec options for `cfg.root`. S3 credentials are read from the environment only,
    and only passed on (`credentials=True`) to processes that may not share it (Ray
    workers); otherwise s3fs finds them itself (environment or the AWS chain)."""
    if not cfg.root.startswith("s3://"):
        return {}
    opts: dict[str, Any] = {
        "config_kwargs": {
            "connect_timeout": cfg.timeout_s,
            "read_timeout": cfg.timeout_s,
            "retries": {"max_attempts": cfg.retries + 1, "mode": "standard"},
        },
    }
    endpoint = cfg.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint_url"] = endpoint
    if credentials:
        for opt, var in (
            ("key", "AWS_ACCESS_KEY_ID"),
            ("secret", "AWS_SECRET_ACCESS_KEY"),
            ("token", "AWS_SESSION_TOKEN"),
        ):
            if os.environ.get(var):
                opts[opt] = os.environ[var]
    return opts


def check_reach(cfg: StorageConfig, nodes: set[str]) -> None:
    """Every Ray node that reads or writes the run (the driver's and the pool workers') must
    see the same `storage.root`: a local directory is refused when they are several nodes,
    unless `storage.shared_filesystem` says every node mounts it. One line naming the keys."""
    if len(nodes) <= 1 or cfg.root.startswith("s3://") or cfg.shared_filesystem:
        return
    raise ValueError(
        f"storage.root={cfg.root!r} is a local directory but the pool and this driver are on "
        f"{len(nodes)} Ray nodes, which would each write their own: use s3://... or, if every "
        "node mounts that path (NFS, Lustre, ...), set storage.shared_filesystem=true"
    )


@dataclass
class Stage:
    """A committed stage: its output batch (None for stages that only hold metrics) and meta."""

    batch: Batch | None
    meta: dict[str, Any]
    uri: str


class RunStore:
    """The objects of one run under `<root>/<run_id>`."""

    def __init__(self, cfg: StorageConfig, run_id: str) -> None:
        self.cfg = cfg
        self.run_id = validate_run_id(run_id)
        self.url = f"{cfg.root.rstrip('/')}/{run_id}"
        self.fs, self.path = fsspec.core.url_to_fs(self.url, **storage_options(cfg))
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            self.url = self.path = os.path.abspath(self.path)
        self._latest: dict[str, Any] | None = None
        self._lineage: Lineage | None | bool = False  # False: run.json not read yet
        # the lease (`RunLease.fence`), called before every write that changes the run:
        # LeaseHeld once the run is not this driver's (pickled, it reads the lease)
        self.guard: Callable[[], None] | None = None
        self.generation: int | None = None  # the lease generation this store writes as

    def check_lease(self) -> None:
        """Raise LeaseHeld when this store's driver no longer holds the run."""
        if self.guard is not None:
            self.guard()

    def _writing(self, rel: str) -> None:
        """Before any write or delete of `rel`: the lease's own objects aside, refused once
        the lease is lost, so that nothing is touched."""
        if not rel.startswith(f"{LEASE_DIR}/"):
            self.check_lease()

    # ------------------------------------------------------------- objects
    def uri(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def fs_path(self, rel: str) -> str:
        """`rel` as a path on the store's filesystem (`self.fs`), for listing and sizes."""
        return f"{self.path}/{rel}"

    def put(self, rel: str, data: bytes, atomic: bool = False) -> str:
        """Write one object; returns its sha256. `atomic` matters on a local disk only
        (an S3 PUT is all or nothing): write a temporary file, then rename it; a failed
        write (a full disk) leaves no temporary file. A SIGTERM waits for the write."""
        self._writing(rel)
        path = self.fs_path(rel)
        with critical():
            if self.local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if atomic:
                    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
                    try:
                        with os.fdopen(fd, "wb") as f:
                            f.write(data)
                        os.replace(tmp, path)
                    except BaseException as e:
                        with contextlib.suppress(OSError):
                            os.unlink(tmp)
                        if getattr(e, "errno", None) in NO_SPACE:
                            raise OSError(
                                e.errno, f"{e.strerror}: writing {self.uri(rel)}"
                            ) from None
                        raise
                    return sha256(data)
            return pipe(self.fs, path, data, self.uri(rel))

    def create(self, rel: str, data: bytes) -> bool:
        """Write an object only if none exists there (locally a hard link, which fails where
        a file exists; on S3 a PUT with `If-None-Match: *`): False when one does. Of two
        writers racing, one gets True."""
        self._writing(rel)
        path = self.fs_path(rel)
        if self.cfg.single_driver:  # no conditional create: one driver, by declaration
            if self.exists(rel):
                return False
            self.put(rel, data, atomic=True)
            return True
        with critical():
            try:
                if self.local:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
                    try:  # written whole, then linked: a reader never sees half of it
                        with os.fdopen(fd, "wb") as f:
                            f.write(data)
                        os.link(tmp, path)
                    finally:
                        os.unlink(tmp)
                else:
                    self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in UNSUPPORTED:
                    raise
                why = f"rejects ({type(e).__name__}: {e})"
                raise ConditionalWriteError(unfit_line(self.cfg.root, why)) from None
            return True

    def list(self, rel_dir: str) -> list[str]:
        """Names of the objects directly under `rel_dir` ([] when there are none)."""
        try:
            return [
                p.rstrip("/").rsplit("/", 1)[-1]
                for p in self.fs.ls(self.fs_path(rel_dir), detail=False, refresh=True)
            ]
        except FileNotFoundError:
            return []

    def get(self, rel: str) -> bytes:
        return self.fs.cat_file(self.fs_path(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.fs_path(rel))

    def get_json(self, rel: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.get(rel))
        except FileNotFoundError:
            return None

    def put_json(self, rel: str, doc: dict[str, Any]) -> str:
        data = json.dumps(doc, indent=1, sort_keys=True).encode()
        return self.put(rel, data, atomic=True)

    def remove(self, rel: str) -> None:
        self._writing(rel)
        with critical():
            if self.fs.exists(self.fs_path(rel)):
                self.fs.rm(self.fs_path(rel), recursive=True)

    # ------------------------------------------------------------- commits
    def commit(self, rel_dir: str, files: dict[str, str], meta: dict[str, Any]) -> str:
        """Make `rel_dir` visible: one marker object naming every file and its sha256, and
        the lease generation that wrote it. The marker is created conditionally (the caller
        removed an old one first): a rival's marker is never replaced."""
        doc = {"files": files, "committed_at": time.time(), "writer_pid": os.getpid(), **meta}
        if self.generation is not None:
            doc["generation"] = self.generation
        data = json.dumps(doc, indent=1, sort_keys=True).encode()
        if not self.create(f"{rel_dir}/{MARKER}", data):
            rival = (self._own_marker(rel_dir) or {}).get("generation")
            raise LeaseHeld(
                f"run {self.run_id}: {rel_dir} was committed by another driver (lease "
                f"generation {rival}) while this one wrote it; this driver stops without "
                "writing more"
            )
        return self.uri(rel_dir)

    def _own_marker(self, rel_dir: str) -> dict[str, Any] | None:
        try:
            doc = self.get_json(f"{rel_dir}/{MARKER}")
        except json.JSONDecodeError:
            return None
        return doc if doc and isinstance(doc.get("files"), dict) else None

    def locate(self, rel_dir: str) -> RunStore:
        """The store whose objects a committed directory is: this run's own, or for a fork
        the ancestor's it inherits them from (this run when neither holds it)."""
        if self._own_marker(rel_dir) is not None or self.lineage is None:
            return self
        source = self.lineage.source(rel_dir)
        return self if source is None else source.locate(rel_dir)

    def marker(self, rel_dir: str) -> dict[str, Any] | None:
        """The marker of a committed directory, own or inherited (None if there is none or
        it is unreadable)."""
        if (doc := self._own_marker(rel_dir)) is not None or self.lineage is None:
            return doc
        source = self.lineage.source(rel_dir)
        return None if source is None else source.marker(rel_dir)

    def read_committed(self, rel_dir: str) -> tuple[dict[str, bytes], dict[str, Any]] | None:
        """Every object of a committed directory, checked against its sum. None when the
        directory is not committed, or when an object is missing or corrupted (warned)."""
        doc = self._own_marker(rel_dir)
        if doc is None:
            if self.lineage is not None and (source := self.lineage.source(rel_dir)):
                return source.read_committed(rel_dir)
            return None
        out = {}
        for name, want in doc["files"].items():
            try:
                data = self.get(f"{rel_dir}/{name}")
            except FileNotFoundError:
                log.warning(
                    "%s: committed but missing; the stage counts as not done",
                    self.uri(f"{rel_dir}/{name}"),
                )
                return None
            if sha256(data) != want:
                log.warning(
                    "%s: sha256 differs from the committed one (corrupted object); "
                    "the stage counts as not done",
                    self.uri(f"{rel_dir}/{name}"),
                )
                return None
            out[name] = data
        return out, doc

    # -------------------------------------------------------------- stages
    @staticmethod
    def stage_dir(step: int, stage: str) -> str:
        return f"steps/{step}/{stage}"

    def commit_stage(self, step: int, stage: str, batch: Batch | None, meta: dict[str, Any]) -> str:
        """Write a stage's output (batch + meta), then commit it; returns its URI."""
        d = self.stage_dir(step, stage)
        self.remove(f"{d}/{MARKER}")  # a stage being redone is invisible until committed
        files = {}
        if batch is not None:
            tensors, doc = batch.to_bytes()
            files[TENSORS_FILE] = self.put(f"{d}/{TENSORS_FILE}", tensors)
            files[JSON_FILE] = self.put(f"{d}/{JSON_FILE}", doc)
        files["meta.json"] = self.put(f"{d}/meta.json", json.dumps(meta, sort_keys=True).encode())
        fault_point(f"step-{step}/{stage}:before_commit")
        uri = self.commit(d, files, {"step": step, "stage": stage})
        self.set_latest(step=step, stage=stage)
        return uri

    def load_stage(self, step: int, stage: str) -> Stage | None:
        """A committed stage, checked; None if it has to be (re)done."""
        d = self.stage_dir(step, stage)
        got = self.read_committed(d)
        if got is None:
            return None
        objects, _ = got
        batch = None
        if TENSORS_FILE in objects:
            batch = Batch.from_bytes(objects[TENSORS_FILE], objects[JSON_FILE])
        return Stage(batch, json.loads(objects["meta.json"]), self.locate(d).uri(d))

    def is_committed(self, step: int, stage: str) -> bool:
        """Marker present (objects not checked: `load_stage` does that)."""
        return self.marker(self.stage_dir(step, stage)) is not None

    # --------------------------------------------------------- checkpoints
    @staticmethod
    def checkpoint_dir(step: int) -> str:
        return f"checkpoints/step_{step}"

    def commit_checkpoint(self, step: int, files: dict[str, str], meta: dict[str, Any]) -> str:
        """Commit a checkpoint whose files the workers wrote (names relative to its dir)."""
        d = self.checkpoint_dir(step)
        self.remove(f"{d}/{MARKER}")  # a checkpoint written again is invisible until committed
        files = dict(files)
        files["meta.json"] = self.put(f"{d}/meta.json", json.dumps(meta, sort_keys=True).encode())
        uri = self.commit(d, files, {"step": step})
        self.set_latest(checkpoint=step)
        return uri

    def checkpoints(self, own: bool = False) -> list[int]:
        """Steps with a committed checkpoint, oldest first (with `own`, a fork's own only)."""
        try:
            names = self.fs.ls(self.fs_path("checkpoints"), detail=False)
        except FileNotFoundError:
            names = []
        steps = set()
        for n in names:
            m = re.fullmatch(r"step_(\d+)", n.rstrip("/").rsplit("/", 1)[-1])
            if m and self.exists(f"checkpoints/{m.group(0)}/{MARKER}"):
                steps.add(int(m.group(1)))
        if not own and self.lineage is not None:
            steps |= {
                int(c)
                for c in self.lineage.checkpoints
                if self.lineage.source(self.checkpoint_dir(int(c))) is not None
            }
        return sorted(steps)

    def checkpoint_files(self, step: int) -> tuple[dict[str, str], dict[str, Any]] | None:
        """(files and sums, meta) of a committed checkpoint; the meta is checked here, the
        weight files by the workers that read them (at `locate(checkpoint_dir(N))`)."""
        d = self.checkpoint_dir(step)
        doc = self.marker(d)
        if doc is None:
            return None
        data = self.locate(d).get(f"{d}/meta.json")
        if sha256(data) != doc["files"].get("meta.json"):
            log.warning("%s/meta.json: sha256 differs from the committed one", self.uri(d))
            return None
        return doc["files"], json.loads(data)

    def drop_checkpoint(self, step: int) -> None:
        """Marker first: a half-deleted checkpoint is never mistaken for a whole one."""
        d = self.checkpoint_dir(step)
        self.remove(f"{d}/{MARKER}")
        self.remove(d)

    def prune_checkpoints(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed checkpoints of this run's own (0 = keep
        all; a fork's inherited ones are its parent's)."""
        steps = self.checkpoints(own=True)
        dropped = steps[:-keep] if keep else []
        for s in dropped:
            self.drop_checkpoint(s)
        return dropped

    # -------------------------------------------------------- run and latest
    def read_run(self) -> dict[str, Any] | None:
        return self.get_json("run.json")

    def write_run(self, doc: dict[str, Any]) -> None:
        self.put_json("run.json", doc)
        self._lineage = False

    @property
    def lineage(self) -> Lineage | None:
        """A fork's reference to its parent (None for a run that is not a fork)."""
        if self._lineage is False:
            doc = (self.read_run() or {}).get("lineage")
            self._lineage = Lineage(self, doc) if doc else None
        return self._lineage

    def read_latest(self) -> dict[str, Any] | None:
        return self.get_json("latest.json")

    def set_latest(self, **fields: Any) -> None:
        """latest.json: where the run stands (a hint for people and `resume`; the markers
        are the truth)."""
        if self._latest is None:
            self._latest = self.read_latest() or {"step": 0, "stage": None, "checkpoint": None}
        self._latest.update(fields, updated_at=time.time())
        self.put_json("latest.json", self._latest)

    # ----------------------------------------------------------------- final
    def local_dir(self, rel: str, scratch: str) -> str:
        """A local directory with the files under `rel`: the directory itself on a local
        disk, else a copy made under `scratch`."""
        if self.local:
            return self.fs_path(rel)
        target = os.path.join(scratch, rel)
        self.fs.get(self.fs_path(rel) + "/", target + "/", recursive=True)
        return target

    def put_dir(self, local_dir: str, rel: str) -> dict[str, str]:
        """Upload a local directory's files (and its folders' files) under `rel`; returns
        {path relative to `rel`: sha256}."""
        files = {}
        for folder, _, names in sorted(os.walk(local_dir)):
            for name in sorted(names):
                path = os.path.relpath(os.path.join(folder, name), local_dir)
                with open(os.path.join(folder, name), "rb") as f:
                    files[path] = self.put(f"{rel}/{path}", f.read())
        return files
