"""The docs date figures by commit, never by the round of work that made them, docs/BENCH.md stays a report card (the
current figure per topic, within a line budget), and every script in benchmarks/ is one a doc tells users to run
(`python benchmarks/NAME.py ...`), importing the package only, never a sibling."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
# "session 12", "round 3", "last session", "this session", "an earlier session": figures are dated by commit (a
# command's `--rounds 3` flag is not a date)
ROUND_OF_WORK = re.compile(r"(?<!-)\b(sessions?[ -]\d+|rounds? \d+|(last|this|earlier|previous|next) sessions?|"
                           r"sessions? that)\b", re.IGNORECASE)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_figure_is_dated_by_round_of_work(doc):
    hits = [f"{doc.name}:{i}: {line.strip()}" for i, line in enumerate(doc.read_text().splitlines(), 1)
            if ROUND_OF_WORK.search(line)]
    assert not hits, "date figures by commit, not by round of work:\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_is_for():
    for text in ("Against session 12's run", "round 3 of the work", "measured in the last session",
                 "the sessions that built this", "the session-4 change"):
        assert ROUND_OF_WORK.search(text), text
    for text in ("issue 45 timed", "commit 34d1b64", "3 timed rounds", "a session of serve", "--rounds 5"):
        assert not ROUND_OF_WORK.search(text), text


BENCH_MAX_LINES = 500


def test_bench_md_stays_a_report_card():
    lines = len((ROOT / "docs" / "BENCH.md").read_text().splitlines())
    assert lines <= BENCH_MAX_LINES, (
        f"docs/BENCH.md has {lines} lines, more than {BENCH_MAX_LINES}: condense it to the current figure per topic "
        "(each with its commit, CPU and command); superseded figures and their history are git's")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_is_run_from_a_doc(script):
    command = f"python benchmarks/{script.name}"
    assert any(command in doc.read_text() for doc in DOCS), (
        f"{script.name}: no doc shows `{command} ...`; document it (docs/BENCH.md lists the scripts) or retire it")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmarks_import_the_package_not_each_other(script):
    siblings = {p.stem for p in SCRIPTS}
    tree = ast.parse(script.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & siblings, f"{script.name} imports {sorted(imported & siblings)}: move the shared code into " \
                                    "the package (e.g. specquant.bench)"
    inserts = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "sys.path.insert"]
    assert not inserts, f"{script.name} puts a folder on sys.path; import from specquant instead"
