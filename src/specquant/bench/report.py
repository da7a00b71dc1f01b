"""Outputs of a bench run: results.json, report.md (tables), three PNG plots, each written atomically
(util.files.atomic_write), and the one-line JSON summary. Everything here reads the run's objects (bench/results.py):
the derived numbers (mean acceptance length, averages, predictions) come from the objects that define them, and
results.json is BenchResults.to_json()."""

from __future__ import annotations

import json
import math
from pathlib import Path

from specquant.bench.results import BenchResults, RowResult
from specquant.bench.spread import RESAMPLES, SEED, ranking
from specquant.bench.stages import StageTimes
from specquant.spec_decode.metrics import SpecMetrics
from specquant.spec_decode.drafters import hybrid, kind_named, suffix
from specquant.util.files import atomic_write

FILES = ("results.json", "report.md", "speedup.png", "acceptance_by_position.png", "drafter_latency.png")


def _ms(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.1f}"


def _x(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}x"


def _f(x, digits=2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def content_sets(results: BenchResults, kind: str = "content") -> list[str]:
    """The prompt sets of a kind ("content", or "filler": repeating text) in prompt order."""
    seen = []
    for p in results.prompts:
        if p.kind == kind and p.category not in seen:
            seen.append(p.category)
    return seen


def _xi(x, interval) -> str:
    """A speedup with its 95% interval: "1.55x (1.48-1.62)"."""
    if interval is None or _x(x) == "-":
        return _x(x)
    return f"{_x(x)} ({interval.low:.2f}-{interval.high:.2f})"


def ranking_line(results: BenchResults) -> str:
    """The rows by average speedup, ">" only where the intervals do not overlap (bench/spread.py)."""
    rows = [(f"({r.id})", r.speedup_avg, r.speedup_avg_interval) for r in results.ok_rows()
            if r.speedup_avg_interval is not None]
    order = ranking(rows)
    if not order:
        return ""
    return ("Rows by average speedup, \">\" where the next row's 95% interval lies wholly below every faster row's, "
            f"\"~\" where they overlap (not ranked: this run cannot tell them apart): {order}")


def summary_table(results: BenchResults) -> str:
    """The main table (markdown): per row, averages over length categories, speedup per category with its 95%
    interval, acceptance; then the ranking line (rows whose intervals overlap are not ranked)."""
    cats, sets, fillers = list(results.lengths), content_sets(results), content_sets(results, "filler")
    head = (["row", "TTFT ms", "TPOT ms", "latency ms", "tok/s"] + [f"speedup {c}" for c in cats]
            + ["speedup avg", "predicted avg"] + [f"MAL {s}" for s in sets] + [f"MAL {s}" for s in fillers])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results.rows:
        label = f"({r.id}) {r.name}"
        if not r.ok:
            lines.append(f"| {label} | skipped: {r.reason} |" + " |" * (len(head) - 2))
            continue
        avg = r.timing_avg
        cells = [label, _ms(avg.ttft_s), _ms(avg.tpot_s), _ms(avg.latency_s), _f(avg.tokens_per_s, 1)]
        cells += [_xi(r.categories[c].speedup, r.categories[c].speedup_interval) if c in r.categories else "-"
                  for c in cats]
        cells += [_xi(r.speedup_avg, r.speedup_avg_interval), _x(r.predicted_speedup_avg)]
        acc = r.acceptance or {}
        cells += [_f(acc[s].mean_acceptance_length) if s in acc else "-" for s in sets]
        filler = r.filler or {}
        cells += [_f(filler[s].mean_acceptance_length) if s in filler else "-" for s in fillers]
        lines.append("| " + " | ".join(cells) + " |")
    order = ranking_line(results)
    return "\n".join(lines) + (f"\n\n{order}" if order else "")


def detail_table(results: BenchResults) -> str:
    head = ["row", "category", "prompt tokens", "latency ms", "TTFT ms", "TPOT ms", "speedup", "decode speedup",
            "predicted", "Leviathan", "MAL", "alpha", "k", "c", "verify ratio", "accept ratio", "same tokens as"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results.ok_rows():
        for cat, e in r.categories.items():
            p, acc, same = e.prediction, e.acceptance, e.same_tokens_as
            lines.append("| " + " | ".join([
                f"({r.id})", cat, str(results.lengths[cat]), _ms(e.timing.latency_s), _ms(e.timing.ttft_s),
                _ms(e.timing.tpot_s), _x(e.speedup), _x(e.decode_speedup), _x(e.predicted_speedup),
                _x(p and p.leviathan_speedup), _f(acc.mean_acceptance_length) if acc is not None else "-",
                _f(p and p.alpha), _f(p and p.k, 1),
                _f(p and p.c, 3), _f(p and p.verify_ratio), _f(p and p.accept_ratio),
                f"({same.row}): {'yes' if same.match else 'no'}" if same else "-"]) + " |")
    return "\n".join(lines)


def _acceptance_lines(rows: list[RowResult], whole_block: bool, accs=None,
                      mal: str = "MAL (all sets)") -> tuple[int, list[str]]:
    """Markdown rows of per-position acceptance and MAL for `rows`' merged content-set acceptance, or (whole_block)
    their whole-block acceptance, or accs [(row, SpecMetrics)]; returns (the longest k, the lines)."""
    if accs is None:
        accs = [(r, r.acceptance_whole_block if whole_block else r.acceptance_all) for r in rows]
    k = max(len(acc.acceptance_rate_per_pos) for _, acc in accs)
    head = ["row"] + [f"pos {i + 1}" for i in range(k)] + ["MAL" if whole_block else mal]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, acc in accs:
        rates = acc.acceptance_rate_per_pos
        lines.append("| " + " | ".join([f"({r.id}) {r.name}"] + [_f(x) for x in rates]
                                        + ["-"] * (k - len(rates)) + [_f(acc.mean_acceptance_length)]) + " |")
    return k, lines


def position_table(results: BenchResults) -> str:
    spec = [r for r in results.ok_rows() if r.acceptance is not None]
    if not spec:
        return "(no speculative row ran on the content sets)"
    return "\n".join(_acceptance_lines(spec, whole_block=False)[1])


def whole_block_table(results: BenchResults) -> str:
    """Block rows with the whole block verified (k = block_size - 1): acceptance at every block position."""
    rows = [r for r in results.ok_rows() if r.acceptance_whole_block is not None]
    if not rows:
        return ""
    k, lines = _acceptance_lines(rows, whole_block=True)
    return ("\n\n## Block drafter, whole block verified\n\nThe block rows again on the content sets with k = "
            f"block_size - 1 = {k} (untimed, greedy): acceptance at every block position. The timed rows use "
            f"k = {results.config.block_draft_len}.\n\n" + "\n".join(lines))


def filler_table(results: BenchResults) -> str:
    """The speculative rows on the filler sets (repeating text), apart from the content sets."""
    rows = [r for r in results.ok_rows() if r.filler]
    if not rows:
        return ""
    sets = ", ".join(content_sets(results, "filler"))
    accs = [(r, SpecMetrics.total(r.filler.values())) for r in rows]
    _, lines = _acceptance_lines(rows, False, accs, "MAL (filler)")
    return (f"\n\n## Filler prompt ({sets}), apart from real text\n\nThe competition's latency prompt repeats one "
            "sentence, so a drafter that copies earlier text accepts nearly all of it; these numbers say nothing of "
            "the content sets above (untimed, greedy; rate at position i as below).\n\n" + "\n".join(lines))


def source_table(results: BenchResults) -> str:
    """A hybrid row's steps by the drafter that drafted them: how often each was chosen, what each accepted."""
    rows = [r for r in results.ok_rows() if r.by_source]
    if not rows:
        return ""
    head = ["row", "prompts", "drafter", "steps", "share of steps", "draft tokens / step", "acceptance rate", "MAL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for run, sources in r.by_source.items():
            steps = sum(m.num_drafts for m in sources.values())
            for src, m in sources.items():
                drafted = m.num_draft_tokens > 0  # "none": undrafted steps, no draft to accept
                lines.append("| " + " | ".join([
                    f"({r.id})", run, src, str(m.num_drafts), _f(m.num_drafts / steps if steps else None),
                    _f(m.mean_draft_len), _f(m.acceptance_rate if drafted else None),
                    _f(m.mean_acceptance_length)]) + " |")
    h = results.config.drafters[hybrid.KIND.name]
    return ("\n\n## Hybrid drafter: which drafter drafted\n\nPer step the suffix draft when its match has at least "
            f"{h.min_match} tokens (--hybrid-min-match), else the block drafter's while its steps accept at least "
            f"{h.model_min_accept:g} tokens on average (--hybrid-model-min-accept), else no draft (\"none\": a "
            "plain one-token step); untimed acceptance passes.\n\n" + "\n".join(lines))


def lossy_lines(results: BenchResults) -> str:
    """The lossy rows (the vocabulary-pruned target) with their kl gate against the unpruned target."""
    lines = []
    for r in results.rows:
        if r.ok and r.lossy is not None:
            q = r.lossy
            lines.append(f"- ({r.id}) {r.name}: LOSSY against `{q['baseline']}`: KL {q['kl']:.4f} nats/token over "
                         f"the kept ids (renormalised), lost mass {q['lost_mass']:.4f} (the baseline's probability "
                         f"on the cut ids), top-1 {q['top1_agree']:.3f}, ppl ratio {q['ppl_ratio']:.3f}; kl gate "
                         f"{'PASS' if q['passed'] else 'FAIL'} ({q['tokens']} held-out tokens)")
    if not lines:
        return ""
    return ("\n\n## Lossy rows\n\nNot compared token for token with any row: each prompt is the same text spelled "
            "by the row's own tokenizer, cut to the same number of tokens (its last ones).\n\n" + "\n".join(lines))


def step_costs(row: RowResult, cat: str) -> dict | None:
    """A speculative row's cost per verify step in units of its target's one-token step, from its prediction:
    draft (forwards x c per forward) + verify + the block drafter's accept, and per emitted token (step / MAL)."""
    e = row.categories.get(cat)
    p = e.prediction if e is not None else None
    if p is None:
        return None
    draft = p.draft_forwards_per_step * p.c_forward
    step = draft + p.verify_ratio + p.accept_ratio
    return {"k": p.k, "forwards": p.draft_forwards_per_step, "c_forward": p.c_forward, "draft": draft,
            "verify": p.verify_ratio, "accept": p.accept_ratio, "step": step, "mal": p.expected_tokens,
            "per_token": step / p.expected_tokens}


def drafter_verdict(results: BenchResults) -> str:
    """Which drafter kind wins in this run (best tok/s row of each) and why, from the per-step costs: the winner
    against the runner-up, then the winner's lead over every other kind."""
    # the rows whose step costs were probed (LM, block, MTP): the levers' rows (s, u, p) have no prediction
    spec = [r for r in results.ok_rows() if r.drafter and r.impl == "specquant" and r.predicted_speedup_avg is not None]
    best = {}
    for kind in dict.fromkeys(r.drafter for r in spec):  # in row order: the LM rows come first
        rows = [r for r in spec if r.drafter == kind]
        if rows:
            best[kind] = max(rows, key=lambda r: r.timing_avg.tokens_per_s)
    if len(best) < 2:  # the verdict compares kinds
        return ""
    cats = list(results.lengths)
    cat = "medium" if "medium" in cats else cats[len(cats) // 2]
    base = results.row("a")
    lines = []
    for kind, r in best.items():
        c = step_costs(r, cat)
        what = kind_named(kind).title
        line = (f"- {what}: best row ({r.id}) {r.name}, {r.timing_avg.tokens_per_s:.1f} tok/s "
                f"({r.timing_avg.tokens_per_s / base.timing_avg.tokens_per_s:.2f}x row (a))")
        if c:
            line += (f"; per step at the {cat} context, in target one-token steps: {c['forwards']:.0f} draft "
                     f"forward{'s' if c['forwards'] != 1 else ''} x {c['c_forward']:.2f} = {c['draft']:.2f} + verify "
                     f"of {c['k']:.0f}+1 tokens {c['verify']:.2f}"
                     + (f" + accept {c['accept']:.2f}" if c["accept"] else "")
                     + f" = {c['step']:.2f}, for MAL {c['mal']:.2f} tokens: "
                     f"{c['per_token']:.2f} per token")
        lines.append(line)
    ranked = sorted(best.items(), key=lambda kv: -kv[1].timing_avg.tokens_per_s)  # ties: row order
    (win_kind, winner), (_, loser) = ranked[0], ranked[1]
    cw, cl = step_costs(winner, cat), step_costs(loser, cat)
    why = ""
    if cw and cl:
        cheaper = "a cheaper step" if cw["step"] < cl["step"] else "a dearer step"
        more = "more" if cw["mal"] > cl["mal"] else "fewer"
        why = (f" At the {cat} context it pays {cheaper} ({cw['step']:.2f} vs {cl['step']:.2f} target steps) and "
               f"emits {more} tokens per step (MAL {cw['mal']:.2f} vs {cl['mal']:.2f}): {cw['per_token']:.2f} vs "
               f"{cl['per_token']:.2f} target steps per token.")
        if cw["per_token"] > cl["per_token"]:
            gap = winner.timing_avg.tokens_per_s / loser.timing_avg.tokens_per_s - 1
            why += (f" By those costs the other drafter is cheaper per token there, so this {gap:.1%} lead comes "
                    "from the other length categories or from run-to-run noise.")
    for other_kind, other in ranked[2:]:
        co = step_costs(other, cat)
        why += (f" The {kind_named(other_kind).title}'s best row ({other.id}) runs "
                f"{other.timing_avg.tokens_per_s:.1f} tok/s"
                + (f" at {co['per_token']:.2f} target steps per token (step {co['step']:.2f}, MAL {co['mal']:.2f})"
                   if co else "") + ".")
    kind = kind_named(win_kind).title
    iw, il = winner.speedup_avg_interval, loser.speedup_avg_interval
    if iw is not None and il is not None and iw.overlaps(il):  # not ranked: the run cannot tell them apart
        other = kind_named(ranked[1][0]).title
        head = (f"The {kind} and the {other} are not told apart in this run: ({winner.id}) "
                f"{winner.timing_avg.tokens_per_s:.1f} vs ({loser.id}) {loser.timing_avg.tokens_per_s:.1f} tok/s, "
                f"and their average speedups' 95% intervals overlap ({iw.low:.2f}-{iw.high:.2f} and "
                f"{il.low:.2f}-{il.high:.2f}).")
    else:
        head = (f"The {kind} wins in this run: ({winner.id}) {winner.timing_avg.tokens_per_s:.1f} vs "
                f"({loser.id}) {loser.timing_avg.tokens_per_s:.1f} tok/s.")
    return "\n\n## Which drafter wins\n\n" + "\n".join(lines) + f"\n\n{head}{why}"


def time_table(results: BenchResults) -> str:
    """Where the run's wall time went: per stage (run_bench's StageTimes), then per row (its decoding in the
    latency runs and acceptance passes); "" when the results carry no stage times."""
    if results.stages is None:
        return ""
    rows = [r for r in results.rows if r.seconds is not None]
    decoding = sum(r.seconds for r in rows) or 1.0
    per_row = "\n".join(f"| ({r.id}) {r.name} | {r.seconds:.1f} | {r.seconds / decoding:.0%} |" for r in rows)
    return (f"\n\n## Wall time\n\n{results.stages.total_s:.0f} s ({results.stages.total_cpu_s:.0f} CPU s) in "
            f"these stages (the report and plots after them), on a machine with a 1-minute load average of "
            f"{results.environment.get('load_avg_1m')} at the start; CPU seconds are this process's, every thread's, "
            f"which other jobs' load stretches less than wall time:\n\n{results.stages.table()}\n\nPer row, its decoding (warm-up and timed runs, acceptance "
            f"passes):\n\n| row | seconds | share |\n|---|---|---|\n{per_row}")


def _hf_runs(cfg) -> str:
    """Row (hf)'s own timed-run count, when it differs from every other row's (BenchConfig.hf_runs)."""
    return "" if cfg.hf_runs is None or cfg.hf_runs == cfg.runs or not cfg.hf_compare else \
        f" (row hf: {cfg.hf_runs})"


def _w4_activations(results: BenchResults) -> str:
    """What the W4 rows' 4-bit layers ran on, when it is not float throughout (W4A8: docs/SHAPES.md)."""
    act = results.w4_activations
    parts = [f"W4 {role}s on int8" for role in ("target", "draft") if act.get(role) == "int8"]
    return f" ({', '.join(parts)} activations: W4A8)" if parts else ""


def markdown(results: BenchResults) -> str:
    cfg, env = results.config, results.environment
    suffix_k = cfg.drafters[suffix.KIND.name].max_draft_len
    lengths = ", ".join(f"{c} {n}" for c, n in results.lengths.items())
    quant = results.quantized or {}
    qlines = "\n".join(f"- {role}: `{q['path']}` ({q['method']}, "
                       f"{'produced in this run' if q['produced'] else 'reused from the cache'})"
                       if isinstance(q, dict) else f"- {role}: `{q}` (given)" for role, q in quant.items())
    return f"""# specquant bench

Target `{results.models['target']}`, draft `{results.models['draft']}`; {cfg.runtime.dtype} activations{_w4_activations(results)};
{'greedy' if cfg.sampling.temperature == 0 else f"temperature {cfg.sampling.temperature}"}; {cfg.max_new_tokens} new tokens
per prompt with EOS ignored; {cfg.warmup} warm-up{'' if cfg.warmup_all_prompts else ' (on the first length prompt only)'} + {cfg.runs} timed runs per prompt and row{_hf_runs(cfg)}, interleaved;
k = {cfg.spec.draft_len} draft tokens per step (block drafter rows: k = {cfg.block_draft_len}, one drafter
forward per step); draft window {cfg.spec.draft_window} (rows e, h). Rows s, u, p: the suffix drafter (its own
k = {suffix_k}), the hybrid (suffix, else the W4 block drafter) and the W4 block drafter with a
head pruned to {cfg.pruned_head_fraction:.0%} of the vocabulary; no prediction for them. Rows m, n (when the
target has an MTP layer): its own MTP drafter, dense and W4, k = {cfg.spec.draft_len}, one MTP forward per token.
Prompt lengths (target tokens): {lengths}.

{qlines}

## Summary

Latency is end to end (prefill + decode) per request, the median over runs per prompt, then the mean over a
category's prompts; TTFT / TPOT / latency / tok/s columns are means over the length categories. speedup = baseline
(a) latency / row latency per length category; "avg" is the mean of the per-category speedups. In brackets, each
speedup's 95% interval: a paired percentile bootstrap over each prompt's timed runs ({RESAMPLES} resamples, seed
{SEED}; bench/spread.py); with {cfg.runs} timed run{'s' if cfg.runs != 1 else ''} per prompt it shows the
round-to-round spread only. "predicted" is the
decode-phase speedup from measured acceptance and forward costs (see predict.py): S = E / (k·c + verify_ratio +
accept_ratio), rescaled to the baseline's step time (timed alone, as row (a) decodes). MAL = mean acceptance
length = 1 + num_accepted_tokens / num_drafts, per content set.

{summary_table(results)}

## Per length category

"decode speedup" compares TPOT; "predicted" and "Leviathan" predict it (Leviathan: α from the MAL, verify
forward = one decode step). c = draft cost per drafted token / target step (a block drafter's one forward per
step counts as k·c); verify ratio = (k+1)-token target forward / 1-token
forward; accept ratio = the block drafter's accept (projecting the accepted target features) per step / 1-token
forward; all timed at prompt + max_new_tokens/2 context. "same tokens as": greedy output identical to the target's
own output (row a for the high-precision target, b for the W4 one).

{detail_table(results)}

## Acceptance by draft position (content sets merged)

Rate at position i = steps whose i-th draft token was accepted / steps (cumulative, so ≈ α^i).

{position_table(results)}{whole_block_table(results)}{filler_table(results)}{source_table(results)}{lossy_lines(results)}{drafter_verdict(results)}{time_table(results)}

## Environment

torch {env['torch']}, transformers {env['transformers']}, {env['threads']} threads, {env['cpu']}
({env['cpu_count']} logical CPUs), {env['device']}; 1-minute load average at the start {env.get('load_avg_1m')}.

Plots: `speedup.png`, `acceptance_by_position.png`, `drafter_latency.png`. All numbers: `results.json`.
"""


def _plots(results: BenchResults) -> dict[str, bytes]:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}

    def save(fig, name):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        out[name] = buf.getvalue()

    rows = results.ok_rows()
    cats = list(results.lengths)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / (len(cats) + 1)
    for j, cat in enumerate(cats + ["avg"]):
        values = [r.speedup_avg if cat == "avg" else r.categories[cat].speedup for r in rows]
        ax.bar([i + j * width for i in range(len(rows))], values, width, label=f"measured {cat}")
    predicted = [float("nan") if r.predicted_speedup_avg is None else r.predicted_speedup_avg for r in rows]
    ax.scatter([i + len(cats) * width for i in range(len(rows))], predicted, color="black", marker="_", s=400,
               zorder=3, label="predicted avg (decode)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + len(cats) * width / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"({r.id})" for r in rows])
    ax.set_ylabel("speedup vs (a)")
    ax.set_title("End-to-end speedup per row and length category")
    ax.legend(fontsize=8)
    save(fig, "speedup.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    rates_of = {r.id: r.acceptance_all.acceptance_rate_per_pos if r.acceptance is not None else [] for r in rows}
    for r in rows:
        rates = rates_of[r.id]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"({r.id}) {r.name}")
    longest = max((len(rates) for rates in rates_of.values()), default=0)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / steps (cumulative)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position (content sets)")
    if ax.lines:
        ax.legend(fontsize=8)
    save(fig, "acceptance_by_position.png")

    curve = results.draft_latency
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(curve["contexts"], [t * 1e3 for t in curve["full_s"]], marker="o", label="full attention")
    ax.plot(curve["contexts"], [t * 1e3 for t in curve["window_s"]], marker="s",
            label=f"sliding window {curve['window']}")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("W4 draft one-token forward (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Drafter per-step latency vs context")
    ax.legend(fontsize=8)
    save(fig, "drafter_latency.png")
    return out


def _finite(obj):
    """NaN / inf -> None, so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_report(results: BenchResults, out: Path) -> list[Path]:
    """Write every output file into `out` (created if needed); returns their paths."""
    files = {"results.json": (json.dumps(_finite(results.to_json()), indent=1) + "\n").encode(),
             "report.md": markdown(results).encode(), **_plots(results)}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in FILES:
        atomic_write(out / name, files[name])
        written.append(out / name)
    return written


def summary(results: BenchResults, files) -> dict:
    """The one JSON line `specquant bench --json` prints: per row, averages, speedups and acceptance."""
    rows = []
    for r in results.rows:
        row = {"id": r.id, "name": r.name, "status": r.status}
        if r.ok:
            row.update(latency_avg_s=r.timing_avg.latency_s, speedup_avg=r.speedup_avg,
                       speedups={c: e.speedup for c, e in r.categories.items()},
                       predicted_speedup_avg=r.predicted_speedup_avg,
                       mean_acceptance_length={s: a.mean_acceptance_length for s, a in (r.acceptance or {}).items()})
            if r.lossy is not None:
                row["lossy"] = {k: r.lossy[k] for k in ("kl", "lost_mass", "top1_agree", "ppl_ratio", "passed")}
            if r.filler:
                row["mean_acceptance_length_filler"] = {s: a.mean_acceptance_length for s, a in r.filler.items()}
        else:
            row["reason"] = r.reason
        rows.append(row)
    return {"benchmark": "bench", "out": str(Path(files[0]).parent), "files": [str(f) for f in files], "rows": rows}


VERDICT = "## Which drafter wins"


def demo_markdown(sections: list[tuple[str, str, str, str]], times: StageTimes | None = None) -> str:
    """`specquant demo`'s one report: per architecture (title, its models, its bench report.md text, the folder of
    its files relative to the demo's --out), the bench report with its headings one level down, and first each
    section's drafter verdict (drafter_verdict's conclusion), then the demo's wall time per part (times)."""
    verdicts, bodies = [], []
    for title, models, text, folder in sections:
        part = text.split(VERDICT, 1)[1] if VERDICT in text else ""
        part = part.split("\n## ", 1)[0]
        conclusion = next((p.strip() for p in part.split("\n\n") if p.strip().startswith("The ")), None)
        verdicts.append(f"- {title}: " + (conclusion.replace("\n", " ") if conclusion else
                                          "no verdict (fewer than two drafter kinds with probed costs ran)"))
        lines = text.splitlines()
        if lines and lines[0].startswith("# "):
            lines = lines[1:]  # the bench's title: the section's own heading replaces it
        body = "\n".join("#" + line if line.startswith("#") else line for line in lines)
        if folder:  # its plots and numbers sit in its own folder
            for name in FILES:
                body = body.replace(f"`{name}`", f"`{folder}/{name}`")
        bodies.append(f"## {title}: {models}\n{body}")
    timing = ("" if times is None else
              f"## Wall time\n\n{times.total_s:.0f} s before this report was written (each section's \"Wall time\" "
              f"splits its bench into stages and rows):\n\n{times.table()}\n\n")
    return ("# specquant demo\n\nOne bench per architecture, each on its own prompts and its own W4 / QAD "
            "checkpoints; the rows, metrics and predictions are the bench's (docs/BENCH.md).\n\n"
            "## Which drafter wins, per architecture\n\n" + "\n".join(verdicts) + "\n\n" + timing
            + "\n\n".join(bodies))


def write_demo_report(out: Path, sections: list[tuple[str, str, list[Path], str]],
                      times: StageTimes | None = None) -> Path | None:
    """out/report.md from the sections' bench reports (each `section`'s written files, report.md among them);
    None (nothing written) when a section wrote no report."""
    texts = []
    for title, models, files, folder in sections:
        report = next((Path(f) for f in files if Path(f).name == "report.md"), None)
        if report is None:
            return None
        texts.append((title, models, report.read_text(), folder))
    path = Path(out) / "report.md"
    atomic_write(path, demo_markdown(texts, times).encode())
    return path
