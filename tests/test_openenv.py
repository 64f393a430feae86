"""OpenEnv environments (the real package, the [openenv] extra) in multi-turn rollouts,
through OpenEnv's own client: a server the test starts on 127.0.0.1 with OpenEnv's
`create_app` (text actions, and an MCP environment whose tools become the template's), and a
class hybridrl serves itself (environments in tests/openenv_envs.py)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port, stop, wait_http

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.rollout.envs import make_environment

pytestmark = pytest.mark.fast
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def servers():
    """{kind: URL} of OpenEnv servers in processes of their own."""
    procs, urls = [], {}
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    for kind in ("retry", "calc"):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, str(TESTS / "openenv_envs.py"), str(port), kind],
            env=env,
            start_new_session=True,
        )
        procs.append(proc)
        urls[kind] = f"http://127.0.0.1:{port}"
        wait_http(f"{urls[kind]}/health", 60, proc)
    yield urls
    for proc in procs:
        stop(proc)


def rollout(target: str):
    cfg = load_config(
        "configs/multiturn_tiny.yaml", [f"rollout.multi_turn.environment=openenv:{target}"]
    )
    engine = Engine(cfg)
    return engine.reward(engine.rollout(1))


@pytest.mark.parametrize("where", ["server", "class"])
def test_text_action_environment_runs_its_turns_and_rewards(servers, where):
    batch = rollout(servers["retry"] if where == "server" else "openenv_envs.Retry")
    assert batch["turns"] == [2] * 16 and batch["stop"] == ["done"] * 16
    for messages, score in zip(batch["messages"], batch["scores"].tolist(), strict=True):
        assert messages[2]["content"].startswith("Episode seeded")  # the reset observation
        assert messages[-2] == {"role": "user", "content": "Longer, please."}
        assert score == pytest.approx(min(len(messages[-1]["content"]) / 100, 1.0))


def test_mcp_environment_tools_reach_the_template_and_calls_run(servers):
    env = make_environment(f"openenv:{servers['calc']}", {})
    messages = env.reset({"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}, 7)
    assert messages == [{"role": "user", "content": "What is 2 + 3?"}]
    assert [t["function"]["name"] for t in env.template_tools] == ["add"]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    step = env.step(call)
    assert step.observation == [{"role": "tool", "content": "5"}] and not step.done
    assert step.info == {"tool_calls": 1, "tool_errors": 0}
    bad = env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
    assert bad.info["tool_errors"] == 1 and "mul" in bad.observation[0]["content"]
    assert env.step("It is 5.").done  # no tool call: the final answer
    env.close()
    batch = rollout(servers["calc"])  # the random model calls no tool: one turn each
    assert batch["turns"] == [1] * 16 and batch.meta["metrics"]["multi_turn/tool_calls/mean"] == 0


def test_the_text_field_must_be_known():
    with pytest.raises(ValueError, match=r"string fields \['path', 'text'\].*action_field"):
        make_environment("openenv:openenv_envs.TwoFields", {})
    env = make_environment("openenv:openenv_envs.TwoFields", {"action_field": "text"})
    env.reset({"prompt": []}, 1)
    assert env.step("x").observation == [{"role": "user", "content": "Longer, please."}]
    with pytest.raises(ValueError, match="action_field='body'"):
        make_environment("openenv:openenv_envs.TwoFields", {"action_field": "body"})
    with pytest.raises(ValueError, match="openenv:no_such.Env"):
        make_environment("openenv:no_such.Env", {})


def test_a_served_class_waits_for_its_server_within_the_timeout():
    with pytest.raises(TimeoutError, match=r"within 1e-09 s.*env_kwargs\.timeout_s"):
        make_environment("openenv:openenv_envs.Unhurried", {"timeout_s": 1e-9})
    env = make_environment("openenv:openenv_envs.Unhurried", {})  # the next try starts it
    env.reset({"prompt": []}, 1)
    assert env.step("x").observation == [{"role": "user", "content": "Longer, please."}]
    env.close()
    silent = socket.socket()  # a server that takes connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    with pytest.raises(TimeoutError, match=r"did not answer within 0.2 s.*env_kwargs\.timeout_s"):
        make_environment(f"openenv:{url}", {"timeout_s": 0.2})
    silent.close()
