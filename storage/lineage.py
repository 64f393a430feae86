"""Forks: a run whose first steps are another run's committed stages, referenced, not copied.

A fork of run P at `N/STAGE` inherits every stage of P's steps before N, the stages of step N
before STAGE (rollout < reward < advantage < update) and P's checkpoints before step N. Its
`run.json` holds the reference, content-addressed:

    "lineage": {"parent": P, "at": "N/STAGE",
                "steps": {"<n>": sha256 of {stage: {object: sha256}} of step n's inherited stages},
                "checkpoints": {"<c>": sha256 of {object: sha256} of checkpoint step_<c>}}

so a fork adds a few KB whatever the size of what it inherits. A stage the fork has committed
itself wins over an inherited one; an inherited stage is read from where its objects are
(P, or P's own parent for what P inherited) and trusted only while its step's digest matches
what the fork recorded. Deleting a run (`delete_run`) keeps every object a fork still uses:
the deleted run stays as a tombstone holding just those, removed with the last fork that
needs them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from hybrid_engine import STAGES

RunStore = Any  # a storage.store.RunStore (not imported: the store imports this module)

log = logging.getLogger("hybridrl.storage")

STAGE_DIR = re.compile(r"^steps/(\d+)/([A-Za-z0-9_-]+)$")
CHECKPOINT_DIR = re.compile(r"^checkpoints/step_(\d+)$")


@dataclass(frozen=True)
class ForkPoint:
    """`N/STAGE`: the fork computes step N from STAGE on (and every later step)."""

    step: int
    stage: str

    @classmethod
    def parse(cls, text: str) -> ForkPoint:
        m = re.fullmatch(r"(\d+)/([a-z]+)", text.strip())
        if not m or m.group(2) not in STAGES or int(m.group(1)) < 1:
            raise ValueError(
                f"fork point {text!r}: write STEP/STAGE with STEP >= 1 and STAGE one of "
                f"{', '.join(STAGES)} (e.g. 20/advantage)"
            )
        return cls(int(m.group(1)), m.group(2))

    def __str__(self) -> str:
        return f"{self.step}/{self.stage}"

    def inherits(self, step: int, stage: str) -> bool:
        """Whether a fork at this point takes stage `stage` of step `step` from its parent
        (`rollout-gen<j>`, dynamic sampling's generation batches, go with the rollout)."""
        if step != self.step:
            return step < self.step
        base = stage.split("-", 1)[0]
        return base in STAGES and STAGES.index(base) < STAGES.index(self.stage)

    def inherits_dir(self, rel_dir: str) -> bool:
        """Whether a stage or checkpoint directory of the parent is the fork's too."""
        if m := STAGE_DIR.match(rel_dir):
            return self.inherits(int(m.group(1)), m.group(2))
        if m := CHECKPOINT_DIR.match(rel_dir):
            return int(m.group(1)) < self.step
        return False


def digest(doc: Any) -> str:
    """sha256 of a JSON document in canonical form (sorted keys, no spaces)."""
    return hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def step_stages(store: RunStore, step: int) -> list[str]:
    """The stage directories of step N that the run holds, its own or inherited."""
    names = set()
    try:
        for p in store.fs.ls(store.fs_path(f"steps/{step}"), detail=False):
            names.add(p.rstrip("/").rsplit("/", 1)[-1])
    except FileNotFoundError:
        pass
    if (lin := store.lineage) is not None:
        names |= {s for s in step_stages(lin.parent, step) if lin.at.inherits(step, s)}
    return sorted(names)


def step_digest(store: RunStore, step: int, at: ForkPoint) -> str | None:
    """The digest of what a fork at `at` takes of step N: the object sums of each committed
    stage (None when there is none)."""
    doc = {}
    for stage in step_stages(store, step):
        if at.inherits(step, stage) and (m := store.marker(f"steps/{step}/{stage}")) is not None:
            doc[stage] = m["files"]
    return digest(doc) if doc else None


class Lineage:
    """The parent reference of a fork, as its run.json records it."""

    def __init__(self, child: RunStore, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.at = ForkPoint.parse(doc["at"])
        self.parent = type(child)(child.cfg, doc["parent"])  # the same kind of store
        self.steps: dict[str, str] = doc["steps"]
        self.checkpoints: dict[str, str] = doc["checkpoints"]
        self._checked: dict[str, bool] = {}

    def source(self, rel_dir: str) -> RunStore | None:
        """The parent's store when `rel_dir` is inherited and still what the fork recorded."""
        if not self.at.inherits_dir(rel_dir):
            return None
        if rel_dir not in self._checked:
            self._checked[rel_dir] = self._check(rel_dir)
        return self.parent if self._checked[rel_dir] else None

    def _check(self, rel_dir: str) -> bool:
        if m := CHECKPOINT_DIR.match(rel_dir):
            want = self.checkpoints.get(m.group(1))
            got = self.parent.marker(rel_dir)
            ok = want is not None and got is not None and digest(got["files"]) == want
            what = f"checkpoint {rel_dir}"
        else:
            step = STAGE_DIR.match(rel_dir).group(1)
            want = self.steps.get(step)
            if want is None:
                return False
            key = f"steps/{step}"  # one check per step covers all its stages
            if key not in self._checked:
                self._checked[key] = step_digest(self.parent, int(step), self.at) == want
            ok, what = self._checked[key], f"step {step}"
        if not ok and want is not None:
            log.warning(
                "%s of %s is not what fork point %s recorded (changed or deleted): "
                "the fork counts it as not done",
                what,
                self.parent.run_id,
                self.at,
            )
        return ok

    def same_weights(self, run_id: str | None, version: int) -> bool:
        """Whether weights version V of run `run_id` is this fork's version V too (an
        ancestor's versions up to the fork point are)."""
        limit, lin = self.at.step - 1, self
        while lin is not None:
            limit = min(limit, lin.at.step - 1)
            if lin.parent.run_id == run_id:
                return version <= limit
            lin = lin.parent.lineage
        return False


def fork_manifest(parent: RunStore, at: ForkPoint) -> dict[str, Any]:
    """The lineage record of a fork of `parent` at `at`. Raises ValueError naming the first
    stage of the parent that the fork would need and that is not committed."""
    doc = parent.read_run()
    if doc is None or doc.get("deleted"):
        what = "was deleted" if doc else "does not exist"
        raise ValueError(f"run {parent.run_id!r} {what} under {parent.cfg.root}: nothing to fork")
    for step in range(1, at.step + 1):
        for stage in STAGES:
            if at.inherits(step, stage) and not parent.is_committed(step, stage):
                raise ValueError(
                    f"cannot fork {parent.run_id} at {at}: its stage {step}/{stage} is not "
                    f"committed (resume it first, or fork at an earlier point)"
                )
    steps = {}
    for step in range(0, at.step + 1):
        if (d := step_digest(parent, step, at)) is not None:
            steps[str(step)] = d
    checkpoints = {}
    for c in parent.checkpoints():
        if c < at.step and (m := parent.marker(parent.checkpoint_dir(c))) is not None:
            checkpoints[str(c)] = digest(m["files"])
    return {
        "parent": parent.run_id,
        "at": str(at),
        "steps": steps,
        "checkpoints": checkpoints,
        "parent_mlflow_run_id": doc.get("mlflow_run_id"),
    }
