"""The README's numbers table is what scripts/readme_numbers.py reads from docs/BENCH.md (a stale table fails), the
script reads what the records say, not something else, and the README's commands parse with today's flags."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "scripts" / "readme_numbers.py")
readme_numbers = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = readme_numbers  # dataclasses look their module up there
spec.loader.exec_module(readme_numbers)

BENCH = (ROOT / "docs" / "BENCH.md").read_text()


def test_readme_table_is_what_bench_md_gives():
    readme = (ROOT / "README.md").read_text()
    assert readme_numbers.render(readme, BENCH) == readme, "stale README table: run python scripts/readme_numbers.py"
    assert readme_numbers.main(["--check"]) == 0


def test_every_record_states_its_commit_and_command_in_the_prose_above_it():
    records = readme_numbers.parse_records(BENCH)
    assert {f.record for f in readme_numbers.FIGURES} <= set(records)
    assert readme_numbers.check_records(records) == []


def test_a_changed_figure_or_commit_changes_the_table_or_fails_the_check():
    fig = next(f for f in readme_numbers.FIGURES if f.record == "demo" and f.row == ("(s)",))
    before = readme_numbers.table(BENCH)
    value = readme_numbers.cell(readme_numbers.parse_records(BENCH), fig)
    row = next(line for line in BENCH.splitlines() if line.startswith("| (s) ") and value in line)
    edited = BENCH.replace(row, row.replace(value, "9.99x", 1))
    after = readme_numbers.table(edited)
    assert after != before and "| 9.99x |" in after
    # a paragraph re-measured at another commit, with the marker left behind, is caught
    sha = readme_numbers.parse_records(BENCH)["demo"]["commit"]
    assert f"commit {sha}" in BENCH
    restated = BENCH.replace(f"commit {sha}", "commit 0000000", 1)
    problems = readme_numbers.check_records(readme_numbers.parse_records(restated))
    assert any(sha in p for p in problems)


def test_a_missing_row_or_record_is_an_error_naming_it():
    records = readme_numbers.parse_records(BENCH)
    with pytest.raises(ValueError, match="no record 'nope'"):
        readme_numbers.cell(records, readme_numbers.Figure("nope", ("x",), "avg", "x"))
    with pytest.raises(ValueError, match="0 rows start with"):
        readme_numbers.cell(records, readme_numbers.Figure("demo", ("(zz)",), "avg", "x"))
    with pytest.raises(ValueError, match="exactly one"):
        readme_numbers.render("no markers here", BENCH)


def readme_commands() -> list[list[str]]:
    """Every `specquant ...` command in the README's bash blocks (continuations joined, comments cut, $M / $D as the
    bundled pair), as argv after the program name."""
    readme = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                words = shlex.split(part.replace("$M", "tiny-target").replace("$D", "tiny-draft"))
                if words and words[0].endswith("specquant"):
                    commands.append(words[1:])
    return commands


def test_the_readme_commands_parse_with_todays_flags():
    """A renamed or removed flag breaks the README's recipe: argparse exits (2) on it, so this fails instead."""
    from specquant.cli import build_parser

    commands = readme_commands()
    assert {c[0] for c in commands} >= {"demo", "quantize", "regen", "distill", "bench", "export", "serve"}
    parser, _ = build_parser()
    for argv in commands:
        parser.parse_args(argv)  # SystemExit on an unknown flag or a missing required one
