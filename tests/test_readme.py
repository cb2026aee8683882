"""The README's promises that a file can check: its test command is what CI runs, its main-job
command names files that exist, and every path it or the docs point to exists.

Cost: subprocesses; under a second on a 2-core AMD EPYC (docs/ci.md)."""
import os
import re
import subprocess
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
    # and after it, its bit-for-bit tests under another kernel configuration (docs/zero.md)
    at = ci.index(TEST_COMMAND)
    assert any("bash .ci/kernels" in line for line in ci[at + 1:]), ci
    assert (ROOT / ".ci" / "kernels").is_file()


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


def _install_calls(tmp_path, **env) -> list[list[str]]:
    """The interpreter calls ``launch/install.sh`` makes, with a stand-in interpreter that records them."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> {log}\nprintf "\\n" >> {log}\ncat >/dev/null\n')
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(ROOT / "launch" / "install.sh")], env={**os.environ, "PYTHON": str(fake), **env},
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert r.returncode == 0, r.stderr
    return [[a for a in line.split("\0") if a] for line in log.read_text().split("\n") if line]


def test_install_sh_takes_the_cpu_index_only_when_asked(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    default = _install_calls(tmp_path / "a")
    torch_call = next(c for c in default if "torch==2.13.0" in c)
    assert "--index-url" not in torch_call  # CI and this workplace: pip's own configuration decides
    cpu = _install_calls(tmp_path / "b", CPU_ONLY="1")
    torch_call = next(c for c in cpu if "torch==2.13.0" in c)
    assert torch_call[torch_call.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert all("--index-url" not in c for c in cpu if "torch==2.13.0" not in c)  # the package itself: from PyPI
    text = (ROOT / "launch" / "install.sh").read_text()
    assert "CUDA build" in text and "CPU_ONLY=1" in README and "CUDA build" in README
