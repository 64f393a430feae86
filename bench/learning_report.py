"""bench/learning.py's report: statistics over seeds, the learning table and the curve plot,
all from the results JSON alone (so the table and plot can be redrawn without training).

Per (framework, preset, seed) run: before = held-out answer-correct at step 0, best = its
highest evaluation, final = the last one. Over the seeds of a (framework, preset): the mean,
the spread (sample standard deviation) and a 95% interval for the mean (Student's t with
n - 1 degrees of freedom; none for one seed).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any


def over_seeds(values: list[float]) -> dict[str, Any]:
    """{n, mean, sd, low, high} of `values` (one per seed); sd and the interval are None
    with a single value."""
    if not values:
        raise ValueError("over_seeds: no values")
    n, mean = len(values), statistics.fmean(values)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "low": None, "high": None}
    from scipy.stats import t

    sd = statistics.stdev(values)
    half = t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half}


def run_points(result: dict[str, Any], key: str = "answer_correct") -> dict[str, float]:
    """before, best, final of one run's evaluations (`key`: answer_correct or
    format_correct)."""
    evals = sorted(result["evals"], key=lambda e: e["step"])
    if not evals or evals[0]["step"] != 0:
        raise ValueError(
            f"{result['framework']} {result['preset']} seed {result['seed']}: "
            "no evaluation at step 0"
        )
    return {
        "before": evals[0][key],
        "best": max(e[key] for e in evals),
        "final": evals[-1][key],
    }


def _cell(s: dict[str, Any]) -> str:
    text = f"{100 * s['mean']:.1f}%"
    if s["sd"] is not None:
        text += f" ± {100 * s['sd']:.1f} [{100 * s['low']:.1f}, {100 * s['high']:.1f}]"
    return text


def groups(results: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The runs by (preset, framework), seeds in order."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in sorted(results, key=lambda r: (r["preset"], r["framework"], r["seed"])):
        out.setdefault((r["preset"], r["framework"]), []).append(r)
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The learning table (markdown): one row per (preset, framework), held-out
    answer-correct before / best / final as mean ± sd [95% interval] over the seeds, and the
    final format-correct."""
    head = [
        "preset",
        "framework",
        "task",
        "seeds",
        "questions",
        "before",
        "best",
        "final",
        "final format-correct",
        "steps",
        "wall min / run (of it held-out scoring)",
        "machine",
        "date",
        "commit",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (preset, framework), runs in groups(results).items():
        points = [run_points(r) for r in runs]
        stats = {k: over_seeds([p[k] for p in points]) for k in ("before", "best", "final")}
        fmt = over_seeds([run_points(r, "format_correct")["final"] for r in runs])
        first = runs[0]
        cells = [
            preset,
            framework,
            first["task"],
            ", ".join(str(r["seed"]) for r in runs),
            str(first["questions"]),
            *(_cell(stats[k]) for k in ("before", "best", "final")),
            _cell(fmt),
            str(first["steps"]),
            f"{statistics.fmean(r['wall_min'] for r in runs):.1f} "
            f"({statistics.fmean(r['eval_min'] for r in runs):.1f})",
            first["machine"],
            max(r["date"] for r in runs),
            ", ".join(sorted({r["commit"] for r in runs})),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Curves: held-out answer-correct (solid) and format-correct (dashed) by step, the mean
    over seeds bold and each seed thin; beside them the policy's entropy per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, ent) = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((preset, framework), runs) in enumerate(groups(results).items()):
        c, label = colors[i % len(colors)], f"{framework} {preset}"
        steps = sorted({e["step"] for r in runs for e in r["evals"]})
        for key, style in (("answer_correct", "-"), ("format_correct", "--")):
            by_step = {
                s: [e[key] for r in runs for e in r["evals"] if e["step"] == s] for s in steps
            }
            mean = [100 * statistics.fmean(by_step[s]) for s in steps]
            name = f"{label}, {'answer' if key == 'answer_correct' else 'format'}-correct"
            acc.plot(steps, mean, style, color=c, lw=2, label=f"{name} (mean of {len(runs)})")
            if len(runs) > 1 and key == "answer_correct":
                for r in runs:
                    e = sorted(r["evals"], key=lambda e: e["step"])
                    acc.plot(
                        [x["step"] for x in e], [100 * x[key] for x in e], "-", color=c, lw=0.6
                    )
        for r in runs:
            pts = [(m["step"], m["entropy"]) for m in r["per_step"] if m.get("entropy") is not None]
            ent.plot(*zip(*pts, strict=True), color=c, lw=1, label=f"{label} seed {r['seed']}")
    acc.set(xlabel="step", ylabel="held-out %", title="held-out greedy accuracy")
    ent.set(xlabel="step", ylabel="mean token entropy (nats)", title="policy entropy")
    acc.legend(fontsize=7)
    ent.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
