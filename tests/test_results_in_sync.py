"""Tables in README.md and docs/*.md are rendered from the results JSON (benchmarks/tables.py).

A block ``<!-- table:NAME -->`` ... ``<!-- /table:NAME -->`` must equal ``tables.render(NAME)``:
when a benchmark rewrites its JSON and a number changes, the stale block fails here (fix:
``python benchmarks/tables.py --update README.md docs/*.md``).  Files without blocks pass.
The self-tests below check that a tampered block, a drifted JSON, an unknown name and an
unclosed block are all caught.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
from canzona_testkit.kernels import assert_bits

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load_tables():
    spec = importlib.util.spec_from_file_location("canzona_benchmarks_tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load_tables()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
AVAILABLE = [name for name, table in tables.TABLES.items() if (RESULTS / f"{table.stem}.json").is_file()]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_block_equals_its_rendering(path: Path) -> None:
    problems = tables.check_text(path.read_text())
    assert not problems, (f"{path.relative_to(ROOT)}: " + "; ".join(problems)
                          + " -- run: python benchmarks/tables.py --update README.md docs/*.md")


@pytest.mark.parametrize("name", AVAILABLE)
def test_every_renderer_renders_its_results_file(name: str) -> None:
    lines = tables.render(name).splitlines()
    assert len(lines) >= 3 and re.fullmatch(r"\|(---\|)+", lines[1])
    columns = lines[0].count("|")
    assert all(line.startswith("| ") and line.count("|") >= columns for line in lines[2:]), name


def test_paper_experiments_md_is_its_json() -> None:
    if not (RESULTS / "paper_experiments.json").is_file():
        pytest.skip("benchmarks/results/paper_experiments.json not generated")
    data = json.loads((RESULTS / "paper_experiments.json").read_text())
    assert (RESULTS / "paper_experiments.md").read_text() == tables.paper_experiments_markdown(data)
    for png in data["plots"]:
        assert (RESULTS / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _a_table() -> str:
    if not AVAILABLE:
        pytest.skip("no results JSON to render")
    return "fig3_dp" if "fig3_dp" in AVAILABLE else AVAILABLE[0]


def test_tampered_block_is_detected_and_update_fixes_it(tmp_path: Path) -> None:
    name = _a_table()
    doc = tmp_path / "doc.md"
    doc.write_text(f"# intro\n\n<!-- table:{name} -->\n| old | table |\n<!-- /table:{name} -->\n\ntext after\n")
    assert tables.check_text(doc.read_text()) == [f"{name}: stale (differs from its rendering of "
                                                  f"{tables.TABLES[name].stem}.json)"]
    assert tables.main(["--check", str(doc)]) == 1
    assert tables.main(["--update", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# intro\n\n") and text.endswith("\n\ntext after\n")
    assert tables.render(name) in text and tables.check_text(text) == []
    assert tables.main(["--check", str(doc)]) == 0
    # change one digit inside the block: caught, and named
    body = text.split(f"<!-- table:{name} -->\n", 1)[1]
    digit = re.search(r"\d", body)
    assert digit is not None
    i = len(text) - len(body) + digit.start()
    tampered = text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:]
    problems = tables.check_text(tampered)
    assert len(problems) == 1 and problems[0].startswith(f"{name}: stale")
    assert tables.update_text(tampered) == text  # update restores it


def test_drifted_results_json_is_detected(tmp_path: Path) -> None:
    name = "fig3_dp"
    if name not in AVAILABLE:
        pytest.skip("benchmarks/results/paper_experiments.json not generated")
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "paper_experiments.json", results / "paper_experiments.json")
    doc = f"<!-- table:{name} -->\nx\n<!-- /table:{name} -->\n"
    synced = tables.update_text(doc, results)
    assert tables.check_text(synced, results) == []
    data = json.loads((results / "paper_experiments.json").read_text())
    data["fig3"]["plans"][0]["flops_ratio"] += 0.25  # a benchmark rerun moved one number
    (results / "paper_experiments.json").write_text(json.dumps(data))
    assert [p.split(":")[0] for p in tables.check_text(synced, results)] == [name]
    path = tmp_path / "doc.md"
    path.write_text(synced)
    assert tables.main(["--results", str(results), "--check", str(path)]) == 1


def test_unknown_unclosed_and_missing() -> None:
    assert tables.check_text("no blocks at all\n") == []
    unknown = tables.check_text("<!-- table:nope -->\n| x |\n<!-- /table:nope -->\n")
    assert len(unknown) == 1 and unknown[0].startswith("nope: cannot render") and "Unknown table 'nope'" in unknown[0]
    unclosed = tables.check_text("<!-- table:fig3_dp -->\n| x |\n")
    assert len(unclosed) == 1 and "'fig3_dp'" in unclosed[0] and "not closed" in unclosed[0]
    with pytest.raises(ValueError, match="not closed"):
        tables.update_text("<!-- table:fig3_dp -->\n| x |\n")
    with pytest.raises(ValueError, match="Unknown table 'nope'"):
        tables.render("nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tables.render("fig3_dp", results=ROOT / "no-such-dir")


def test_dp4_claim_is_stated_against_plain_data_parallelism() -> None:
    """The Exactness line for DP=4 (README's headline, docs/benchmarks.md's section) is the measured
    one (benchmarks/dp_exactness.py):
    Canzona's deviation on the matrices is of the size plain DP with torch.optim.Muon has."""
    if not (RESULTS / "dp_exactness.json").is_file():
        pytest.skip("benchmarks/results/dp_exactness.json not generated")
    for doc in ("README.md", "docs/benchmarks.md"):  # the headline and the full Exactness section
        text = (ROOT / doc).read_text()
        assert "(Muon within 1e-6)" not in text, doc
        assert "as much as plain data parallelism" in text and "python benchmarks/dp_exactness.py" in text, doc
        assert "<!-- table:dp_exactness -->" in text, doc
    rows = {(r["dp"], r["run"].split(",")[0]): r for r in json.loads((RESULTS / "dp_exactness.json").read_text())["rows"]}
    assert_bits(rows[(2, "CanzonaMuon")]["max_abs_diff_matrices"], 0.0)
    canzona, plain = rows[(4, "CanzonaMuon")]["max_abs_diff_matrices"], rows[(4, "torch.optim.Muon")]["max_abs_diff_matrices"]
    assert 0 < canzona <= 2 * plain


def test_main_job_doc_figures_come_from_the_results_file() -> None:
    """docs/main_job.md's measured figures (speed, wall time, plan loads, compare losses) are
    table blocks rendered from benchmarks/results/main_job.json (``python benchmarks/main_job.py``);
    outside the blocks it quotes no throughput or timing that no command regenerates."""
    text = (ROOT / "docs" / "main_job.md").read_text()
    for name in ("main_job_run", "main_job_plan", "main_job_reference", "main_job_compare"):
        assert f"<!-- table:{name} -->" in text, name
    prose = re.sub(r"<!-- table:(\S+) -->.*?<!-- /table:\1 -->", "", text, flags=re.S)
    stale = re.findall(r"[^\n]*(?:\d[\d,.]*\s?(?:tokens/s|tok/s|MB/s)|~\s?\d[\d.,]*\s?(?:s|ms|min)\b)[^\n]*", prose)
    assert not stale, stale


def test_the_renderer_formats_every_spec() -> None:
    """The declarative spec's renderer (benchmarks/tables.py): templates over each row, the named
    specs, None as the table's ``none`` text, text shown as is, headers from the whole JSON."""
    spec = tables.Table(
        "x", "a synthetic table", "runs",
        (tables.Col("run of {label}", "{name}"), tables.Col("share", "{share:pct} / {share:pct2}"),
         tables.Col("size", "{mib:mib} ({numel:bucket})"), tables.Col("ms", "{seconds:ms.1f}"),
         tables.Col("ratio", "{ratio:x.2f}"), tables.Col("per rank", "{ranks:list.1f}"),
         tables.Col("split", "{n:.0f}{n:split}"), tables.Col("rows", lambda r: str(len(r)))),
        none="n/a")
    data = {"label": "test", "runs": [
        {"name": "a", "share": 0.25, "mib": 2048.0, "numel": 40_000_000, "seconds": 0.0125, "ratio": 1.5,
         "ranks": [1.0, 2.25], "n": 3},
        {"name": "b", "share": "quoted", "mib": 12.5, "numel": None, "seconds": None, "ratio": None, "ranks": [],
         "n": 0}]}
    assert tables.render_table(spec, data).splitlines() == [
        "| run of test | share | size | ms | ratio | per rank | split | rows |",
        "|---|---|---|---|---|---|---|---|",
        "| a | 25.0% / 25.00% | 2.00 GiB (40M) | 12.5 | 1.50x | 1.0, 2.2 | 3, 3 split | 8 |",
        "| b | quoted / quoted | 12.5 MiB (one bucket) | n/a | n/a |  | 0 | 8 |"]
    with pytest.raises(KeyError):
        tables.render_table(tables.Table("x", "a typo", "runs", (tables.Col("h", "{nmae}"),)), data)
