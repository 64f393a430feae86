"""The runs of a storage root: listing them, the forks that use a run's objects, and deleting
a run while keeping what its forks still reference (a tombstone)."""

from __future__ import annotations

from typing import Any

from storage.lineage import ForkPoint
from storage.store import RUN_ID, RunStore


# ------------------------------------------------------------------ runs of a storage root
def runs_under(cfg: Any) -> dict[str, dict[str, Any]]:
    """Every run under `cfg.root` (a StorageConfig): run id -> its run.json."""
    probe = RunStore(cfg, "probe")
    root = probe.path.rsplit("/", 1)[0]
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in probe.fs.ls(root, detail=False)]
    except FileNotFoundError:
        return {}
    out = {}
    for name in sorted(names):
        if RUN_ID.match(name) and (doc := RunStore(cfg, name).read_run()) is not None:
            out[name] = doc
    return out


def forks_of(runs: dict[str, dict[str, Any]], run_id: str) -> dict[str, dict[str, Any]]:
    """The runs whose parent is `run_id` (deleted ones too while they hold objects): their
    lineage records."""
    return {
        r: d["lineage"] for r, d in runs.items() if (d.get("lineage") or {}).get("parent") == run_id
    }


def used_by_forks(store: RunStore, forks: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The directories of `store` that forks reference: rel dir -> the forks using it."""
    used: dict[str, list[str]] = {}
    for fork, lin in sorted(forks.items()):
        at = ForkPoint.parse(lin["at"])
        dirs = [store.checkpoint_dir(int(c)) for c in lin["checkpoints"]]
        for step in lin["steps"]:
            try:
                names = store.fs.ls(store.fs_path(f"steps/{step}"), detail=False)
            except FileNotFoundError:
                names = []
            for p in names:
                stage = p.rstrip("/").rsplit("/", 1)[-1]
                if at.inherits(int(step), stage):
                    dirs.append(f"steps/{step}/{stage}")
        for d in dirs:
            used.setdefault(d, []).append(fork)
    return used


def _size(store: RunStore, rel: str) -> int:
    try:
        return int(store.fs.du(store.fs_path(rel), total=True))
    except FileNotFoundError:
        return 0


def _step_dirs(store: RunStore) -> set[str]:
    try:
        subs = store.fs.ls(store.fs_path("steps"), detail=False)
    except FileNotFoundError:
        return set()
    return {f"steps/{p.rstrip('/').rsplit('/', 1)[-1]}" for p in subs}


def _object_dirs(store: RunStore) -> list[str]:
    """The stage and checkpoint directories a run holds itself."""
    out = []
    for top in ("steps", "checkpoints"):
        try:
            subs = store.fs.ls(store.fs_path(top), detail=False)
        except FileNotFoundError:
            continue
        for sub in subs:
            name = sub.rstrip("/").rsplit("/", 1)[-1]
            if top == "checkpoints":
                out.append(f"checkpoints/{name}")
                continue
            for p in store.fs.ls(sub, detail=False):
                out.append(f"steps/{name}/{p.rstrip('/').rsplit('/', 1)[-1]}")
    return out


def _prune(store: RunStore, doc: dict[str, Any], used: dict[str, list[str]]) -> int:
    """Remove what no fork uses; returns the bytes removed. With nothing used the whole run
    goes; otherwise its run.json stays, marked deleted, naming the forks that hold it."""
    import time

    from storage.store import MARKER

    before = _size(store, "")
    if not used:
        store.remove("")
        return before
    for rel in _object_dirs(store):
        if rel not in used:
            store.remove(f"{rel}/{MARKER}")  # marker first: never half a committed dir
            store.remove(rel)
    steps_kept = {rel.rsplit("/", 1)[0] for rel in used}
    for rel in {rel.rsplit("/", 1)[0] for rel in _object_dirs(store)} | _step_dirs(store):
        if rel.startswith("steps/") and rel not in steps_kept:
            store.remove(rel)  # an emptied step folder (a local disk keeps folders)
    for rel in ("final", "latest.json"):
        store.remove(rel)
    holders = sorted({f for forks in used.values() for f in forks})
    store.write_run({**doc, "deleted": {"at": time.time(), "kept_for": holders}})
    return before - _size(store, "")


def delete_run(cfg: Any, run_id: str) -> dict[str, Any]:
    """Delete run `run_id` under `cfg.root` (a StorageConfig), except the objects its forks
    use: those stay, with a run.json that says the run is deleted (it can no longer be
    resumed or forked) and which forks hold them; they go when no fork uses them any more.
    A deleted ancestor is pruned to what its remaining forks use. Returns {removed_bytes,
    kept_bytes, kept: {dir: [forks]}, also_removed: [deleted ancestors now gone]}."""
    from storage.lease import refuse_if_trained
    from storage.store import RunStore

    store = RunStore(cfg, run_id)
    doc = store.read_run()
    if doc is None or doc.get("deleted"):
        raise FileNotFoundError(
            f"no run {run_id!r} under {cfg.root}" + (" (deleted already)" if doc else "")
        )
    refuse_if_trained(store, cfg.lease_timeout_s, "deleting it")
    runs = runs_under(cfg)
    used = used_by_forks(store, forks_of(runs, run_id))
    out: dict[str, Any] = {
        "kept": used,
        "removed_bytes": _prune(store, doc, used),
        "also_removed": [],
    }
    out["kept_bytes"] = _size(store, "") if used else 0
    if used:
        return out
    runs.pop(run_id)
    parent = (doc.get("lineage") or {}).get("parent")
    while parent in runs and runs[parent].get("deleted"):  # it kept objects for this run
        pstore = RunStore(cfg, parent)
        left = used_by_forks(pstore, forks_of(runs, parent))
        out["removed_bytes"] += _prune(pstore, runs[parent], left)
        if left:
            break
        out["also_removed"].append(parent)
        parent = (runs.pop(parent).get("lineage") or {}).get("parent")
    return out
