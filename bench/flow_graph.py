"""The Prefect graph of a `train` flow run, as text: every task run with its upstream tasks,
state, start offset and duration (what Prefect's UI draws as the run graph).

.venv/bin/python bench/flow_graph.py RUN_ID     (the flow run's name is the hybridrl run id)

Reads the API Prefect is configured with (`PREFECT_API_URL`, else the ephemeral API on the
same PREFECT_HOME the run used).
"""

from __future__ import annotations

import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.client.schemas.sorting import FlowRunSort

import tasks  # noqa: F401  (Prefect's environment defaults)


def main(name: str) -> None:
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])),
            sort=FlowRunSort.START_TIME_DESC,
        )
        if not runs:
            sys.exit(f"no flow run named {name!r}")
        run = runs[0]
        graph = client.request("GET", "/flow_runs/{id}/graph-v2", path_params={"id": run.id})
        doc = graph.json()
    nodes = {nid: node for nid, node in doc["nodes"]}
    label = {nid: n["label"] for nid, n in nodes.items()}
    t0 = min(n["start_time"] for n in nodes.values())
    from datetime import datetime

    def ts(s: str) -> float:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()

    print(f"flow run {run.name!r} ({run.id}) state {run.state_type.value}, {len(nodes)} task runs")
    print(f"{'task run':<22} {'state':<10} {'start s':>8} {'took s':>7}  upstream")
    for _nid, n in sorted(nodes.items(), key=lambda kv: kv[1]["start_time"]):
        end = ts(n["end_time"]) if n["end_time"] else float("nan")
        ups = ", ".join(dict.fromkeys(label[p["id"]] for p in n["parents"] if p["id"] in label))
        print(
            f"{n['label']:<22} {n['state_type']:<10} {ts(n['start_time']) - ts(t0):8.2f} "
            f"{end - ts(n['start_time']):7.2f}  {ups}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
