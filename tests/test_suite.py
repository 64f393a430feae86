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


MAX_LINES, MAX_FMT_SKIPS = 500, 10


def test_no_file_over_500_lines_and_the_formatter_owns_the_layout():
    """The house rules every Python file of the repository keeps: at most 500 lines, and at
    most 10 lines the formatter is told to skip in the code outside tests."""
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=TESTS.parent, capture_output=True, text=True, timeout=30
    ).stdout.split()
    long = {
        f: n for f in files if (n := len((TESTS.parent / f).read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"
    skips = [
        f"{f}:{i}"
        for f in files
        if not f.startswith("tests/")
        for i, line in enumerate((TESTS.parent / f).read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert len(skips) <= MAX_FMT_SKIPS, skips
