"""How a `train` flow run finds its run: a new one, one to resume, or a fork of another.

    new      the preset + overrides; the run id must be free
    resume   the run's stored config + the overrides a resume may change (where things run)
    fork     the parent's stored config + overrides that change only what the fork computes
             itself: the stages it inherits (`storage.lineage`) read the parent's values

A fork at `N/STAGE` keeps every step before N and the stages of step N before STAGE, so it
may not change what those stages read, nor what every step reads (the data, the model, the
seed): each config field declares who reads it (`hybrid_engine.config.reads_of`). Anything else it may change: a fork at
`20/advantage` may switch `algorithm.adv_estimator` or `actor.optim.lr`, not
`rollout.temperature`.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from dataclasses import dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from hybrid_engine import STAGES
from hybrid_engine.config import (
    ConfigError,
    HybridConfig,
    config_from_dict,
    flatten,
    load_config,
    reads_of,
    redact,
    redacted_keys,
)
from hybrid_engine.engine import Engine
from storage.lineage import ForkPoint, fork_manifest
from storage.semantics import SEMANTICS, as_recorded
from storage.store import RunStore, new_run_id, validate_run_id
from tasks.driver_cleanup import driver_record

# Who reads each config key, as the config's fields declare it (`json_schema_extra=reads(...)`):
# "run" (every step), a stage, "update", or "where" (what a resume may change).
READS = reads_of()


@dataclass
class OpenedRun:
    cfg: HybridConfig
    store: RunStore
    resume: bool
    lineage: dict[str, Any] | None = None  # a new fork's reference to its parent


def open_run(
    config: str | None,
    overrides: list[str],
    run_id: str | None,
    resume_from: str | None = None,
    fork_from: str | None = None,
) -> OpenedRun:
    """The run a flow run is for. With both `config` and `resume_from` (a deployment that
    resumes itself), a run that does not exist yet is started; with `fork_from` and a
    `run_id` that is already that fork, the fork is resumed."""
    if resume_from and config and not run_exists(overrides, resume_from, config):
        run_id, resume_from = resume_from, None
    if fork_from:
        parent, at = parse_fork_from(fork_from)
        if run_id and (doc := stored_run(overrides, run_id)) is not None:
            lin = doc.get("lineage") or {}
            if (lin.get("parent"), lin.get("at")) != (parent, str(at)):
                raise FileExistsError(f"run {run_id!r} exists and is not the fork {fork_from}")
            resume_from = run_id
        else:
            return open_fork(parent, at, overrides, run_id)
    if resume_from:
        cfg = resumed_config(resume_from, overrides)
        return OpenedRun(cfg, RunStore(cfg.storage, resume_from), resume=True)
    cfg = load_config(config, overrides)
    cfg.trainer.run_id = validate_run_id(run_id or cfg.trainer.run_id or new_run_id(config))
    store = RunStore(cfg.storage, cfg.trainer.run_id)
    refuse_existing(store)
    return OpenedRun(cfg, store, resume=False)


def _where(overrides: list[str]) -> HybridConfig:
    return load_config(None, [o for o in overrides if o.startswith("storage.")])


def stored_run(overrides: list[str], run_id: str) -> dict[str, Any] | None:
    return RunStore(_where(overrides).storage, validate_run_id(run_id)).read_run()


def run_exists(overrides: list[str], run_id: str, config: str | None = None) -> bool:
    where = load_config(config, overrides) if config else _where(overrides)
    return RunStore(where.storage, validate_run_id(run_id)).read_run() is not None


def _stored_config(store: RunStore, overrides: list[str]) -> tuple[HybridConfig, HybridConfig]:
    """(the run's stored config, the same with `overrides`); refuses a deleted run."""
    doc = store.read_run()
    if doc is None:
        raise FileNotFoundError(f"no run {store.run_id!r} under {store.cfg.root}")
    if doc.get("deleted"):
        raise FileNotFoundError(
            f"run {store.run_id!r} was deleted (`hybridrl runs delete`); "
            "only the objects its forks use are kept"
        )
    recorded, notes = as_recorded(doc)  # an older run's config as its code computed it
    for line in notes:
        _warn(line)
    cfg = config_from_dict(recorded, overrides)
    if missing := redacted_keys(cfg):
        raise ConfigError(
            f"{', '.join(missing)}: secret values are not recorded with a run; give them "
            "again (the whole map, e.g. HYBRIDRL_RAY__WORKER_ENV='{...}' or an override)"
        )
    return config_from_dict(recorded), cfg


def _warn(line: str) -> None:
    """A warning in the flow run's log, or this module's outside one (the CLI's checks)."""
    from prefect.exceptions import MissingContextError

    try:
        get_run_logger().warning(line)
    except MissingContextError:
        logging.getLogger(__name__).warning(line)


def resumed_config(run_id: str, overrides: list[str]) -> HybridConfig:
    """A resumed run's stored config with the overrides a resume may change."""
    store = RunStore(_where(overrides).storage, validate_run_id(run_id))
    stored, cfg = _stored_config(store, overrides)
    a, b = flatten(stored), flatten(cfg)
    changed = [k for k in b if a.get(k) != b[k] and "where" not in READS[k]]
    if changed:
        raise ConfigError(
            f"resume cannot change {', '.join(changed)} (it would change what the run "
            f"computes); start a new run, or fork it (`hybridrl fork`)"
        )
    return cfg


def parse_fork_from(text: str) -> tuple[str, ForkPoint]:
    """`RUN_ID@STEP/STAGE` -> (run id, fork point)."""
    run_id, sep, at = text.partition("@")
    if not sep:
        raise ValueError(f"fork_from={text!r}: write RUN_ID@STEP/STAGE, e.g. demo-1@20/advantage")
    return validate_run_id(run_id), ForkPoint.parse(at)


def refused_fork_changes(parent: HybridConfig, fork: HybridConfig, at: ForkPoint) -> list[str]:
    """The keys a fork at `at` changes but may not, each with the reason."""
    why = {"run": "every step reads it"}
    inherited = [s for s in STAGES if at.inherits(at.step, s)]
    for stage in inherited:
        why[stage] = (
            f"step {at.step}'s {stage} stage, which the fork takes from its parent, read it"
        )
    if "rollout" in inherited and "reward" not in why and parent.algorithm.filter_groups.enabled:
        why["reward"] = why["rollout"] + " (dynamic sampling scores inside the rollout)"
    a, b = flatten(parent), flatten(fork)
    out = []
    for key in sorted(b):
        if a.get(key) == b[key] or "where" in READS[key] or key == "trainer.run_id":
            continue
        if reason := next((why[r] for r in READS[key] if r in why), None):
            out.append(f"{key} ({reason})")
    if "rollout" in inherited and fork.greedy_baseline and not parent.greedy_baseline:
        out.append(
            f"algorithm.adv_estimator={fork.algorithm.adv_estimator} (it needs greedy "
            f"baselines, which step {at.step}'s inherited rollout did not generate)"
        )
    if fork.use_critic and not parent.use_critic:
        out.append(
            f"algorithm.adv_estimator={fork.algorithm.adv_estimator} (it needs a critic, "
            "which the parent did not train up to the fork point)"
        )
    return out


def open_fork(parent_id: str, at: ForkPoint, overrides: list[str], run_id: str | None) -> OpenedRun:
    """A new fork of `parent_id` at `at`: the parent's config with `overrides`, checked
    (`refused_fork_changes`), and the lineage record its run.json will hold."""
    parent = RunStore(_where(overrides).storage, parent_id)
    stored, cfg = _stored_config(parent, overrides)
    if refused := refused_fork_changes(stored, cfg, at):
        raise ConfigError(f"a fork at {at} cannot change " + "; ".join(refused))
    if cfg.storage.root != parent.cfg.root:
        raise ConfigError(
            f"storage.root: a fork lives beside its parent ({parent.cfg.root}); "
            "it references the parent's objects, it does not copy them"
        )
    cfg.trainer.run_id = validate_run_id(run_id or f"{parent_id}-fork-{at.step}-{at.stage}")
    store = RunStore(cfg.storage, cfg.trainer.run_id)
    refuse_existing(store)
    changed = {
        k: v
        for k, v in flatten(cfg).items()
        if flatten(stored).get(k) != v and k != "trainer.run_id"
    }
    lineage = fork_manifest(parent, at) | {"overrides": {k: str(v) for k, v in changed.items()}}
    start = start_version(at, cfg.trainer.max_staleness)
    update_keys = [k for k in changed if "update" in READS[k]]
    if update_keys and start < at.step - 1:
        raise ConfigError(
            f"a fork at {at} cannot change {', '.join(update_keys)}: with "
            f"trainer.max_staleness={cfg.trainer.max_staleness} it starts from weights version "
            f"{start} and applies the parent's updates {start + 1}..{at.step - 1} again, which "
            "need the parent's values (fork at a later stage or step)"
        )
    inherited = max([int(c) for c in lineage["checkpoints"] if int(c) <= start], default=0)
    if update_keys and inherited < start:  # its start, made with the parent's values
        lineage["materialize"] = start
    return OpenedRun(cfg, store, resume=False, lineage=lineage)


def parent_config(store: RunStore, cfg: HybridConfig) -> HybridConfig:
    """A fork's parent's config, run where the fork runs (the fork's `storage.*`, `ray.*`,
    ... where they differ): what the fork's start checkpoint is made with."""
    stored = as_recorded(store.lineage.parent.read_run())[0]
    a = flatten(config_from_dict(stored))
    where = [
        f"{k}={json.dumps(v)}"
        for k, v in flatten(cfg).items()
        if a.get(k) != v and "where" in READS[k]
    ]
    return config_from_dict(stored, where)


def start_version(at: ForkPoint, max_staleness: int) -> int:
    """The weights version a fork at `at` goes on from: N-1; with asynchronous training the
    newest V whose later rollouts V+1..V+k it inherits (`tasks.checkpoint.rollouts_missing`)."""
    last_inherited_rollout = at.step - (at.stage == "rollout")
    return max(0, min(at.step - 1, last_inherited_rollout - max_staleness))


def refuse_existing(store: RunStore) -> None:
    """A new run may not take the id of a run that exists."""
    if store.read_run() is not None:
        raise FileExistsError(
            f"run {store.run_id!r} already exists in {store.cfg.root}: resume it with "
            f"`hybridrl resume {store.run_id}` or choose another trainer.run_id"
        )


def record_run(
    store: RunStore,
    cfg: HybridConfig,
    lineage: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """run.json of a new run (a fork's with its lineage), with `extra` (its restart count)."""
    store.write_run(
        {
            "run_id": store.run_id,
            "config": redact(cfg.model_dump(mode="json")),
            "code_version": code_version(),
            "semantics": SEMANTICS,  # what its config computes (storage.semantics)
            "created_at": time.time(),
            "driver": driver_record(),
        }
        | ({"lineage": lineage} if lineage else {})
        | (extra or {})
    )


def log_fork(store: RunStore, lineage: dict[str, Any]) -> None:
    """What a new fork takes from its parent and what it changes."""
    changes = ", ".join(f"{k}={v}" for k, v in lineage["overrides"].items()) or "no overrides"
    get_run_logger().info(
        "run %s: a fork of %s at %s, referencing %d steps and %d checkpoints of it (%s)",
        store.run_id,
        lineage["parent"],
        lineage["at"],
        len(lineage["steps"]),
        len(lineage["checkpoints"]),
        changes,
    )


def materialize_start(store: RunStore, cfg: HybridConfig) -> None:
    """A fork that changes what updates read and inherits no checkpoint at its start gets
    that checkpoint made first, with its parent's config (`tasks.replay.materialize`);
    again on a resume if a kill came first (nothing to do once it has any checkpoint of
    its own at or past that version)."""
    version = store.lineage.doc.get("materialize")
    if version is None or any(c >= version for c in store.checkpoints(own=True)):
        return
    from tasks.replay import materialize

    began = time.perf_counter()
    materialize(Engine(parent_config(store, cfg)), store, version)
    get_run_logger().info(
        "run %s: weights version %d of %s made with its config and saved as "
        "the fork's checkpoint step_%d (%.1f s)",
        store.run_id,
        version,
        store.lineage.parent.run_id,
        version,
        time.perf_counter() - began,
    )


def code_version() -> str:
    """The package version, plus the git commit when run from a checkout."""
    v = package_version("hybridrl")
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{v}+{sha}" if sha else v
