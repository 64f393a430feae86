"""Start one more node of a local Ray cluster on this machine and exit, leaving its raylet
running: what `ray start --address=<head>` does for a worker node, but on 127.0.0.1.

    python -m hybrid_engine.pool.node GCS_ADDRESS CONFIG_JSON

`ray start` cannot do it here: with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (which keeps the
head on 127.0.0.1, see MACHINE-FACTS) it refuses to join a node, and with it set to 1 it
rewrites 127.0.0.1 to the host's address, where the head does not listen. So this builds the
same `RayParams` and `Node(head=False)` as `ray start` does, with the address as given.
CONFIG_JSON: num_cpus, resources, temp_dir and the node's ports (all distinct from the
head's, which shares the machine).
"""

from __future__ import annotations

import json
import sys

import ray._private.node
import ray._private.parameter


def main(gcs_address: str, config: dict) -> None:
    params = ray._private.parameter.RayParams(
        node_ip_address="127.0.0.1",
        node_name=config["name"],
        gcs_address=gcs_address,
        num_cpus=config["num_cpus"],
        resources=config["resources"],
        temp_dir=config["temp_dir"],
        **config["ports"],
    )
    ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    print("node started", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
