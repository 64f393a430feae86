"""The scheduler of a shared pool (`hybrid_engine.pool.turns`), on its own: who gets the
workers next (priority, then round robin at stage boundaries), which runs are refused at
attach (a must-match field, ray.max_runs), and a run whose driver is gone is detached."""

import subprocess
import sys
import time

import psutil
import pytest

from hybrid_engine.config import ConfigError, load_config
from hybrid_engine.pool.claim import driver_id, gone
from hybrid_engine.pool.turns import Turns

pytestmark = pytest.mark.fast

SPEC = {"model": {"path": "tiny"}, "actor.layout": {"dp": 1}}


def who(run: str, priority: int = 0, proc: psutil.Process | None = None) -> dict:
    me = driver_id(run, per_run=True)
    if proc is not None:
        me |= {"pid": proc.pid, "started": proc.create_time(), "owner": f"dead/{run}"}
    return {**me, "timeout_s": 60, "priority": priority, "slice_s": 1e9}


def attach(t: Turns, w: dict, spec: dict = SPEC, max_runs: int = 4) -> str | None:
    return t.attach(w, spec, max_runs, gone)


def test_turns_go_by_priority_then_round_robin_at_stage_boundaries():
    t = Turns()
    a, b, c = who("a"), who("b"), who("c", priority=1)
    for w in (a, b):
        assert attach(t, w) is None
    assert t.request(a["owner"], "step-1/rollout", gone)["granted"]
    assert not t.request(b["owner"], "step-1/rollout", gone)["granted"]
    # a's turn ends; a asks again at once, behind b that waited
    t.done(a["owner"])
    assert not t.request(a["owner"], "step-1/advantage", gone)["granted"]
    assert t.request(b["owner"], "step-1/rollout", gone)["granted"]
    assert attach(t, c) is None  # a higher priority goes before a, which waited longer
    assert not t.request(c["owner"], "step-1/rollout", gone)["granted"]
    t.done(b["owner"])
    assert not t.request(a["owner"], "step-1/advantage", gone)["granted"]
    assert t.request(c["owner"], "step-1/rollout", gone)["granted"]
    shown = {r["run"]: r for r in t.read()}
    assert shown["c"]["active"] and shown["c"]["stage"] == "step-1/rollout"
    assert shown["a"]["waiting_s"] > 0 and shown["a"]["turns"] == 1
    assert shown["b"]["turns"] == 1 and not shown["b"]["active"]


def test_a_run_is_refused_for_a_must_match_field_or_past_max_runs_in_one_line():
    t = Turns()
    assert attach(t, who("a"), max_runs=2) is None
    other = {**SPEC, "actor.layout": {"dp": 2}}
    line = attach(t, who("b"), other, max_runs=2)
    assert line is not None and "\n" not in line
    assert "another actor.layout" in line and "run(s) a" in line
    assert attach(t, who("b"), max_runs=2) is None
    line = attach(t, who("c"), max_runs=2)
    assert "ray.max_runs=2" in line and "a, b" in line
    t.detach(who("a")["owner"])
    assert attach(t, who("c"), max_runs=2) is None


def test_a_run_whose_driver_died_is_detached_and_its_turn_released():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = who("dead", proc=psutil.Process(proc.pid))
        t = Turns()
        assert attach(t, dead) is None and attach(t, who("alive")) is None
        assert t.request(dead["owner"], "step-1/rollout", gone)["granted"]
        assert not t.request(who("alive")["owner"], "step-1/rollout", gone)["granted"]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    got = t.request(who("alive")["owner"], "step-1/rollout", gone)
    assert got["granted"] and got["live"] == [who("alive")["owner"]]
    assert "is gone" in t.renew(dead["owner"])
    # a run silent past its ray.claim_timeout_s goes too (on the scheduler's own clock)
    quiet = {**who("quiet"), "timeout_s": 0.05}
    assert attach(t, quiet) is None
    time.sleep(0.1)
    t.request(who("alive")["owner"], "step-1/reward", gone)
    assert [r["run"] for r in t.read()] == ["alive"]
    assert "not renewed" in t.renew(quiet["owner"])


def test_a_turn_past_its_slice_while_another_run_waits_is_reported():
    t = Turns()
    a, b = {**who("a"), "slice_s": 0.05}, who("b")
    attach(t, a), attach(t, b)
    assert t.request(a["owner"], "step-1/update", gone)["granted"]
    time.sleep(0.1)
    assert not {r["run"]: r for r in t.read()}["a"]["over_slice"]  # nobody waits yet
    got = t.request(b["owner"], "step-1/rollout", gone)
    assert got["over_slice"] and got["holder"]["run"] == "a"
    assert got["holder"]["stage"] == "step-1/update"


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["trainer.max_staleness=1"], "ray.rollout=separate (trainer.max_staleness=1"),
        (["ray.rollout=separate"], "ray.rollout=separate with ray.when_busy=share"),
    ],
)
def test_what_a_shared_pool_does_not_run_yet_is_refused_in_one_line(overrides, needle):
    base = ["trainer.backend=ray", "ray.when_busy=share"]
    with pytest.raises(ConfigError) as e:
        load_config("configs/grpo_tiny.yaml", [*base, *overrides])
    assert needle in str(e.value) and "\n" not in str(e.value)
