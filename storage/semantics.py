"""What a stored run's config computes, as the code that recorded it computed it.

run.json records `semantics`: the version of what a config means to the code. A change that
would make a stored config compute something else raises `SEMANTICS` and adds a case to
`as_recorded`, which gives an older run's config the values that compute what it did, so a
resumed or forked run goes on with the loss it began with:

    0  (no `semantics`; created before 2026-12-03 10:57 UTC) GSPO aggregated its token
       losses seq-mean-token-mean whatever actor.loss_agg_mode said; commit 87ae0d0 made it
       follow loss_agg_mode (verl 0.9.1). Such a run keeps seq-mean-token-mean as
       actor.policy_loss.aggregation; its entropy and KL terms keep loss_agg_mode.
    1  what the code computes now

A run without `semantics` created after that commit (by the code between it and the record)
already followed loss_agg_mode and is left as it is.
"""

from __future__ import annotations

import copy
from typing import Any

SEMANTICS = 1
GSPO_FOLLOWS_AGG_MODE_SINCE = 1796295460.0  # commit 87ae0d0's time (2026-12-03T10:57:40Z)
GSPO_BEFORE = "seq-mean-token-mean"


def as_recorded(doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(run.json `doc`'s config with the values that compute what its code computed, one
    line per value given)."""
    config = doc["config"]
    if doc.get("semantics", 0) >= 1 or doc.get("created_at", 0) >= GSPO_FOLLOWS_AGG_MODE_SINCE:
        return config, []
    actor = config.get("actor") or {}
    loss = actor.get("policy_loss") or {}
    agg = actor.get("loss_agg_mode", "token-mean")
    if loss.get("mode") != "gspo" or loss.get("aggregation") or agg == GSPO_BEFORE:
        return config, []
    config = copy.deepcopy(config)
    config["actor"].setdefault("policy_loss", {})["aggregation"] = GSPO_BEFORE
    note = (
        f"run {doc.get('run_id')}: recorded before GSPO followed actor.loss_agg_mode (commit "
        f"87ae0d0), it trained with {GSPO_BEFORE}, not {agg}; it keeps that loss "
        f"(actor.policy_loss.aggregation={GSPO_BEFORE})"
    )
    return config, [note]
