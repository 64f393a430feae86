"""Screenshots of the MLflow UI for a parent run, its fork and the registered policy.

    python scripts/mlflow_screenshots.py --tracking-uri http://127.0.0.1:5000 \
        --parent demo --fork demo-rloo [--model hybridrl-policy] [--out docs/screenshots]

Needs a running MLflow server holding the runs (e.g. `mlflow server --backend-store-uri
sqlite:///ROOT/mlflow.db` over bench/fork_audit.py's root), headless Chromium and Playwright,
which is not a project dependency: `pip install playwright` into any Python and pass
`--chromium /usr/bin/chromium` (the default) to use the system's browser. Writes
mlflow-fork-nested.png (the runs table: the fork and the evaluation runs nested under their
parents), mlflow-fork-curves.png (val/accuracy and critic/score/mean of both runs, each
overlaid by step) and mlflow-registry.png (the model's versions, their lineage tags and aliases).

The UI colours a run by a hash of its id unless the run has the tag `mlflow.runColor`; the
script sets that tag on the two runs (blue parent, magenta fork) so their curves differ.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlflow
from playwright.sync_api import Page, sync_playwright

CURVES = ["val/accuracy", "critic/score/mean"]
COLUMNS = ["val/accuracy", "eval/accuracy", "hybridrl.parent", "hybridrl.fork_at"]
COLOURS = {"parent": "#1c7ed6", "fork": "#d6336c"}


def run_ids(client: mlflow.MlflowClient, names: list[str]) -> tuple[str, list[str]]:
    """The experiment id and run ids of runs named `names` (one run per name)."""
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    by_name = {r.info.run_name: r.info for r in found if r.info.run_name in names}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SystemExit(f"no MLflow run named {', '.join(missing)}")
    return by_name[names[0]].experiment_id, [by_name[n].run_id for n in names]


def close_assistant(page: Page) -> None:
    """MLflow 3.17 opens an assistant panel on the first visit; close it when it is there."""
    close = page.get_by_role("button", name="Close")
    if close.count():
        close.first.click()
        page.wait_for_timeout(500)


def runs_table(page: Page, base: str, experiment: str, parent: str, fork: str, out: Path) -> None:
    page.goto(f"{base}/#/experiments/{experiment}/runs")
    page.wait_for_timeout(5000)
    close_assistant(page)
    for name in (parent, fork):  # expand the parent, then the fork nested in it
        page.get_by_role("row").filter(has_text=name).first.locator("button").first.click()
        page.wait_for_timeout(800)
    page.get_by_role("button", name="Columns").click()
    page.wait_for_timeout(800)
    for name in ("Dataset", "Source"):
        page.get_by_text(name, exact=True).last.click()
    search = page.get_by_placeholder("Search columns")
    for name in COLUMNS:
        search.fill(name)
        page.wait_for_timeout(500)
        page.get_by_text(name, exact=True).last.click()
    page.keyboard.press("Escape")
    page.wait_for_timeout(1000)
    page.screenshot(path=out, clip={"x": 0, "y": 0, "width": 1500, "height": 420})


def curves(page: Page, base: str, experiment: str, parent: str, fork: str, out: Path) -> None:
    """The chart view of the experiment, filtered to CURVES, the evaluation runs hidden."""
    page.goto(f"{base}/#/experiments/{experiment}/runs")
    page.wait_for_timeout(5000)
    close_assistant(page)
    for name in (parent, fork):
        page.get_by_role("row").filter(has_text=name).first.locator("button").first.click()
        page.wait_for_timeout(800)
    page.locator("label").filter(has=page.locator("input[value=CHART]")).click()
    page.wait_for_timeout(3000)
    # MLflow 3.17's charts leave out a nested run that has children of its own (the fork,
    # with its evaluation run) until its visibility is toggled: hide and show it again.
    eye = page.get_by_role("row").filter(has_text=fork).first.locator("label").first
    for _ in range(2):
        eye.click()
        page.wait_for_timeout(1500)
    evaluations = page.get_by_role("row").filter(has_text="eval ")
    for i in range(evaluations.count()):
        evaluations.nth(i).locator("label").first.click()
        page.wait_for_timeout(800)
    search = "|".join(f"^{key}$" for key in CURVES)
    page.get_by_placeholder("Search metric charts").fill(search)
    page.wait_for_timeout(5000)
    page.screenshot(path=out, clip={"x": 0, "y": 0, "width": 860, "height": 1070})


def registry(page: Page, base: str, model: str, out: Path) -> None:
    page.goto(f"{base}/#/models/{model}")
    page.wait_for_timeout(6000)
    close_assistant(page)
    page.screenshot(path=out, full_page=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tracking-uri", required=True)
    parser.add_argument("--parent", required=True)
    parser.add_argument("--fork", required=True)
    parser.add_argument("--model", default="hybridrl-policy")
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    client = mlflow.MlflowClient(args.tracking_uri)
    experiment, ids = run_ids(client, [args.parent, args.fork])
    for run_id, role in zip(ids, ("parent", "fork"), strict=True):
        client.set_tag(run_id, "mlflow.runColor", COLOURS[role])
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.tracking_uri.rstrip("/")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])

        def page() -> Page:  # a fresh context each: the UI keeps expanded rows in localStorage
            return browser.new_context(viewport={"width": 1500, "height": 1100}).new_page()

        runs_table(
            page(), base, experiment, args.parent, args.fork, args.out / "mlflow-fork-nested.png"
        )
        curves(
            page(), base, experiment, args.parent, args.fork, args.out / "mlflow-fork-curves.png"
        )
        registry(page(), base, args.model, args.out / "mlflow-registry.png")
        browser.close()
    for name in ("mlflow-fork-nested.png", "mlflow-fork-curves.png", "mlflow-registry.png"):
        print(args.out / name)


if __name__ == "__main__":
    main()
