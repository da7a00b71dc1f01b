"""Thresholds and the pass/fail decision: absolute minimums and/or ratios to a baseline's score; the kl gate's
bounds. Exit codes: 0 every gate passed, 1 a gate failed, 2 bad input (specquant.cli)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.gate.config import ALL_GATES, KL_GATE, LM_EVAL_GATES

EXIT_PASS, EXIT_FAIL = 0, 1
SCORE_RULES = {"min", "ratio", "metric"}
KL_RULES = {"max_kl", "max_ppl_ratio", "min_top1", "max_lost_mass"}


def load_thresholds(path: str | None, defaults: dict) -> dict:
    """Defaults, with the gates named in a JSON file replaced: {"ifeval": {"min": 0.8, "ratio": 0.95}, ...}."""
    rules = {k: dict(v) for k, v in defaults.items()}
    if path is None:
        return rules
    p = Path(path)
    if not p.is_file():
        raise SpecquantError(f"thresholds file {path!r} does not exist; pass a JSON file such as "
                             '{"ifeval": {"ratio": 0.95}, "kl": {"max_kl": 0.1}}')
    try:
        given = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise SpecquantError(f"thresholds file {path!r} is not valid JSON ({e})") from None
    if not isinstance(given, dict):
        raise SpecquantError(f"thresholds file {path!r} must hold an object keyed by gate ({', '.join(ALL_GATES)})")
    for gate, rule in given.items():
        if gate not in ALL_GATES:
            raise SpecquantError(f"thresholds file {path!r}: unknown gate {gate!r}; gates are {', '.join(ALL_GATES)}")
        allowed = KL_RULES if gate == KL_GATE else SCORE_RULES
        if not isinstance(rule, dict) or not rule or set(rule) - allowed:
            raise SpecquantError(f"thresholds file {path!r}: gate {gate!r} takes a non-empty object with keys from "
                                 f"{', '.join(sorted(allowed))}; got {rule!r}")
        for k, v in rule.items():
            # json reads NaN and Infinity, which would make every comparison with them False
            if k != "metric" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise SpecquantError(f"thresholds file {path!r}: {gate}.{k} must be a finite number, got {v!r}")
        rules[gate] = dict(rule)
    return rules


def needs_baseline(gate: str, rule: dict) -> bool:
    return gate == KL_GATE or "ratio" in rule


def metric_of(gate: str, rule: dict) -> str:
    return rule.get("metric", LM_EVAL_GATES[gate]["metric"])


@dataclass
class GateResult:
    gate: str
    metric: str
    value: float | None
    baseline: float | None
    threshold: str  # the rule as applied, e.g. ">= 0.621 (0.90 x 0.690)"
    passed: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def decide_score(gate: str, rule: dict, value: float, baseline: float | None) -> GateResult:
    """Pass if value >= max(min, ratio x baseline) over the rules given."""
    bounds, parts = [], []
    if "min" in rule:
        bounds.append(float(rule["min"]))
        parts.append(f"{rule['min']:.3f}")
    if "ratio" in rule:
        assert baseline is not None, "ratio thresholds need a baseline (checked at the CLI)"
        bounds.append(rule["ratio"] * baseline)
        parts.append(f"{rule['ratio']:.3f} x {baseline:.3f}")
    bound = max(bounds)
    return GateResult(gate, metric_of(gate, rule), value, baseline, f">= {bound:.4f} ({'; '.join(parts)})",
                      value >= bound)


def decide_kl(rule: dict, stats: dict) -> list[GateResult]:
    """One row per kl bound: KL(baseline || model), perplexity ratio model/baseline, top-1 agreement, and for a
    vocabulary-pruned model the baseline's mass on the cut ids (no row for a model that measured none)."""
    rows = []
    checks = {"max_kl": ("kl", lambda v, b: v <= b, "<="), "max_ppl_ratio": ("ppl_ratio", lambda v, b: v <= b, "<="),
              "min_top1": ("top1_agree", lambda v, b: v >= b, ">="),
              "max_lost_mass": ("lost_mass", lambda v, b: v <= b, "<=")}
    for key, (stat, ok, op) in checks.items():
        if key in rule and stat in stats:
            baseline = stats["ppl_ref"] if stat == "ppl_ratio" else None
            rows.append(GateResult(KL_GATE, stat, stats[stat], baseline, f"{op} {rule[key]}",
                                   bool(ok(stats[stat], rule[key]))))
    return rows


def table(rows: list[GateResult]) -> str:
    """The pass/fail table (markdown, readable in a terminal)."""
    lines = ["| gate | metric | value | baseline | threshold | result |", "|---|---|---|---|---|---|"]
    for r in rows:
        value = "-" if r.value is None else f"{r.value:.4f}"
        base = "-" if r.baseline is None else f"{r.baseline:.4f}"
        lines.append(f"| {r.gate} | {r.metric} | {value} | {base} | {r.threshold} | {'PASS' if r.passed else 'FAIL'} |")
    return "\n".join(lines)


def exit_code(rows: list[GateResult]) -> int:
    return EXIT_PASS if rows and all(r.passed for r in rows) else EXIT_FAIL
