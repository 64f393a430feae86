"""The import graph, read with `ast` (every import counts, module-level and inside functions):
no circle, and every edge points down the layers

    flows -> tasks -> storage -> hybrid_engine

Within the engine, `config/` and `algorithms/` import only the foundation
(`hybrid_engine/__init__`, `registry`, `specs`, `bands`): algorithms take plain values. The engine imports nothing of
Prefect, MLflow or S3. A failure names the edge.

The engine's errors and constants (`WorkerLostError`, `STOPPING`, `CallsAbandoned`,
`NO_SPACE`) live in `hybrid_engine.errors`, so:
- `tasks/` imports nothing of `hybrid_engine.pool`;
- `flows/` only where it manages the pool itself: the command line's `pool` and `cluster`
  commands (`flows/cli/cluster.py`) and the train flow's claim on the
  pool (one run's claim, or a shared pool's) and its `pool.down` when the run owns it
  (`flows/train.py`), listed in `POOL_USERS`;
- `storage/` imports nothing of `hybrid_engine.models` (a final policy's LoRA adapter is
  written by `hybrid_engine.export`)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hybrid_engine", "storage", "tasks", "flows")
LAYER = {"hybrid_engine": 0, "storage": 1, "tasks": 2, "flows": 3}
FOUNDATION = {
    "hybrid_engine",
    "hybrid_engine.registry",
    "hybrid_engine.specs",
    "hybrid_engine.bands",
}
NOT_IN_ENGINE = ("prefect", "mlflow", "s3fs")
POOL_USERS = {
    "flows.cli.cluster": {
        "hybrid_engine.pool.pool",
        "hybrid_engine.pool.cluster",
        "hybrid_engine.pool.claim",
    },
    "flows.train": {
        "hybrid_engine.pool.pool",
        "hybrid_engine.pool.claim",
        "hybrid_engine.pool.sharing",
    },
    "flows.cli.sharing": {"hybrid_engine.pool.sharing"},
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(path: Path, name: str, is_package: bool) -> set[str]:
    """Every dotted name `path` imports (relative imports resolved)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges among our modules, third-party top-level names) per module."""
    mods = modules()
    edges, external = {m: set() for m in mods}, {m: set() for m in mods}
    for m, path in mods.items():
        for target in imported(path, m, path.name == "__init__.py"):
            t = target
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if not t:
                external[m].add(target.split(".")[0])
            elif t != m and not m.startswith(t + "."):  # a package's own __init__ runs first
                edges[m].add(t)
    return edges, external


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def reaches_in(source: str, target: str) -> bool:
    """An edge into the engine's pool or models from a layer that must not use them."""
    if target.startswith("hybrid_engine.pool"):
        top = source.split(".")[0]
        return top in ("tasks", "flows") and target not in POOL_USERS.get(source, set())
    return source.startswith("storage") and target.startswith("hybrid_engine.models")


def upward(source: str, target: str) -> bool:
    if LAYER[target.split(".")[0]] > LAYER[source.split(".")[0]]:
        return True
    for floor, allowed in (("config", FOUNDATION), ("algorithms", FOUNDATION)):
        if source.startswith(f"hybrid_engine.{floor}"):
            below = target in FOUNDATION or any(
                target.startswith(f"hybrid_engine.{a}") for a in allowed - FOUNDATION
            )
            if not (below or target.startswith(f"hybrid_engine.{floor}")):
                return True
    return False


def test_no_import_circle():
    edges, _ = graph()
    found = [
        ", ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c)
        for c in circles(edges)
    ]
    assert not found, "import circles: " + " | ".join(found)


def test_imports_point_down_the_layers():
    edges, _ = graph()
    bad = [f"{a} -> {b}" for a in sorted(edges) for b in sorted(edges[a]) if upward(a, b)]
    assert not bad, "upward imports: " + "; ".join(bad)


def test_tasks_flows_and_storage_do_not_reach_into_the_pool_or_models():
    edges, _ = graph()
    bad = [f"{a} -> {b}" for a in sorted(edges) for b in sorted(edges[a]) if reaches_in(a, b)]
    assert not bad, "through hybrid_engine.errors / export instead: " + "; ".join(bad)


def test_the_data_side_imports_nothing_of_rollout():
    """Prompt rows (`data.py`, `verifiers_data.py`) sit below the rollout that reads them."""
    edges, _ = graph()
    data = ("hybrid_engine.data", "hybrid_engine.verifiers_data")
    bad = [f"{a} -> {b}" for a in data for b in sorted(edges[a]) if "rollout" in b]
    assert not bad, "; ".join(bad)


def test_the_engine_knows_nothing_of_prefect_mlflow_or_s3():
    _, external = graph()
    bad = [
        f"{m} imports {x}"
        for m in sorted(external)
        if m.startswith("hybrid_engine")
        for x in sorted(external[m] & set(NOT_IN_ENGINE))
    ]
    assert not bad, "; ".join(bad)


def test_the_checks_see_a_planted_circle_and_an_upward_edge():
    """The two checks above fail on what they are meant to catch."""
    edges = {"a.x": {"a.y"}, "a.y": {"a.x"}, "a.z": set()}
    assert circles(edges) == [["a.x", "a.y"]]
    assert upward("storage.store", "tasks.stages")
    assert upward("hybrid_engine.config.root", "hybrid_engine.algorithms.losses")
    assert upward("hybrid_engine.algorithms.kl", "hybrid_engine.models.logprobs")
    assert upward("hybrid_engine.algorithms.kl", "hybrid_engine.config")
    assert not upward("hybrid_engine.algorithms.correction", "hybrid_engine.bands")
    assert not upward("flows.train", "hybrid_engine.engine")
    assert reaches_in("tasks.recovery", "hybrid_engine.pool.group")
    assert reaches_in("flows.scheduler", "hybrid_engine.pool.group")
    assert reaches_in("flows.train", "hybrid_engine.pool.group")
    assert reaches_in("storage.store", "hybrid_engine.models.sharding")
    assert not reaches_in("flows.cli.cluster", "hybrid_engine.pool.cluster")
    assert not reaches_in("tasks.recovery", "hybrid_engine.errors")


def test_loading_a_config_imports_no_torch_ray_prefect_or_mlflow():
    code = (
        "import sys\n"
        "from hybrid_engine.config import load_config\n"
        "load_config('configs/demo_cpu.yaml', ['algorithm.adv_estimator=gae'])\n"
        "print(sorted(m for m in ('torch', 'ray', 'prefect', 'mlflow', 'transformers')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
