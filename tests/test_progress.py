"""Live progress: the rollout's token counter, the events a real flow run announces, and the
CLI's live display drawing them (tokens/s while rolling out, steps with an ETA)."""

import gc
import io
import threading
import time

import pytest
import torch
from rich.console import Console

from flows.display import LiveDisplay, held_out_line
from hybrid_engine.batch import Batch
from hybrid_engine.models.loading import load_policy
from hybrid_engine.rollout.base import SamplingParams
from hybrid_engine.rollout.hf import HFRollout
from tasks.progress import listening


def test_rollout_counts_the_tokens_it_samples_as_it_goes(tiny_cfg, tokenizer):
    model = load_policy(tiny_cfg.model, tokenizer, seed=0)
    rollout = HFRollout(model, tokenizer.pad_token_id, tokenizer.eos_token_id, micro_batch_size=4)
    prompts = torch.randint(3, 100, (8, 5))
    batch = Batch({"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts)})
    seen, out = [], {}
    worker = threading.Thread(
        target=lambda: out.update(b=rollout.generate(batch, SamplingParams(48, seed=1)))
    )
    worker.start()
    while worker.is_alive():
        if (p := rollout.progress()) is not None:
            seen.append(p["tokens"])
        time.sleep(0.002)  # a busy loop would starve the generating thread of the GIL
    worker.join()
    assert rollout.progress() is None  # nothing runs now
    # the count is exact: every response token up to and including its EOS, over 2 chunks
    assert (
        rollout.tokens_so_far == out["b"].meta["gen_tokens"] == int(out["b"]["response_mask"].sum())
    )
    assert seen and seen == sorted(seen) and seen[-1] <= rollout.tokens_so_far


class Recorder:
    def __init__(self):
        self.events = []
        self.frozen = []  # gc.get_freeze_count() at the end of each step

    def run_started(self, run_id, start, total):
        self.events.append(("run", start, total))

    def stage_started(self, step, stage, engine):
        self.events.append(("start", step, stage))

    def stage_finished(self, step, stage, seconds, skipped):
        assert seconds >= 0
        self.events.append(("end", step, stage, skipped))

    def step_finished(self, step, metrics, line):
        assert f"step {step:>4}" in line and "critic/score/mean" in metrics
        self.events.append(("step", step))
        self.frozen.append(gc.get_freeze_count())


def test_a_flow_run_announces_its_stages_and_the_display_draws_them(tmp_path, prefect_api):
    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.train import train

    screen = io.StringIO()
    display = LiveDisplay(Console(file=screen, force_terminal=True, width=140))
    display.poll_s = 0.02
    recorder = Recorder()
    overrides = [
        f"storage.root={tmp_path}",
        "tracking.enabled=false",
        "trainer.total_training_steps=2",
        "rollout.max_new_tokens=48",
        "trainer.val_before_train=true",
    ]
    frozen = gc.get_freeze_count()
    with (
        temporary_settings({PREFECT_API_URL: prefect_api}),
        display,
        listening(display),
        listening(recorder),
    ):
        train(config="configs/grpo_tiny.yaml", overrides=overrides, run_id="p1")
        APILogHandler().flush()  # send the run's logs while this test's server is up
    stages = ["rollout", "reward", "advantage", "update"]
    expected = [("run", 1, 2), ("start", 0, "validate"), ("end", 0, "validate", False)]
    for step in (1, 2):
        for s in stages:
            expected += [("start", step, s), ("end", step, s, False)]
        if step == 2:
            expected += [("start", 2, "validate"), ("end", 2, "validate", False)]
        expected.append(("step", step))
    assert recorder.events == expected
    # the run's start-up is frozen out of the collector's sight while it trains, and given
    # back when the flow ends (a process that runs flow after flow would keep each one's)
    assert all(n > frozen for n in recorder.frozen) and gc.get_freeze_count() == frozen
    drawn = screen.getvalue()
    assert "tok/s" in drawn and "tokens" in drawn  # polled from the engine during rollout
    assert "2/2" in drawn and "ETA 0:00:00" in drawn and "s/step" in drawn
    assert "step 2 validate: done in" in drawn  # the last stage, as the display stops


@pytest.mark.fast
def test_the_run_ends_with_held_out_accuracy_before_and_after_and_its_wall_time():
    line = held_out_line([(0, 0.19375), (10, 0.35), (20, 0.425), (30, 0.4)], 597.2)
    assert line == (
        "held-out accuracy: 19.4% before training -> 40.0% at step 30 "
        "(best 42.5% at step 20); wall time 0:09:57"
    )
    assert (
        held_out_line([(0, 0.2)], 5)
        == "held-out accuracy: 20.0% before training; wall time 0:00:05"
    )
    assert held_out_line([(4, 0.5)], 65).startswith("held-out accuracy: 50.0% at step 4;")
    assert "no validation ran" in held_out_line([], 1)
