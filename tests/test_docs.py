"""The documentation site: `mkdocs build --strict` passes (no broken link or anchor, no page
outside the navigation), its reference pages are generated from the code while it builds, and
the README stays a landing page."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}{built.stderr}"
    return out


def test_the_site_builds_strict(site: Path) -> None:
    assert (site / "index.html").is_file()


def test_the_reference_pages_are_generated_from_the_code(site: Path) -> None:
    import typer

    from flows.cli import app
    from hybrid_engine.config import HybridConfig, flatten

    page = (site / "reference" / "configuration" / "index.html").read_text()
    assert "generated:" not in page, "a marker was left in the page"
    missing = [key for key in flatten(HybridConfig()) if f"<code>{key}</code>" not in page]
    assert not missing, f"keys missing from the configuration reference: {missing}"

    page = (site / "reference" / "cli" / "index.html").read_text()
    root = typer.main.get_command(app)
    commands = root.list_commands(root.context_class(root, info_name="hybridrl"))
    assert commands and all(f"hybridrl {name}" in page for name in commands)

    page = (site / "reference" / "registries" / "index.html").read_text()
    assert "<code>grpo</code>" in page and "<code>vanilla</code>" in page


def test_the_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into docs/"
    assert "    bash scripts/demo.sh" in lines and "    bash scripts/test.sh" in lines


# A measured figure: a share, a duration, a rate, a test count. Each lives once, in docs/,
# with its machine and date; the README links there.
FIGURE = re.compile(
    r"\d+(?:\.\d+)?\s?(?:%|s\b|min\b|minutes\b|seconds\b|hours?\b|tok/s|GiB|GB\b|MB\b)"
    r"|\b\d+ (?:tests|passed)\b|\b\d+:\d\d\b"
)


@pytest.mark.fast
def test_the_readme_repeats_no_figure_the_docs_hold() -> None:
    text = (ROOT / "README.md").read_text()
    found = [m.group(0) for m in FIGURE.finditer(text)]
    assert not found, f"README.md holds measured figures {found}: keep them in docs/, link there"
    assert "docs/index.md#what-is-verified-and-what-is-not" in text  # the one status table
    assert "| status | what |" not in text
