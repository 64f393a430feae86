"""A run stored by earlier code still resumes, forks and replays. `tests/data/stored-v1` is
a run written at commit 6b451b0 (before the Engine's concerns moved out), killed as step 3's
rollout started; made from that checkout, on a machine whose CPU is `MADE_ON`, with

    PYTHONPATH=tests HYBRIDRL_FAULT="step-3/rollout:start=kill" hybridrl train \
        configs/grpo_tiny.yaml <tests/run_driver.py ARGS, with trainer.save_freq=0> \
        tracking.enabled=false storage.root=ROOT --run-id stored-v1

It holds no checkpoint (save_freq 0), so its weights come back by replaying its stored
updates from the seeded start. Finished by today's code on a CPU of that model it must equal
the uninterrupted reference run of the pipeline tests bit for bit. On another CPU the float
kernels round differently (an AMD EPYC with AVX2 replays its log-probs 1e-5 apart), so there
the sampled tokens and rewards must still be equal and every other value within `TOL`."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from run_driver import assert_same_run, driver, final_state, fs_for

STORED = Path(__file__).parent / "data" / "stored-v1"
MADE_ON = "Intel(R) Xeon(R) Processor with AMX"
TOL = 1e-4


def cpu_model() -> str:
    """The CPU's model name, and whether it has AMX (its matmuls round differently)."""
    info = Path("/proc/cpuinfo").read_text()
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    amx = re.search(r"^flags\s*:.*\bamx_tile\b", info, re.M)
    return (name.group(1).strip() if name else "") + (" with AMX" if amx else "")


SAME_CPU = cpu_model() == MADE_ON


def assert_close_run(got, reference) -> None:
    """`reference` up to float rounding: same steps, weights and metrics within TOL."""
    (w, hist), (w_ref, hist_ref) = got, reference
    assert w.keys() == w_ref.keys()
    for k in w_ref:
        gap = (w[k].float() - w_ref[k].float()).abs().max().item()
        assert gap <= TOL, f"{k} is {gap:.2e} from the uninterrupted run"
    assert [r["step"] for r in hist] == [r["step"] for r in hist_ref]
    for row, ref in zip(hist, hist_ref, strict=True):
        for key, want in ref.items():
            if key.startswith(("timing_s/", "perf/")) or not isinstance(want, float):
                continue
            assert abs(row[key] - want) <= TOL * max(1.0, abs(want)), (row["step"], key)


def assert_replay_close(out: str) -> None:
    """Each stage bit-equal, or a float difference within TOL in a stage past the rollout
    and reward (those sample and score the same tokens on any CPU)."""
    rows: list[str] = []
    for line in out.split("replay of")[0].splitlines():  # the lines before the table
        if re.match(r"\s*\d+/\w+: ", line):
            rows.append(line)
        elif rows and line.strip():
            rows[-1] += " " + line.strip()  # a long result wraps onto the next line
    assert rows, out
    for line in rows:
        where, result = line.strip().split(": ", 1)
        if result.startswith("bit-equal"):
            continue
        assert where.split("/")[1] in ("advantage", "update"), line
        if m := re.search(r"max \|difference\| ([0-9.e+-]+)", result):
            assert float(m.group(1)) <= TOL, line
        else:
            stored, replayed = map(float, re.findall(r"(?:stored|replayed)\s+([0-9.e+-]+)", line))
            assert abs(stored - replayed) <= TOL * max(1.0, abs(stored)), line


def test_a_run_stored_by_earlier_code_resumes_forks_and_replays(tmp_path, prefect_api, reference):
    root = str(tmp_path / "runs")
    shutil.copytree(STORED, f"{root}/stored-v1")
    fs = fs_for(root, None)
    same = assert_same_run if SAME_CPU else assert_close_run
    rc, out = driver(["replay", "stored-v1", "--all", "--storage-root", root], prefect_api)
    if SAME_CPU:
        assert rc == 0 and "all equal" in out, out
    else:
        assert rc in (0, 1), out
        assert_replay_close(out)
    rc, out = driver(
        ["fork", "stored-v1", "--at", "2/advantage", "--run-id", "f1", "--storage-root", root],
        prefect_api,
    )
    assert rc == 0, out
    same(final_state(fs, f"{root}/f1"), reference)
    rc, out = driver(["resume", "stored-v1", "--storage-root", root], prefect_api)
    assert rc == 0, out
    assert "(from storage" in out  # its committed stages were not computed again
    same(final_state(fs, f"{root}/stored-v1"), reference)
