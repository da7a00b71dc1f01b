"""GPU fast-path numbers in one run: bandwidth, BF16 and W4 decode against the bandwidth floor, verify cost vs k,
draft/target cost ratios, and the A10G speedups they project. See docs/GPU.md.

No download: the Qwen3-4B (target) and Qwen3-0.6B (LM drafter) shapes are built from their configs with random
weights (speed does not depend on the values); W4 = our RTN, 4 bits, group 32, symmetric, lm_head kept in bf16
(the reference recipe's target format). Every model decodes through decode/graphs.py: the one-token and the
(k+1)-token steps replayed as CUDA graphs over the static cache (--compile: the target's one-token step is
torch.compile'd first; each further shape would be another compilation of a 36-layer model).

Measured, on this device:
  copy_gbps          2·bytes / time of one large device-to-device copy (read + write), median of 10
  bytes_per_step     bytes a one-token step reads: every weight once (a tied embedding once, as the lm_head; an
                     untied embedding is a row gather, not counted) + the whole static K/V buffer (the static-cache
                     attention reads all of it under a mask)
  floor_tokens_per_s copy_gbps / bytes_per_step: decoding at the measured bandwidth, nothing else
  decode_tokens_per_s greedy decode of --new-tokens tokens after a --context-token prompt; the next token and its
                     position stay on the device (no host sync until the end)
  step_ms[T]         one captured T-token step at the context (T = 1..16), median over interleaved rounds;
                     verify_ratio[T] = step_ms[T] / step_ms[1]
  draft/target ratio c = step_ms[1] of the 0.6B drafter / step_ms[1] of the 4B target (bf16/bf16, w4/w4, bf16/w4)
  engine             SpecEngine(graphs=True) on the W4 pair, greedy, k=3: ms per verify step against the sum of
                     its parts (3 draft steps + one 4-token target step): the engine's own overhead
  layers             per distinct Linear shape of the W4 target (fused q/k/v, o, fused gate/up, down) and rows
                     1/4/16: QuantLinear (auto backend: the Triton kernel on CUDA) vs the dense bf16 matmul, and the
                     GB/s the W4 layer streams its packed weight at; on CUDA also the kernel's tile choices
                     (block_n x num_warps x split-K) at one row, so the defaults can be set from a measurement
Goals (docs/GPU.md): BF16 decode >= 85% of floor_tokens_per_s, W4 decode >= 2.5x our BF16 decode (4B shape).

Projected for an A10G (the competition's GPU), from bytes, not measured there:
  t(model, context) = (weight bytes + K/V bytes read at that context) / 600 GB/s
  rows (a) bf16 target alone, (b) W4 target alone, (c) W4 target + bf16 draft, (d) W4 target + W4 draft,
  (e) = (d) with the draft attending to its last --window positions, in the seed's length categories
  (64->128, 2048->256, 8192->256; context = prompt + half the new tokens). With bench/predict.predict_row:
      c  = t(draft) / t(row target),   verify_ratio = measured verify_ratio[k+1] on this GPU (the A10G, with ~8x
                                                      less compute per byte, will not do better: a lower bound)
      S  = E / (k·c + verify_ratio) · t(bf16 target) / t(row target),   E = mean acceptance length
  for two acceptance sources: the bundled pair's (tiny-target / tiny-draft, greedy on the packaged content
  prompts, with SpecConfig's k and RTN-quantized copies for rows c-e), and the seed's mean acceptance length 5.03
  at its k = 15 (a histogram with that mean; predict_row backs α out of it for Leviathan's closed form).
  The block drafter (issue 12) is not on main: its cost ratio is reported as not measured.

Usage: python benchmarks/gpu.py [--device cuda] [--out DIR (default $OUT or runs/gpu)] [--overwrite] [--compile]
       [--tiny]
       python benchmarks/gpu.py --device cpu --tiny      # seconds; exercises every code path (CI)
The last stdout line is one JSON object (the summary); DIR/gpu.json holds every number, rewritten after each
section so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from specquant.bench.measure import environment
from specquant.bench.predict import StepCosts, predict_row
from specquant.decode.graphs import GraphStepper
from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.fuse import fuse_projections
from specquant.quant import QuantConfig, quantize
from specquant.spec_decode.metrics import SpecMetrics
from specquant.util.device import sync
from specquant.util.files import atomic_write, claim_out_dir

A10G_GBPS = 600.0
SEED_MAL, SEED_K = 5.03, 15  # the reference system's mean acceptance length at num_speculative_tokens = 15
SEED_CATEGORIES = {"short": (64, 128), "medium": (2048, 256), "long": (8192, 256)}  # prompt -> new tokens
GOAL_FLOOR_FRACTION, GOAL_W4_SPEEDUP = 0.85, 2.5
W4 = dict(method="rtn", bits=4, group_size=32, symmetric=True)  # the reference recipe's target format
DRAFT_W4 = dict(method="rtn", bits=4, group_size=128, symmetric=True)  # its drafter's group size

QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
             tie_word_embeddings=True, rms_norm_eps=1e-6, qk_norm=True)
SHAPES = {
    "target": ModelConfig(**QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8),  # Qwen3-4B
    "draft": ModelConfig(**QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8),  # Qwen3-0.6B
}
TINY = dict(model_type="qwen3", vocab_size=512, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True)
TINY_SHAPES = {
    "target": ModelConfig(**TINY, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2),
    "draft": ModelConfig(**TINY, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2),
}


# --- measurements ---------------------------------------------------------------------------------------------


def timed(fn, device, reps: int) -> float:
    """Seconds per call of fn, over reps calls between two device syncs."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def copy_bandwidth(device, nbytes: int) -> float:
    """GB/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = statistics.median(timed(lambda: dst.copy_(src), device, 5) for _ in range(10))
    return 2 * nbytes / t / 1e9


def build(role: str, shapes: dict, device, quant: dict | None, seed: int = 0) -> Transformer:
    """A random-init model of one shape, bf16, optionally quantized (RTN), projections fused as the engine runs."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(shapes[role]).to(torch.bfloat16).eval()
    if quant is not None:
        quantize(model, QuantConfig(**quant))
    fuse_projections(model)
    return model


def weight_bytes(model: Transformer) -> int:
    """Bytes of weights one forward reads: every persistent tensor once, minus an untied embedding (a gather)."""
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    total = sum(t.numel() * t.element_size() for t in unique.values())
    emb = model.model.embed_tokens.weight
    return total if model.config.tie_word_embeddings else total - emb.numel() * emb.element_size()


def kv_bytes_per_position(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


@torch.no_grad()
def measure_model(model: Transformer, device, context: int, new_tokens: int, max_t: int, rounds: int, reps: int,
                  compile: bool) -> dict:
    """Decode tokens/s and T-token step times (T = 1..max_t) through captured steps over one static cache."""
    stepper = GraphStepper(model, compile=compile)
    stepper.setup(1, context + new_tokens + max_t)
    capacity = model.cache_capacity()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    t0 = time.perf_counter()
    logits = stepper(prompt, 0, True)  # prefill: eager through the static cache (longer than any graph)

    def decode(n: int):
        tok, pos = logits[:, -1].argmax(-1, keepdim=True), torch.tensor([context], device=device)
        for _ in range(n):  # tokens and positions stay on the device
            tok = stepper.replay(tok, pos, True)[:, -1].argmax(-1, keepdim=True)
            pos = pos + 1

    decode(2)  # captures the one-token graph
    ts = list(range(1, max_t + 1))
    steps = {t: torch.randint(0, model.config.vocab_size, (1, t), generator=gen).to(device) for t in ts}
    pos = {t: torch.arange(context, context + t, device=device) for t in ts}
    for t in ts:  # capture every verify shape before timing
        stepper.replay(steps[t], pos[t], False)
    setup_s = time.perf_counter() - t0
    decode_s = statistics.median(timed(lambda: decode(new_tokens), device, 1) for _ in range(3))
    samples = {t: [] for t in ts}
    for _ in range(rounds):  # interleaved, so load drifts hit every T alike
        for t in ts:
            samples[t].append(timed(lambda t=t: stepper.replay(steps[t], pos[t], False), device, reps))
    step_ms = {t: statistics.median(v) * 1e3 for t, v in samples.items()}
    wb = weight_bytes(model)
    kv = kv_bytes_per_position(model.config) * capacity
    return {"weight_bytes": wb, "kv_bytes": kv, "bytes_per_step": wb + kv, "context": context,
            "decode_tokens_per_s": new_tokens / decode_s, "step_ms": step_ms,
            "verify_ratio": {t: step_ms[t] / step_ms[1] for t in ts}, "setup_s": setup_s,
            "graphs": device.type == "cuda", "compiled_shapes": sorted(stepper.compile_shapes)}


@torch.no_grad()
def measure_layers(model: Transformer, device, rows=(1, 4, 16), rounds: int = 5, reps: int = 20) -> list[dict]:
    """Each distinct QuantLinear shape of a W4 model: its forward vs a dense bf16 matmul of the same shape."""
    from specquant.quant.linear import QuantLinear, resolve_backend

    seen, out = set(), []
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear) or (m.out_features, m.in_features) in seen:
            continue
        seen.add((m.out_features, m.in_features))
        dense = torch.randn(m.out_features, m.in_features, dtype=torch.bfloat16, device=device)
        packed = sum(t.numel() * t.element_size() for t in (m.weight_packed, m.weight_scale))
        for r in rows:
            x = torch.randn(r, m.in_features, dtype=torch.bfloat16, device=device)
            m(x), torch.nn.functional.linear(x, dense)  # warm-up: backend choice, kernel compilation
            tw, td = [], []
            for _ in range(rounds):  # interleaved
                tw.append(timed(lambda: m(x), device, reps))
                td.append(timed(lambda: torch.nn.functional.linear(x, dense), device, reps))
            tw, td = statistics.median(tw), statistics.median(td)
            out.append({"layer": name.split(".", 3)[-1], "out": m.out_features, "in": m.in_features, "rows": r,
                        "w4_us": tw * 1e6, "bf16_us": td * 1e6, "w4_speedup": td / tw, "w4_gbps": packed / tw / 1e9,
                        "bf16_gbps": dense.numel() * 2 / td / 1e9, "backend": resolve_backend(m, x)})
    return out


def graph_us(fn, calls: int = 20, reps: int = 5) -> float:
    """Microseconds per call of fn, replayed as one CUDA graph of `calls` calls: the kernel's own time, free of the
    Python launch cost (~55 us per Triton launch on an H100) that a plain loop of calls measures instead."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts) * 1e6


@torch.no_grad()
def sweep_kernel(model: Transformer, device, rows=(1, 2, 4, 8, 16)) -> list[dict]:
    """CUDA only: the Triton kernel's tile choices (tl.dot or gemv, block_n, warps; split-K auto) at 1-16 rows on
    every distinct W4 layer shape, beside cuBLAS's dense bf16 matmul, all timed under graph replay (graph_us)."""
    from specquant.quant import triton_w4
    from specquant.quant.linear import QuantLinear

    seen, out = set(), []
    for m in model.modules():
        if not isinstance(m, QuantLinear) or (m.out_features, m.in_features) in seen:
            continue
        seen.add((m.out_features, m.in_features))
        dense = torch.randn(m.out_features, m.in_features, dtype=torch.bfloat16, device=device)
        for r in rows:
            x = torch.randn(r, m.in_features, dtype=torch.bfloat16, device=device)
            bf16_us = graph_us(lambda: x @ dense.T)
            default_us = graph_us(lambda: triton_w4.w4a16_matmul(x, m.weight_packed, m.weight_scale,
                                                                 m.weight_zero_point, m.bits, m.group_size))
            for gemv in (False, True):
                for block_n in (32, 64, 128):
                    for warps in (4, 8):
                        def f():
                            return triton_w4.w4a16_matmul(x, m.weight_packed, m.weight_scale, m.weight_zero_point,
                                                          m.bits, m.group_size, block_n=block_n, num_warps=warps,
                                                          gemv=gemv)
                        out.append({"out": m.out_features, "in": m.in_features, "rows": r, "block_n": block_n,
                                    "num_warps": warps, "gemv": gemv, "us": graph_us(f), "bf16_us": bf16_us,
                                    "default_us": default_us})
        del dense
    return out


@torch.no_grad()
def measure_engine(target: Transformer, draft: Transformer, device, context: int, new_tokens: int, target_r: dict,
                   draft_r: dict, k: int = 3) -> dict:
    """The speculative engine itself (SpecEngine, graphs on, greedy, k drafts per step) on the W4 pair: its time
    per verify step against the sum of the parts timed above (k one-token draft steps + one (k+1)-token target
    step). Random weights accept little; the step time is what is measured, not the speedup."""
    from specquant.spec_decode.config import SpecConfig
    from specquant.spec_decode.engine import SpecEngine

    engine = SpecEngine(target, draft, SpecConfig(draft_len=k), graphs=True)
    prompt = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    engine.generate(prompt, new_tokens, stop_on_eos=False)  # captures every shape
    runs = [engine.generate(prompt, new_tokens, stop_on_eos=False).stats for _ in range(3)]
    stats = min(runs, key=lambda st: st["decode_s"])
    steps = stats["target_forwards"] - 1
    step_ms = stats["decode_s"] / steps * 1e3
    parts_ms = k * draft_r["step_ms"][1] + target_r["step_ms"][k + 1]
    return {"k": k, "verify_steps": steps, "ms_per_step": step_ms, "parts_ms": parts_ms,
            "overhead": step_ms / parts_ms - 1, "tokens_per_s": (stats["new_tokens"] - 1) / stats["decode_s"],
            "mean_acceptance_length": stats["mean_acceptance_length"]}


# --- acceptance (bundled pair) --------------------------------------------------------------------------------


@torch.no_grad()
def bundled_acceptance(prompts: int, new_tokens: int, window: int) -> dict:
    """Greedy acceptance histograms of the bundled pair for rows c-e (CPU, fp32; greedy acceptance is a property
    of the models, not of the device). W4 copies: RTN with the W4 / DRAFT_W4 settings above."""
    from specquant.bench.prompts import load_prompts
    from specquant.loader import load_model
    from specquant.model.checkpoint import load_tokenizer
    from specquant.spec_decode.config import SpecConfig
    from specquant.spec_decode.engine import SpecEngine

    def model(name, quant):
        m = load_model(name, torch.float32)
        if quant is not None:
            quantize(m, QuantConfig(**quant))
        fuse_projections(m)
        return m

    tok = load_tokenizer("tiny-target")
    sets = ("prose", "code", "qa")
    ps = [p for p in load_prompts(tok, {"short": 16}, sets, 1, prompts, 256) if p.kind == "content"]
    target_w4 = model("tiny-target", W4)
    drafts = {"c": (model("tiny-draft", None), None), "d": (model("tiny-draft", DRAFT_W4), None)}
    drafts["e"] = (drafts["d"][0], window)
    out = {}
    for row, (draft, w) in drafts.items():
        cfg = SpecConfig(draft_window=w)
        engine = SpecEngine(target_w4, draft, cfg)
        for p in ps:
            engine.generate(torch.tensor([p.ids]), new_tokens, stop_on_eos=False)
        m = engine.metrics
        out[row] = {"histogram": list(m.histogram), "drafts": m.num_drafts, "draft_tokens": m.num_draft_tokens,
                    "k": cfg.draft_len, "window": w, "mal": m.mean_acceptance_length, "prompts": len(ps)}
    return out


def seed_acceptance(mal: float = SEED_MAL, k: int = SEED_K, steps: int = 100) -> dict:
    """A histogram over `steps` verify steps whose mean acceptance length is `mal` (to 1/steps): what predict_row
    needs, since E = mean acceptance length is all it reads from the histogram."""
    accepted = round((mal - 1.0) * steps)
    lo, hi_steps = divmod(accepted, steps)
    hist = [0] * (k + 1)
    hist[lo] += steps - hi_steps
    if hi_steps:
        hist[lo + 1] += hi_steps
    return {"histogram": hist, "drafts": steps, "draft_tokens": k * steps, "k": k, "window": None, "mal": mal}


def acceptance_metrics(acc: dict) -> SpecMetrics:
    """The SpecMetrics predict_row reads, from an acceptance entry (measured or the seed's)."""
    hist = list(acc["histogram"])
    return SpecMetrics(num_drafts=acc["drafts"], num_draft_tokens=acc["draft_tokens"],
                       num_accepted_tokens=sum(a * n for a, n in enumerate(hist)), histogram=hist)


# --- A10G projection ------------------------------------------------------------------------------------------


def project_a10g(models: dict, shapes: dict, acceptance: dict, verify_ratio: dict, window: int) -> list[dict]:
    """Rows a-e per seed length category, from bytes at 600 GB/s and the given acceptance (see the docstring)."""
    kv_t, kv_d = kv_bytes_per_position(shapes["target"]), kv_bytes_per_position(shapes["draft"])
    rows = []
    for cat, (prompt, new) in SEED_CATEGORIES.items():
        ctx = prompt + new // 2

        def t(role, prec, w=None):
            kv = (kv_t if role == "target" else kv_d) * (min(ctx, w) if w else ctx)
            return (models[role][prec]["weight_bytes"] + kv) / (A10G_GBPS * 1e9)

        base = t("target", "bf16")
        rows.append({"category": cat, "row": "a", "speedup": 1.0, "ms_per_token": base * 1e3})
        rows.append({"category": cat, "row": "b", "speedup": base / t("target", "w4"),
                     "ms_per_token": t("target", "w4") * 1e3})
        for row, draft_prec, w in (("c", "bf16", None), ("d", "w4", None), ("e", "w4", window)):
            acc = acceptance.get(row, acceptance.get("all"))
            k = acc["draft_tokens"] / acc["drafts"] if acc["drafts"] else 0.0
            vr = verify_ratio[min(round(k) + 1, max(verify_ratio))]
            tt = t("target", "w4")
            costs = StepCosts(target_step_s=tt, verify_s=tt * vr, draft_step_s=t("draft", draft_prec, w),
                              baseline_step_s=base)
            pred = predict_row(acceptance_metrics(acc), costs)
            rows.append({"category": cat, "row": row, "speedup": pred.speedup,
                         "leviathan_speedup": pred.leviathan_speedup, "k": pred.k, "c": pred.c,
                         "verify_ratio": vr, "mal": pred.expected_tokens,
                         "ms_per_token": base * 1e3 / pred.speedup})
    return rows


# --- driver ---------------------------------------------------------------------------------------------------


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecquantError("--device cuda but torch sees no CUDA device; use --device cpu --tiny on a CPU machine")
    started = time.perf_counter()
    # the --out policy of every command (util/files.py), before any work: a user's non-empty folder is refused
    out_dir = claim_out_dir(args.out or os.environ.get("OUT") or "runs/gpu", args.overwrite)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    res = {"benchmark": "gpu", "tiny": args.tiny, "env": environment(device), "compile": args.compile}

    def save():
        res["seconds"] = time.perf_counter() - started
        atomic_write(out_dir / "gpu.json", json.dumps(res, indent=1))

    res["copy_gbps"] = copy_bandwidth(device, (16 << 20) if args.tiny else (2 << 30))
    save()
    models = res["models"] = {}
    kept = {}  # the W4 pair, for the engine measurement below
    for role in ("target", "draft"):
        for prec, quant in (("bf16", None), ("w4", W4 if role == "target" else DRAFT_W4)):
            model = build(role, shapes, device, quant)
            r = measure_model(model, device, args.context, args.new_tokens, args.max_t, args.rounds, args.reps,
                              args.compile and role == "target")
            r["floor_tokens_per_s"] = res["copy_gbps"] * 1e9 / r["bytes_per_step"]
            r["fraction_of_floor"] = r["decode_tokens_per_s"] / r["floor_tokens_per_s"]
            models.setdefault(role, {})[prec] = r
            if role == "target" and prec == "w4":
                res["layers"] = measure_layers(model, device, rounds=2 if args.tiny else 5, reps=args.reps)
                res["kernel_sweep"] = (sweep_kernel(model, device) if device.type == "cuda"
                                       else "not measured: the Triton kernel runs compiled on CUDA only")
            if prec == "w4":
                kept[role] = model
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()
    res["engine"] = measure_engine(kept["target"], kept["draft"], device, args.context, args.new_tokens,
                                   models["target"]["w4"], models["draft"]["w4"])
    del kept
    save()
    t, d = models["target"], models["draft"]
    res["w4_over_bf16_decode"] = t["w4"]["decode_tokens_per_s"] / t["bf16"]["decode_tokens_per_s"]
    res["draft_target_ratio"] = {
        "lm": {"bf16/bf16": d["bf16"]["step_ms"][1] / t["bf16"]["step_ms"][1],
               "w4/w4": d["w4"]["step_ms"][1] / t["w4"]["step_ms"][1],
               "bf16/w4": d["bf16"]["step_ms"][1] / t["w4"]["step_ms"][1]},
        "block": "not measured: block drafter not landed",
    }
    res["goals"] = {
        "bf16_fraction_of_floor": {"goal": GOAL_FLOOR_FRACTION, "measured": t["bf16"]["fraction_of_floor"]},
        "w4_over_bf16_decode": {"goal": GOAL_W4_SPEEDUP, "measured": res["w4_over_bf16_decode"]},
    }
    for g in res["goals"].values():
        g["met"] = g["measured"] >= g["goal"]
    save()
    res["acceptance"] = {"bundled": bundled_acceptance(1 if args.tiny else 4, 16 if args.tiny else 96, args.window),
                         "seed": seed_acceptance()}
    vr = t["w4"]["verify_ratio"]
    res["a10g"] = {"gbps": A10G_GBPS, "window": args.window,
                   "from_bundled": project_a10g(models, shapes, res["acceptance"]["bundled"], vr, args.window),
                   "from_seed_mal": project_a10g(models, shapes, {"all": res["acceptance"]["seed"]}, vr,
                                                 args.window)}
    save()
    return res


def summary(res: dict) -> dict:
    t, d = res["models"]["target"], res["models"]["draft"]
    pick = lambda rows: {f"{r['category']}/{r['row']}": round(r["speedup"], 3) for r in rows}  # noqa: E731
    return {"benchmark": "gpu", "device": res["env"]["device"], "gpu": res["env"].get("gpu"), "tiny": res["tiny"],
            "copy_gbps": round(res["copy_gbps"], 1),
            **{f"{role}_{p}_{k}": round(m[p][k], 3) for role, m in (("target", t), ("draft", d)) for p in ("bf16", "w4")
               for k in ("decode_tokens_per_s", "floor_tokens_per_s", "fraction_of_floor")},
            "w4_over_bf16_decode": round(res["w4_over_bf16_decode"], 3),
            "w4_layer_speedup_1_row": {f"{r['layer']} {r['out']}x{r['in']}": round(r["w4_speedup"], 3)
                                       for r in res["layers"] if r["rows"] == 1},
            "verify_ratio_w4": {k: round(v, 3) for k, v in t["w4"]["verify_ratio"].items()},
            "engine_ms_per_step": round(res["engine"]["ms_per_step"], 3),
            "engine_overhead": round(res["engine"]["overhead"], 3),
            "draft_target_ratio": {k: (round(v, 3) if isinstance(v, float) else v)
                                   for k, v in res["draft_target_ratio"]["lm"].items()},
            "block_draft_target_ratio": res["draft_target_ratio"]["block"],
            "goals_met": {k: g["met"] for k, g in res["goals"].items()},
            "a10g_from_bundled": pick(res["a10g"]["from_bundled"]),
            "a10g_from_seed_mal": pick(res["a10g"]["from_seed_mal"]),
            "seconds": round(res["seconds"], 1)}


def print_table(res: dict):
    print(f"device {res['env']['device']} {res['env'].get('gpu', res['env']['cpu'])}  copy {res['copy_gbps']:.1f} GB/s"
          f"{'  (tiny shapes)' if res['tiny'] else ''}")
    print(f"{'model':<14}{'GB/step':>9}{'floor tok/s':>13}{'decode tok/s':>14}{'of floor':>10}{'step ms':>9}"
          f"{'verify x (k+1=4/8/16)':>24}")
    for role, ms in res["models"].items():
        for prec, m in ms.items():
            vr = m["verify_ratio"]
            vrs = "/".join(f"{vr[t]:.2f}" for t in (4, 8, 16) if t in vr)
            print(f"{role + ' ' + prec:<14}{m['bytes_per_step'] / 1e9:>9.3f}{m['floor_tokens_per_s']:>13.1f}"
                  f"{m['decode_tokens_per_s']:>14.1f}{m['fraction_of_floor']:>10.1%}{m['step_ms'][1]:>9.3f}{vrs:>24}")
    print(f"{'W4 layer':<30}{'rows':>5}{'backend':>18}{'W4 us':>9}{'bf16 us':>9}{'W4 x':>7}{'W4 GB/s':>9}")
    for r in res["layers"]:
        label = f"{r['layer']} {r['out']}x{r['in']}"
        print(f"{label:<30}{r['rows']:>5}{r['backend']:>18}{r['w4_us']:>9.1f}{r['bf16_us']:>9.1f}"
              f"{r['w4_speedup']:>7.2f}{r['w4_gbps']:>9.1f}")
    if isinstance(res["kernel_sweep"], list):
        best = {}
        for r in res["kernel_sweep"]:
            key = (r["out"], r["in"], r["rows"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
        for (o, i, rows), r in best.items():
            print(f"kernel {o}x{i}, {rows:>2} rows: best {'gemv' if r['gemv'] else 'dot'} block_n {r['block_n']}"
                  f" warps {r['num_warps']}: {r['us']:.1f} us; default {r['default_us']:.1f} us;"
                  f" dense bf16 {r['bf16_us']:.1f} us")
    lm = res["draft_target_ratio"]["lm"]
    print("draft/target step ratio c: " + ", ".join(f"{k} {v:.3f}" for k, v in lm.items())
          + f"; block drafter: {res['draft_target_ratio']['block']}")
    e = res["engine"]
    print(f"engine (W4 pair, graphs, k={e['k']}): {e['ms_per_step']:.3f} ms per verify step vs parts "
          f"{e['parts_ms']:.3f} ms ({e['overhead']:+.1%} overhead)")
    for name, g in res["goals"].items():
        print(f"goal {name}: {g['measured']:.3f} (goal >= {g['goal']}) {'met' if g['met'] else 'NOT met'}")
    print(f"A10G projection (bytes / {A10G_GBPS:.0f} GB/s), speedup over row a:")
    for src in ("from_bundled", "from_seed_mal"):
        rows = res["a10g"][src]
        cats = list(SEED_CATEGORIES)
        print(f"  {src:<14}" + "".join(f"{c:>9}" for c in cats))
        for row in "abcde":
            vals = {r["category"]: r["speedup"] for r in rows if r["row"] == row}
            print(f"  row {row:<10}" + "".join(f"{vals[c]:>8.2f}x" for c in cats))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else runs/gpu)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into --out even when it is a non-empty folder specquant did not create")
    p.add_argument("--tiny", action="store_true", help="tiny shapes instead of Qwen3-4B / 0.6B (CPU smoke run)")
    p.add_argument("--compile", action="store_true", help="torch.compile the target's one-token step before capture")
    p.add_argument("--context", type=int, default=None, help="prompt tokens before the timed steps (256; tiny 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="decoded tokens per timed run (128; tiny 8)")
    p.add_argument("--max-t", type=int, default=16, help="largest verify step timed (k+1)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds per step size (7; tiny 2)")
    p.add_argument("--reps", type=int, default=None, help="calls per timing (20; tiny 2)")
    p.add_argument("--window", type=int, default=1024, help="draft sliding window of row e (the seed's 1024)")
    args = p.parse_args(argv)
    for name, full, tiny in (("context", 256, 32), ("new_tokens", 128, 8), ("rounds", 7, 2), ("reps", 20, 2)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    try:
        res = run(args)
    except SpecquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(res)
    print(json.dumps(summary(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
