"""`specquant latency`: the competition's latency protocol against any OpenAI-compatible server (ours, llama-server,
vLLM): per category, `warmup` untimed then `runs` sequential raw /v1/completions requests at temperature 0 without
ignore_eos; client-side wall times; medians, p90, speedup against a baseline server, and the mean acceptance length
from the server's /metrics when it exposes vLLM-named counters. A table, then one JSON line.

Prompts are built to a token count by asking the server: one calibration request reads usage.prompt_tokens for a
known text, so no tokenizer is needed on the client. When the model's context is shorter than a category needs,
every selected category's prompt length is scaled by one factor, which is printed.

Servers differ in what they report, and this reads each one's way:
- the model: --model, else the one /v1/models lists first (llama-server's id is its GGUF path; it answers any
  name);
- the context: max_model_len in /v1/models (vLLM, ours), else llama-server's per-slot n_ctx from /props, else its
  /v1/models meta (n_ctx, then n_ctx_train);
- MAL: /metrics counters named spec_decode_num_drafts / _num_accepted_tokens under any prefix (vllm:, specquant:,
  llamacpp: with `llama-server --metrics`); "-" when a server has none;
- prompt caching: usage.prompt_tokens_details.cached_tokens (llama-server caches prompts by default, ours with
  --prefix-cache), reported per category so a repeated prompt's reuse is visible beside the times."""

from __future__ import annotations

import json
import math
import re
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.serve.config import CATEGORIES, FILLER, LatencyConfig
from specquant.util.flags import add_config_flags, config_from_args, print_json

# tokens kept free below the context: a prompt rebuilt from text can tokenize a little longer than calibrated
CONTEXT_MARGIN = 16
SPEC_COUNTER = re.compile(r"^(\S+:)?spec_decode_num_(drafts|accepted_tokens)(_total)?(\{[^}]*\})?\s+(\S+)$", re.M)


def add_parser(sub):
    from specquant.engines import NAMES

    p = sub.add_parser("latency", help="time an OpenAI-compatible server with the competition's latency protocol")
    p.add_argument("--server", default=None, help="base URL of a running server, e.g. http://127.0.0.1:8000 (or "
                                                   "--engine: one started here)")
    p.add_argument("--model", default=None, help="model id the server serves (default: the first it lists)")
    p.add_argument("--baseline-server", default=None,
                   help="base URL of the baseline server (speedup = its median / ours)")
    p.add_argument("--baseline-model", default=None, help="the baseline's model id (default: --model)")
    p.add_argument("--engine", choices=NAMES, default=None,
                   help="start this engine's server on loopback for --target/--draft (engines/), time it, stop it")
    p.add_argument("--baseline-engine", choices=NAMES, default=None,
                   help="then the same pair in this engine's server, as the baseline (one at a time: an idle "
                        "server's threads stay out of the other's timing)")
    p.add_argument("--target", default=None, help="with --engine: checkpoint directory or bundled name")
    p.add_argument("--draft", default=None, help="with --engine: draft checkpoint, bundled name, mtp, or none")
    p.add_argument("--draft-len", type=int, default=3, help="with --engine: draft tokens per step (k)")
    p.add_argument("--threads", type=int, default=0, help="with --engine: threads each server uses (0: its default)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    add_config_flags(p, LatencyConfig)


class Client:
    """A raw HTTP client (stdlib: nothing beyond the server's own protocol, and no client-side pooling tricks)."""

    def __init__(self, url: str, model: str | None, timeout_s: float):
        self.url, self.timeout = url.rstrip("/"), timeout_s
        self.listed = self._models()
        if model is None and not self.listed:
            raise SpecquantError(f"{self.url}/v1/models lists no model; pass --model NAME")
        self.model = model or self.listed[0]["id"]

    def _models(self) -> list[dict]:
        try:
            return json.loads(self._call("/v1/models")).get("data") or []
        except (SpecquantError, json.JSONDecodeError, AttributeError):
            return []

    def _call(self, path: str, body: dict | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise SpecquantError(f"{self.url}{path} answered {e.code}: {e.read()[:300]!r}") from None
        except urllib.error.URLError as e:
            raise SpecquantError(f"cannot reach {self.url}{path} ({e.reason}); is the server running?") from None

    def complete(self, prompt: str, max_tokens: int, temperature: float) -> dict:
        return json.loads(self._call("/v1/completions", {"model": self.model, "prompt": prompt, "stream": False,
                                                        "max_tokens": max_tokens, "temperature": temperature}))

    def context(self) -> int | None:
        """The context a request may fill (None: the server does not say)."""
        mine = [m for m in self.listed if m.get("id") == self.model]
        if not mine and len(self.listed) == 1:  # llama-server answers any model name with its one model
            mine = self.listed
        if mine and mine[0].get("max_model_len"):
            return int(mine[0]["max_model_len"])
        try:  # llama-server: a slot's context (its -c split over parallel slots unless the KV cache is unified)
            slot = json.loads(self._call("/props")).get("default_generation_settings", {}).get("n_ctx")
        except (SpecquantError, json.JSONDecodeError, AttributeError):
            slot = None
        if slot:
            return int(slot)
        meta = (mine[0].get("meta") or {}) if mine else {}
        found = meta.get("n_ctx") or meta.get("n_ctx_train")
        return int(found) if found else None

    def spec_counters(self) -> tuple[float, float] | None:
        """(num_drafts, num_accepted_tokens) from /metrics; None when the server exposes none."""
        try:
            text = self._call("/metrics").decode()
        except SpecquantError:
            return None
        return spec_totals(text)


def spec_totals(text: str) -> tuple[float, float] | None:
    """(num_drafts, num_accepted_tokens) in a Prometheus text: each counter summed over its label sets (vLLM labels
    every series with model_name and engine, one series per engine core; ours and llama-server's have no labels).
    The per-position series (`..._per_pos`) do not match the names."""
    found = {}
    for _, name, _, _, value in SPEC_COUNTER.findall(text):
        found[name] = found.get(name, 0.0) + float(value)
    return (found["drafts"], found["accepted_tokens"]) if len(found) == 2 else None


def source_text(prompt: str) -> str:
    if prompt == "filler":
        return FILLER
    path = Path(prompt).expanduser()
    if not path.is_file():
        raise SpecquantError(f"prompt {prompt!r} is neither 'filler' nor a text file; pass one of them")
    text = path.read_text()
    if not text.strip():
        raise SpecquantError(f"prompt file {prompt} is empty; give it some text")
    return text


def prompt_of(client: Client, text: str, tokens: int) -> tuple[str, int]:
    """text repeated or cut to about `tokens` prompt tokens (measured by the server) -> (prompt, its tokens)."""
    probe = text * max(1, 256 // max(len(text), 1))
    measured = client.complete(probe, 1, 0.0)["usage"]["prompt_tokens"]
    chars = len(probe)
    for _ in range(2):  # the second pass corrects for the text's tokens-per-character drifting with length
        chars = max(1, round(chars * tokens / measured))
        prompt = (text * (chars // len(text) + 1))[:chars]
        measured = client.complete(prompt, 1, 0.0)["usage"]["prompt_tokens"]
        if measured == tokens:
            break
    return prompt, measured


def scale_of(context: int | None, categories: list[str]) -> float:
    """One factor for every category's prompt length so the longest request fits the context (1: no scaling)."""
    if context is None:
        return 1.0
    worst = max(CATEGORIES[c][0] / max(context - CATEGORIES[c][1] - CONTEXT_MARGIN, 1) for c in categories)
    return min(1.0, 1.0 / worst)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def _mal(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Mean acceptance length between two /metrics reads (None without counters or drafts)."""
    if before and after and after[0] > before[0]:
        return 1.0 + (after[1] - before[1]) / (after[0] - before[0])
    return None


def measure(client: Client, prompts: dict, config: LatencyConfig, progress: bool = False, name: str = "") -> dict:
    """category -> {median_ms, p90_ms, mean_new_tokens, mean_acceptance_length (None without counters), and the
    category's first request apart: first_ms, first_mean_acceptance_length}. The first request is the first
    warm-up (else the first timed run, also counted there): a server that drafts from earlier answers (`serve
    --draft suffix`'s response cache) replays from the second on, so the two differ.
    progress: a bar over the requests (util/progress.py) and a line per category as it finishes."""
    from specquant.util.progress import Progress

    out = {}
    label = f"latency {name}".rstrip()
    with Progress(len(prompts) * (config.warmup + config.runs), label, "request", enabled=progress) as bar:
        for cat, (prompt, _) in prompts.items():
            new = CATEGORIES[cat][1]
            times, tokens, cached = [], [], []

            def timed():
                t0 = time.perf_counter()
                reply = client.complete(prompt, new, config.temperature)
                times.append((time.perf_counter() - t0) * 1e3)
                tokens.append(reply["usage"]["completion_tokens"])
                details = reply["usage"].get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    cached.append(details["cached_tokens"])

            before = client.spec_counters()
            timed()
            bar.update(1, status=f"{cat}: first request")
            first_ms, first_mal = times[0], _mal(before, client.spec_counters())
            if config.warmup:  # the first request was a warm-up: untimed
                del times[:], tokens[:], cached[:]
                for _ in range(config.warmup - 1):
                    client.complete(prompt, new, config.temperature)
                    bar.update(1, status=f"{cat}: warm-up")
            before = client.spec_counters() if config.warmup else before
            while len(times) < config.runs:
                timed()
                bar.update(1, status=f"{cat}: {times[-1]:.0f} ms")
            mal = _mal(before, client.spec_counters())
            out[cat] = {"median_ms": statistics.median(times), "p90_ms": percentile(times, 90),
                        "mean_new_tokens": statistics.fmean(tokens), "mean_acceptance_length": mal,
                        "mean_cached_prompt_tokens": statistics.fmean(cached) if len(cached) == len(times) else None,
                        "first_ms": first_ms, "first_mean_acceptance_length": first_mal}
            bar.note(f"{label} {cat}: median {out[cat]['median_ms']:.1f} ms, "
                     f"{1e3 * out[cat]['mean_new_tokens'] / out[cat]['median_ms']:.1f} tok/s")
    return out


def build_prompts(client: Client, config: LatencyConfig, contexts: list[int], say=print) -> dict:
    """category -> (prompt text, its tokens), scaled to the smallest context given."""
    scale = scale_of(min(contexts) if contexts else None, config.categories)
    text = source_text(config.prompt)
    prompts = {cat: prompt_of(client, text, max(1, round(CATEGORIES[cat][0] * scale))) for cat in config.categories}
    if scale < 1:
        say(f"context {min(contexts)} tokens: prompt lengths scaled by {scale:.4f} ("
            + ", ".join(f"{c} {CATEGORIES[c][0]} -> {prompts[c][1]}" for c in config.categories) + ")")
    return prompts


def report(config: LatencyConfig, prompts: dict, ours: dict, base: dict | None, say=print) -> dict:
    """The per-category rows (with the baseline's times and the speedup where there is one), printed through say."""
    rows = {}
    for cat in config.categories:
        row = {"prompt_tokens": prompts[cat][1], "max_tokens": CATEGORIES[cat][1], **ours[cat]}
        if base:
            row.update(baseline_median_ms=base[cat]["median_ms"], baseline_p90_ms=base[cat]["p90_ms"],
                       baseline_mean_new_tokens=base[cat]["mean_new_tokens"],
                       baseline_mean_acceptance_length=base[cat]["mean_acceptance_length"],
                       speedup=base[cat]["median_ms"] / ours[cat]["median_ms"])
        rows[cat] = row
    say(f"{'category':<9} {'prompt':>6} {'new':>5} {'median ms':>10} {'p90 ms':>9} {'MAL':>5} {'first ms':>9} "
        f"{'MAL':>5}" + (f" {'base ms':>9} {'base MAL':>8} {'speedup':>8}" if base else ""))

    def fmt(mal: float | None) -> str:
        return f"{mal:.2f}" if mal is not None else "-"

    for cat, r in rows.items():
        line = (f"{cat:<9} {r['prompt_tokens']:>6} {r['mean_new_tokens']:>5.0f} {r['median_ms']:>10.1f} "
                f"{r['p90_ms']:>9.1f} {fmt(r['mean_acceptance_length']):>5} {r['first_ms']:>9.1f} "
                f"{fmt(r['first_mean_acceptance_length']):>5}")
        if base:
            line += (f" {r['baseline_median_ms']:>9.1f} {fmt(r['baseline_mean_acceptance_length']):>8} "
                     f"{r['speedup']:>7.2f}x")
        say(line)
    for cat, r in rows.items():
        if r["mean_cached_prompt_tokens"]:
            say(f"note: {cat}: the server reused {r['mean_cached_prompt_tokens']:.0f} of {r['prompt_tokens']} "
                "prompt tokens per request from its prompt cache (the protocol repeats each prompt)")
    return rows


def time_server(config: LatencyConfig, server: str, model: str | None = None, baseline_server: str | None = None,
                baseline_model: str | None = None, say=print, progress: bool = False) -> dict:
    """The protocol against server (and baseline_server): the table through say, the JSON line's object back;
    progress: a bar per server on stderr, one line per category (util/progress.py)."""
    client = Client(server, model, config.timeout_s)
    baseline = Client(baseline_server, baseline_model or model, config.timeout_s) if baseline_server else None
    contexts = [c for c in (client.context(), baseline.context() if baseline else None) if c]
    prompts = build_prompts(client, config, contexts, say)
    ours = measure(client, prompts, config, progress, "server" if baseline else "")
    base = measure(baseline, prompts, config, progress, "baseline") if baseline else None
    rows = report(config, prompts, ours, base, say)
    return {"server": server, "model": client.model, "baseline_server": baseline_server,
            "baseline_model": baseline.model if baseline else None, **_summary(config, contexts, rows)}


def _summary(config: LatencyConfig, contexts: list[int], rows: dict) -> dict:
    """The JSON line's keys every way of timing shares: the context the prompts were scaled to, the scale, the
    config and the per-category rows."""
    context = min(contexts) if contexts else None
    return {"context": context, "prompt_scale": scale_of(context, config.categories), "config": asdict(config),
            "categories": rows}


def time_engines(config: LatencyConfig, target, draft, draft_len: int, engine_name: str,
                 baseline_engine: str | None = None, threads: int = 0, say=print, progress: bool = False,
                 workdir: Path | None = None) -> dict:
    """The protocol against engine_name's server of target (+ draft), started on loopback from the engine table
    (engines/), then against baseline_engine's server of the same pair; one server runs at a time. Exports and
    server logs go to workdir (default: a temporary directory)."""
    import tempfile

    from specquant.engines import RowPair, engine
    from specquant.engines.process import HOST, free_port, running

    names = [engine_name] + ([baseline_engine] if baseline_engine else [])
    mods = [engine(n) for n in names]
    for m in mods:
        m.check()  # a missing engine fails before anything starts
    draft = None if draft in (None, "none") else draft
    pair = RowPair("pair", str(target) + (f" + {draft}" if draft else ""), target, draft, draft_len)
    # the context the selected categories need (an engine that must be told sizes its cache for it, no more)
    need = max(CATEGORIES[c][0] + CATEGORIES[c][1] for c in config.categories) + 2 * CONTEXT_MARGIN + draft_len
    results, prompts, contexts, started = [], None, [], []
    with tempfile.TemporaryDirectory(prefix="specquant-latency-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        for name, mod in zip(names, mods):
            port = free_port()
            server = mod.server(pair, root / name.replace(".", "_"), port, HOST, threads, need)
            say(f"{name}: starting {server.label} on {HOST}:{port}")
            t0 = time.perf_counter()
            with running(server, port, root / f"{name.replace('.', '_')}-server.log") as url:
                started.append(round(time.perf_counter() - t0, 1))
                client = Client(url, None, config.timeout_s)
                if prompts is None:  # built once, on the first server: both serve the same pair
                    contexts = [c] if (c := client.context()) else []
                    prompts = build_prompts(client, config, contexts, say)
                results.append(measure(client, prompts, config, progress, name))
    rows = report(config, prompts, results[0], results[1] if baseline_engine else None, say)
    return {"engine": engine_name, "baseline_engine": baseline_engine, "target": str(target),
            "draft": None if draft is None else str(draft), "draft_len": draft_len, "threads": threads,
            "start_s": started, **_summary(config, contexts, rows)}


def run(args):
    config = config_from_args(LatencyConfig, args).validate()
    say = (lambda *a: None) if args.json else print
    if args.engine:
        if args.server or args.baseline_server:
            raise SpecquantError("--engine starts its own server: drop --server / --baseline-server, or drop --engine")
        if not args.target:
            raise SpecquantError("--engine needs --target (a checkpoint directory or bundled name)")
        if args.draft_len < 1:
            raise SpecquantError(f"--draft-len {args.draft_len}: use 1 or more draft tokens per step")
        print_json(time_engines(config, args.target, args.draft, args.draft_len, args.engine, args.baseline_engine,
                                args.threads, say, progress=True))
        return 0
    if not args.server:
        raise SpecquantError("give --server URL (a running server) or --engine NAME --target DIR (one started here)")
    if args.baseline_engine:
        raise SpecquantError("--baseline-engine goes with --engine; with --server, give --baseline-server")
    print_json(time_server(config, args.server, args.model, args.baseline_server, args.baseline_model, say,
                           progress=True))  # on stderr: the JSON line stays alone on stdout
    return 0


def serve_and_time(target, draft, config: LatencyConfig, log=print, threads: int = 0) -> dict:
    """target (and draft) served by `specquant serve`'s app on a loopback port of this process and timed with the
    protocol: the demo's optional step (`specquant demo --serve`)."""
    from specquant.model.checkpoint import load_tokenizer
    from specquant.serve.app import create_app
    from specquant.serve.config import ServeConfig
    from specquant.serve.loopback import serving
    from specquant.spec_decode.build import build_engine
    from specquant.spec_decode.runtime import RuntimeConfig

    tokenizer = load_tokenizer(target)
    engine = build_engine(target, draft, RuntimeConfig(threads=threads, aot="off").validate(),
                          target_tokenizer=tokenizer)
    app = create_app(engine, tokenizer, ServeConfig(), "specquant", threads=threads)
    with serving(app) as url:
        log(f"      serving on {url} (OpenAI API; /metrics); specquant latency --server {url}")
        return time_server(config.validate(), url, say=lambda line: log("      " + line))
