"""The README's promises that a file can check: its test command is what CI runs, its main-job
command names files that exist, and every path it or the docs point to exists."""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

TEST_COMMAND = "bash launch/install.sh && python3 -m pytest -q tests"
MAIN_COMMAND = "bash launch/install.sh && launch/train.sh"


def _bash_lines(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in _bash_lines(README)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == TEST_COMMAND, ci[-1]


def test_main_job_command_is_runnable():
    assert MAIN_COMMAND in _bash_lines(README)
    for script in ("launch/install.sh", "launch/train.sh"):
        assert (ROOT / script).is_file(), script
    assert os.access(ROOT / "launch" / "train.sh", os.X_OK)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_referenced_path_exists(doc):
    text = doc.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)  # markdown links, anchors dropped
    paths = re.findall(r"(?<![\w/.-])((?:benchmarks|configs|launch|docs|tests|canzona_ds)/[\w./-]+\.(?:py|md|json|yaml|sh))",
                       text)
    missing = []
    for ref in links:
        if "://" in ref:
            continue
        base = doc.parent if not (ROOT / ref).exists() else ROOT
        if not (base / ref).exists():
            missing.append(ref)
    missing += [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"{doc.name} points to paths that do not exist: {sorted(set(missing))}"
