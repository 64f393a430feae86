"""Fork and audit a demo run, with figures: what a fork adds, what it did not generate again,
both curves from the fork point, and the audit of every stage of the parent.

    .venv/bin/python bench/fork_audit.py [--steps 30] [--at 20/advantage] [--root DIR]
                                         [--out bench/results]

1. `hybridrl train configs/demo_cpu.yaml` for `--steps` steps (checkpoints every 10, MLflow on
   sqlite beside the runs), run id `demo`;
2. `hybridrl fork demo --at 20/advantage --run-id demo-rloo algorithm.adv_estimator=rloo`,
   stopped just before its first own stage (`HYBRIDRL_FAULT=step-20/advantage:start=kill`)
   to weigh what the fork holds before it trains, then `hybridrl resume demo-rloo`;
3. per inherited step the sha256 of the parent's rollout objects and of what the fork reads;
4. `hybridrl runs compare demo demo-rloo` (the curves from the fork point);
5. `hybridrl evaluate` of the two registered final policies (version 1: the parent, 2: the
   fork): greedy accuracy, pass@4, maj@4 and the promotion gate;
6. `hybridrl replay demo --all`: every stage of the parent recomputed and compared.
Writes fork-audit.json / fork-audit.md (and the commands' output, fork-audit.txt) to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from report import machine  # noqa: E402 - beside this file

HYBRIDRL = [sys.executable, "-m", "flows.cli"]


def run(args: list[str], log: list[str], env: dict | None = None) -> tuple[int, str, float]:
    """One `hybridrl` command in its own process group (a killed driver's Prefect server
    would otherwise keep the output pipe open)."""
    began = time.perf_counter()
    with tempfile.TemporaryFile("w+") as sink:
        proc = subprocess.Popen(
            [*HYBRIDRL, *args],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "COLUMNS": "160", **(env or {})},
        )
        proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        sink.seek(0)
        out = sink.read()
    seconds = time.perf_counter() - began
    log.append(f"$ hybridrl {' '.join(args)}   # exit {proc.returncode}, {seconds:.0f} s\n{out}")
    print(f"hybridrl {' '.join(args[:3])} ...: exit {proc.returncode}, {seconds:.0f} s", flush=True)
    return proc.returncode, out, seconds


def tree_bytes(path: Path) -> dict[str, int]:
    return {
        str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--at", default="20/advantage")
    ap.add_argument("--root", default=None, help="default: a new temporary directory")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    a = ap.parse_args()
    root = Path(a.root or tempfile.mkdtemp(prefix="fork-audit-"))
    db = f"sqlite:///{root}/mlflow.db"
    where = [f"storage.root={root}", f"tracking.uri={db}"]
    log: list[str] = []
    fork_step = int(a.at.split("/")[0])
    from hybrid_engine.config import StorageConfig
    from storage.store import RunStore, sha256

    rc, _, train_s = run(
        [
            "train",
            "configs/demo_cpu.yaml",
            f"trainer.total_training_steps={a.steps}",
            "trainer.save_freq=10",
            "trainer.max_ckpt_to_keep=0",
            *where,
            "--run-id",
            "demo",
        ],
        log,
    )
    assert rc == 0, log[-1]
    fork_args = [
        "fork",
        "demo",
        "--at",
        a.at,
        "--run-id",
        "demo-rloo",
        "algorithm.adv_estimator=rloo",
        *where,
    ]
    rc, _, _ = run(fork_args, log, {"HYBRIDRL_FAULT": f"step-{a.at}:start=kill"})
    before = tree_bytes(root / "demo-rloo")
    rc, _, fork_s = run(["resume", "demo-rloo", f"storage.root={root}"], log)
    assert rc == 0, log[-1]
    storage = StorageConfig(root=str(root))
    parent, child = RunStore(storage, "demo"), RunStore(storage, "demo-rloo")
    rollouts = []
    for step in range(1, fork_step + 1):
        d = parent.stage_dir(step, "rollout")
        mine = child.load_stage(step, "rollout")
        rollouts.append(
            {
                "step": step,
                "parent_sha256": parent.marker(d)["files"]["batch.safetensors"],
                "fork_reads_sha256": sha256(child.locate(d).get(f"{d}/batch.safetensors")),
                "fork_reads_from": mine.uri.replace(str(root), "<root>"),
                "in_fork_dir": (root / "demo-rloo" / d).exists(),
            }
        )
    _, compare_out, _ = run(["runs", "compare", "demo", "demo-rloo", "--tracking-uri", db], log)
    evaluations = {}
    for v in ("1", "2"):
        _, out, secs = run(["evaluate", f"hybridrl-policy/{v}", "--tracking-uri", db], log)
        evaluations[v] = {"seconds": secs, "output": out.strip().splitlines()[-9:]}
    rc, audit_out, audit_s = run(["replay", "demo", "--all", "--storage-root", str(root)], log)
    audit = [
        {"stage": m.group(1), "result": m.group(2), "seconds": float(m.group(3))}
        for m in re.finditer(r"^(\d+/\w+): (.+) \(([\d.]+) s\)$", audit_out, re.M)
    ]
    result = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "steps": a.steps,
        "fork_at": a.at,
        "parent_train_s": train_s,
        "fork_train_s": fork_s,
        "audit_s": audit_s,
        "audit_exit": rc,
        "fork_bytes_before_training": before,
        "fork_bytes_total": sum(tree_bytes(root / "demo-rloo").values()),
        "parent_bytes_total": sum(tree_bytes(root / "demo").values()),
        "rollouts": rollouts,
        "audit": audit,
        "root": str(root),
        "evaluations": evaluations,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fork-audit.json").write_text(json.dumps(result, indent=1))
    (out / "fork-audit.txt").write_text("\n".join(log))
    (out / "fork-audit.md").write_text(render(result, compare_out))
    print(render(result, compare_out))


def render(r: dict, compare_out: str) -> str:
    lines = [f"Fork and audit of a {r['steps']}-step demo run ({r['machine']}, {r['date']})", ""]
    before = r["fork_bytes_before_training"]
    lines += [
        f"Fork at {r['fork_at']} with algorithm.adv_estimator=rloo: before training it "
        f"held {sum(before.values())} bytes ({', '.join(f'{k} {v}' for k, v in before.items())});"
        f" after training {r['fork_bytes_total'] / 2**20:.1f} MiB (the parent: "
        f"{r['parent_bytes_total'] / 2**20:.1f} MiB). Parent {r['parent_train_s']:.0f} s, "
        f"fork {r['fork_train_s']:.0f} s.",
        "",
    ]
    same = all(
        x["parent_sha256"] == x["fork_reads_sha256"] and not x["in_fork_dir"] for x in r["rollouts"]
    )
    lines += [
        f"Rollouts of steps 1-{len(r['rollouts'])}: the fork reads the parent's objects "
        f"({'all equal, none in the fork directory' if same else 'MISMATCH'}):",
        "",
        "| step | parent's rollout sha256 | the fork reads | from |",
        "| ---: | --- | --- | --- |",
    ]
    for x in r["rollouts"]:
        lines.append(
            f"| {x['step']} | `{x['parent_sha256'][:16]}` | `{x['fork_reads_sha256'][:16]}` "
            f"| `{x['fork_reads_from']}` |"
        )
    table = compare_out[compare_out.find("from the fork point") :]
    lines += [
        "",
        "`hybridrl runs compare demo demo-rloo`, from the fork point:",
        "",
        "```",
        table.split("MLflow UI")[0].rstrip(),
        "```",
        "",
    ]
    for v, e in r["evaluations"].items():
        lines += [
            f"`hybridrl evaluate hybridrl-policy/{v}` ({e['seconds']:.0f} s):",
            "",
            "```",
            *e["output"],
            "```",
            "",
        ]
    equal = sum(1 for x in r["audit"] if x["result"] == "bit-equal")
    lines += [
        f"`hybridrl replay demo --all` ({r['audit_s']:.0f} s, exit {r['audit_exit']}): "
        f"{equal} of {len(r['audit'])} stages bit-equal",
        "",
        "| stage | result | seconds |",
        "| --- | --- | ---: |",
    ]
    lines += [f"| {x['stage']} | {x['result']} | {x['seconds']:.2f} |" for x in r["audit"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
