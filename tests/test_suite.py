"""The suite's own rules: every process a test starts is bounded in time (a hang fails the
test instead of stalling the suite), and the fast tier stays free of servers and runs."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

TESTS = Path(__file__).parent
WAITS = {"run", "check_output", "check_call", "call"}  # subprocess.<name>(..., timeout=...)
BLOCKS = {"communicate", "wait"}  # <process>.<name>(timeout) or (timeout=...)


def unbounded_calls(source: str) -> list[str]:
    """Calls of `source` that wait for a process without a time limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, ast.unparse(node.func.value)
        timed = any(k.arg == "timeout" for k in node.keywords)
        waits = name in WAITS and owner == "subprocess"
        blocks = name in BLOCKS and owner != "os" and not node.args
        if (waits or blocks) and not timed:
            found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_every_process_a_test_waits_for_is_bounded():
    found = {p.name: unbounded_calls(p.read_text()) for p in sorted(TESTS.glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, found


def test_the_bound_check_finds_an_unbounded_wait():
    src = "import subprocess\np = subprocess.run(['x'], capture_output=True)\nq.communicate()\n"
    assert len(unbounded_calls(src)) == 2
    assert not unbounded_calls("subprocess.run(['x'], timeout=5)\nq.communicate(timeout=5)\n")
