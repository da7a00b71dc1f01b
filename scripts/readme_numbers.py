"""Rewrite the README's table of current numbers from docs/BENCH.md, so the README never holds a typed figure.

docs/BENCH.md is the one home of measured figures. A table there that the README quotes carries a record marker on
the line just above it:

    <!-- record: ID | commit: SHA | cpu: WHAT RAN IT | command: THE COMMAND (parts joined by ' ;; ') -->

The marker adds no figure: its commit and each part of its command must also appear in the prose above the table
(`check_records`), so a re-measured table whose paragraph names a new commit fails until the marker says so too.
FIGURES names, per README line, a record, a row (the leading cells that pick it) and a column (by header); the
cell is copied as written.

    python scripts/readme_numbers.py           rewrite README.md between the markers
    python scripts/readme_numbers.py --check   exit 1 when README.md's table differs (tests/test_readme_numbers.py)
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- numbers: written by scripts/readme_numbers.py from docs/BENCH.md; edit those, not this table -->"
END = "<!-- /numbers -->"
MARKER = re.compile(r"^<!-- record: (?P<body>.*) -->$")


@dataclass(frozen=True)
class Figure:
    record: str
    row: tuple[str, ...]  # the row's first cells, each matched as a prefix
    column: str  # header text, exact
    label: str  # what the README line says it is


FIGURES = (
    Figure("demo", ("(s)",), "avg", "demo speedup over the fp32 target, best row: (s) W4 + QAD target, suffix drafter"),
    Figure("demo", ("(d)",), "avg", "demo speedup: (d) W4 + QAD target, W4 LM draft"),
    Figure("demo", ("(b)",), "avg", "demo speedup: (b) W4 target alone"),
    Figure("demo", ("(hf)",), "avg", "demo speedup: transformers' assisted generation, fp32 pair"),
    Figure("demo-hybrid", ("(q)",), "avg", "hybrid demo speedup: (q) W4 + QAD tiny-hybrid alone"),
    Figure("demo-hybrid", ("(s)",), "avg", "hybrid demo speedup: (s) W4 + QAD tiny-hybrid, suffix drafter"),
    Figure("demo-hybrid", ("(n)",), "avg", "hybrid demo speedup: (n) W4 + QAD tiny-hybrid, its W4 MTP layer"),
    Figure("shapes-2t", ("Qwen3-0.6B",), "ours W4A8 / Q4_0", "Qwen3-0.6B shape, W4A8 decode tok/s / llama.cpp Q4_0"),
    Figure("shapes-2t", ("Qwen3-0.6B",), "ours W4 (float act.) / Q4_0",
           "Qwen3-0.6B shape, W4 (float activations) decode tok/s / llama.cpp Q4_0"),
    Figure("shapes-2t", ("Qwen3-0.6B",), "ours fp32 / llama.cpp F32",
           "Qwen3-0.6B shape, fp32 decode tok/s / llama.cpp F32"),
    Figure("shapes-2t", ("Qwen3-0.6B",), "W4A8 verify v4 / v8",
           "Qwen3-0.6B shape, W4A8 4- / 8-row verify in decode steps"),
    Figure("shapes-2t", ("Qwen3-1.7B",), "ours W4A8 / Q4_0", "Qwen3-1.7B shape, W4A8 decode tok/s / llama.cpp Q4_0"),
    Figure("kl-hybrid", ("GPTQ",), "KL (nats/token)", "tiny-hybrid GPTQ W4 g32: KL to its fp32 self"),
    Figure("serve-latency", ("specquant + W4 draft", "short"), "speedup",
           "served: our W4 draft vs our target-only server, short prompt"),
    Figure("serve-latency", ("llama-server + W4 draft", "short"), "speedup",
           "served: llama-server on our GGUF export vs our target-only server, short prompt"),
)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_records(text: str) -> dict[str, dict]:
    """Every record marker in BENCH.md text: its fields, the table under it and the prose since the last heading."""
    lines, records, prose_start = text.splitlines(), {}, 0
    for i, line in enumerate(lines):
        if line.startswith("#"):
            prose_start = i
        m = MARKER.match(line.strip())
        if not m:
            continue
        rid, *parts = m["body"].split(" | ")
        fields = dict(part.split(": ", 1) for part in parts if ": " in part)
        table = []
        for row in lines[i + 1:]:
            if not row.startswith("|"):
                break
            table.append(_cells(row))
        if len(table) < 3 or _missing_fields(fields):
            raise ValueError(f"docs/BENCH.md line {i + 1}: record {rid!r} needs commit, cpu and command fields and a "
                             f"markdown table on the next line")
        if rid in records:
            raise ValueError(f"docs/BENCH.md line {i + 1}: record {rid!r} appears twice; give each table its own id")
        records[rid] = {**fields, "header": table[0], "rows": table[2:], "prose": "\n".join(lines[prose_start:i]),
                        "line": i + 1}
    return records


def _missing_fields(fields: dict) -> list[str]:
    return [k for k in ("commit", "cpu", "command") if not fields.get(k)]


def check_records(records: dict[str, dict]) -> list[str]:
    """Marker fields the prose above the table does not state (whitespace-insensitive); empty when all agree."""
    norm = lambda s: " ".join(s.replace("`", "").split())  # noqa: E731
    problems = []
    for rid, rec in records.items():
        prose = norm(rec["prose"])
        for what in [rec["commit"], *rec["command"].split(" ;; ")]:
            if norm(what) not in prose:
                problems.append(f"record {rid!r} (docs/BENCH.md line {rec['line']}): {what!r} is not in the prose "
                                f"above its table; make the record line say what the paragraph says, then run "
                                f"python scripts/readme_numbers.py")
    return problems


def cell(records: dict[str, dict], fig: Figure) -> str:
    rec = records.get(fig.record)
    if rec is None:
        raise ValueError(f"docs/BENCH.md has no record {fig.record!r}: put a `<!-- record: {fig.record} | commit: "
                         f"... | cpu: ... | command: ... -->` line right above the table it names "
                         f"(scripts/readme_numbers.py)")
    if fig.column not in rec["header"]:
        raise ValueError(f"record {fig.record!r}: no column {fig.column!r}; its columns are {rec['header']}")
    col = rec["header"].index(fig.column)
    rows = [r for r in rec["rows"] if all(r[i].startswith(p) for i, p in enumerate(fig.row) if i < len(r))]
    if len(rows) != 1:
        raise ValueError(f"record {fig.record!r}: {len(rows)} rows start with {fig.row} (need exactly one)")
    return rows[0][col].replace("**", "")


def table(bench_text: str) -> str:
    """The README's numbers table (markdown) from docs/BENCH.md's text."""
    records = parse_records(bench_text)
    out = ["| figure | value | commit | CPU | command |", "|---|---|---|---|---|"]
    for fig in FIGURES:
        rec = records.get(fig.record, {})
        value = cell(records, fig)
        command = "; ".join(f"`{part}`" for part in rec["command"].split(" ;; "))
        out.append(f"| {fig.label} | {value} | {rec['commit']} | {rec['cpu']} | {command} |")
    return "\n".join(out)


def render(readme: str, bench_text: str) -> str:
    """README text with the block between BEGIN and END replaced by table(bench_text)."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise ValueError(f"README.md needs exactly one {BEGIN!r} and one {END!r} line")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(bench_text)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when README.md's table is not what BENCH.md gives")
    args = p.parse_args(argv)
    readme_path, bench_text = ROOT / "README.md", (ROOT / "docs" / "BENCH.md").read_text()
    problems = check_records(parse_records(bench_text))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    readme = readme_path.read_text()
    new = render(readme, bench_text)
    if args.check:
        if new != readme:
            print("README.md's numbers table is stale: run python scripts/readme_numbers.py", file=sys.stderr)
            return 1
        return 0
    if new != readme:
        readme_path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
