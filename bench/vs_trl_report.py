"""bench/vs_trl.py's report: the markdown table and the step-time plot of a comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def table(r: dict[str, Any]) -> str:
    o, t, q = r["hybridrl"], r["trl"], r["ratios"]
    rows = [
        (
            "median seconds per step",
            f"{o['step_s']:.1f}",
            f"{t['step_s']:.1f}",
            f"{q['steps_per_hour']:.2f}x steps/hour",
        ),
        ("generation seconds per step", f"{o['gen_s']:.1f}", f"{t['gen_s']:.1f}", ""),
        (
            "rollout tokens/s",
            f"{o['rollout_tokens_per_s']:.0f}",
            f"{t['rollout_tokens_per_s']:.0f}",
            f"{q['rollout_tokens_per_s']:.2f}x",
        ),
        (
            "training seconds per step (step - generation)",
            f"{o['train_s']:.1f}",
            f"{t['train_s']:.1f}",
            "",
        ),
        (
            "training GFLOP/s, work done (6 x params x prompt+response tokens of every sample)",
            f"{o['train_gflops']:.1f}",
            f"{t['train_gflops']:.1f}",
            "",
        ),
        (
            "  as a fraction of the matmul peak",
            f"{o['train_fraction_of_peak']:.0%}",
            f"{t['train_fraction_of_peak']:.0%}",
            "",
        ),
        (
            "training GFLOP/s, computed (hybridrl: each prompt once per 4 samples)",
            f"{o['train_gflops_computed']:.1f}",
            f"{t['train_gflops_computed']:.1f}",
            "",
        ),
        (
            "  as a fraction of the matmul peak",
            f"{o['train_computed_fraction_of_peak']:.0%}",
            f"{t['train_computed_fraction_of_peak']:.0%}",
            "",
        ),
        (
            "peak RSS, all processes (GB)",
            f"{o['peak_rss_gb']:.2f}",
            f"{t['peak_rss_gb']:.2f}",
            f"{q['peak_rss']:.2f}x",
        ),
    ]
    w = r["work"]
    head = (
        f"{w['prompts']} prompts x {w['samples']} samples, {w['new_tokens']} new tokens, "
        f"{w['threads']} threads, hybridrl backend {w['backend']}; fp32 matmul peak "
        f"{r['matmul_gflops']:.1f} GFLOP/s; plain `model.generate` at the same batch "
        f"{r['plain_generate_tokens_per_s']:.0f} tokens/s (hybridrl rollout "
        f"{q['rollout_vs_plain_generate']:.2f}x of it); medians of {o['steps_measured']} "
        f"(hybridrl) and {t['steps_measured']} (TRL) steps after a warm-up step each.\n\n"
    )
    lines = ["| | hybridrl | TRL 1.16 | hybridrl / TRL |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return head + "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["hybridrl", "trl"]
    gen = [r[n]["gen_s"] for n in names]
    train = [r[n]["train_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(names, gen, label="generation", color="#4c78a8")
    ax.barh(names, train, left=gen, label="training + the rest", color="#f58518")
    for i, n in enumerate(names):
        ax.text(gen[i] + train[i] + 0.3, i, f"{r[n]['step_s']:.1f} s", va="center")
    ax.set_xlabel("median seconds per step")
    ax.set_xlim(0, max(r[n]["step_s"] for n in names) * 1.15)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    ax.set_title("GRPO step, SmolLM2-135M fp32, 32 samples x 32 tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
