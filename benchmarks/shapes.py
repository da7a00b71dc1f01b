"""The engine at real model shapes: decode tok/s and verify cost (2..16 rows) in fp32, bf16 and W4, beside the floor.

Random-init models (speed does not depend on the weights' values; nothing is downloaded) of these shapes: the
bundled target (`tiny-target`), Qwen3-0.6B, Qwen3-1.7B and Qwen3-4B (their published config.json architecture
fields), and the Qwen3.5 hybrids 0.8B, 2B and 4B (Gated DeltaNet + gated attention; `--shapes hybrid` runs each
beside the pure-attention Qwen3 of about its parameter count, and prints the hybrid / Qwen3 step-time ratios).
Each model runs the engine's decode path: fused projections, a prompt of --context tokens in the KV cache, then
forwards of T = 1, 2, 4, 8, 16 tokens at that position (T = 1 is a decode step, T > 1 a verify step returning
T rows of logits). Per repetition every T and every component is timed once, interleaved, so background load hits
them alike; figures are medians over --reps, and `spread` is the largest (max - min) / median over a shape's rows.

Floor: the bytes one step must move (every linear's weight buffers, the lm_head, the K/V cache of the attention
layers, and a hybrid's Gated DeltaNet state, read once and written once per step: fp32, 2 MiB per layer at 4B)
divided by the streamed read bandwidth measured at the start of the same run (torch.sum over a buffer far larger
than the LLC). `floor tok/s` is 1 / that time: no memory-bound engine can beat it.

Breakdown (ms per forward, each part timed alone in the same repetition): `linears` = every decoder-layer Linear
called on T rows in layer order; `attention` = the attention per attention layer on that layer's
cache as the decoder runs it (kernels.ops.attention for fp32 CPU steps of up to NATIVE_MAX_ROWS queries, else
SDPA with the model's mask); `rule` (hybrids) = the gated delta rule per DeltaNet layer on T rows from a state of
the layer's shape, keeping the per-token deltas as a verify does (model/gated_delta.py: the recurrent form for one
token, the chunked form for more); `lm_head` = the head on T rows; `rest` = step minus those (norms, RoPE, the
causal conv, cache writes and the DeltaNet rollback record, embedding, Python). A dense layer's step runs as one
native call where it can (model/native_layer.py, as in the engines); `--layer modules` runs every layer on its
modules instead, and `--layer ab` times that step too, interleaved, in a second row.

Memory: a model is built directly in its dtype (the 4B hybrid is ~17 GB in fp32, ~8.5 GB in bf16), so a bf16 row never
holds an fp32 copy. A W4 row is built in bf16 too and quantized from it (what `specquant quantize` reads from a bf16
checkpoint, and the values of the bf16 GGUF llama.cpp's Q4_0 is made from: benchmarks/shapes_gguf.py), then its
dense remainder is widened to float32, so it never holds the fp32 model either.

W4 = RTN, 4 bits, group 32, symmetric (GGUF Q4_0's grid), bf16 scales (as `specquant quantize` writes them for a
bf16 checkpoint), activations in float32; w4a8 = the same weights with int8 activations (set_w4_activations: the
native W4A8 kernel, GGUF's Q4_0 x Q8_0, which is also what llama.cpp's Q4_0 column runs); the head's precision is
--lm-head (dense: the fp32 matrix tied to the embedding; bf16 / w8 / w4: see specquant.quant.head).
The quantized modules are the quantizer's own choice (quant.pipeline.target_linears with QuantConfig's default
--ignore), so a row quantizes what `specquant quantize` would. On a Qwen3.5 hybrid that is every MLP projection,
the full-attention q/k/v/o and the DeltaNet in_proj_qkv, in_proj_z and out_proj; dense stay: the DeltaNet
in_proj_a / in_proj_b (quant.pipeline.DENSE_BY_KIND: value_heads rows each, and their outputs set the state's decay
and write strength, whose errors persist in the recurrent state), the causal conv1d, A_log and dt_bias (not
Linears), every norm, and the embedding (and the head, per --lm-head). The JSON row lists the dense layer Linears.

With --llama-cpp DIR, llama-bench (DIR/build/bin/llama-bench or DIR/bin/llama-bench) is run on the GGUF files
DIR/shapes/<shape>-<f32|bf16|q4_0>.gguf (GGUF_KINDS: the fp32, bf16 and both W4 rows) for tg (decode) and pp2..pp16
(verify-sized prompt batches), and pp<P> for each --prefill length P (beside our prefill of a P-token prompt from an
empty cache: the engines' TTFT without the sampling); the column says "not built" when the binary is absent and "no
gguf" when a file is (benchmarks/shapes_gguf.py DIR makes them). For a file that is there, the row also gets the
weight bytes one llama.cpp step reads (read from the GGUF's tensor table with the gguf package; the embedding only
when it is also the output) beside ours (`weight_bytes`: every decoder-layer tensor, the final norm and the head),
and the matrices llama.cpp keeps in a type other than the file's main one (llama-quantize's Q4_0 keeps the tied
embedding/output in its output type, Q6_K, and qwen35's conv kernel F32; every 1-D tensor is F32; it does quantize
the DeltaNet in_proj_a / in_proj_b, which ours keeps dense).

Usage: python benchmarks/shapes.py [--shapes tiny-target,qwen3-0.6b,qwen3-1.7b | hybrid] [--modes fp32,bf16,w4,w4a8]
       [--rows 1,2,4,8,16] [--context 128] [--reps 5] [--threads N] [--lm-head dense] [--llama-cpp DIR]
       [--attention auto|reference|ab] [--layer native|modules|ab] [--aot] [--prefill 512,2048]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from specquant.bench.shapes import (BESIDE, MODES, PRESETS, SHAPES, build, gguf_path, gguf_weights,
                                    module_bytes, streamed_bandwidth)
from specquant.kernels import LIBRARIES, ops
from specquant.model.attention import NATIVE_MAX_ROWS, Attention
from specquant.model import native_layer
from specquant.model.decoder import Transformer
from specquant.model.deltanet import GatedDeltaNet
from specquant.model.gated_delta import gated_delta_rule, l2_normalize
from specquant.model.modules import Linear
from specquant.quant.head import HEAD_PRECISIONS
from specquant.quant.linear import QuantLinear
from specquant.runtime import child_env, openmp_wait


def dense_layer_linears(model: Transformer) -> list[str]:
    """Names of the decoder-layer Linears a W4 model kept dense (DENSE_BY_KIND's, on a hybrid)."""
    return [f"model.layers.{i}.{n}" for i, layer in enumerate(model.model.layers) for n, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear)]


def layer_linears(model: Transformer) -> list[torch.nn.Module]:
    """Every decoder layer's linears (fused or not, dense or W4), in layer order; any layer kind."""
    return [m for layer in model.model.layers for m in layer.modules() if isinstance(m, (Linear, QuantLinear))]


def attention_mixers(model: Transformer) -> list[Attention]:
    return [layer.mixer for layer in model.model.layers if isinstance(layer.mixer, Attention)]


def deltanet_mixers(model: Transformer) -> list[GatedDeltaNet]:
    return [layer.mixer for layer in model.model.layers if isinstance(layer.mixer, GatedDeltaNet)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def set_fold(model: Transformer, on: bool):
    for a in attention_mixers(model):
        a.fold_enabled = on


def reference_step(model: Transformer, tokens: torch.Tensor, context: int):
    """One step with the reference attention path (--attention ab: timed interleaved with the default step)."""
    set_fold(model, False)
    model(tokens, context)
    set_fold(model, True)


def modules_step(model: Transformer, tokens: torch.Tensor, context: int):
    """One step with every layer on its modules (--layer ab: timed interleaved with the native layer step)."""
    native_layer.ENABLED = False
    try:
        model(tokens, context)
    finally:
        native_layer.ENABLED = True


def measure(model: Transformer, rows: list[int], context: int, reps: int, ab: bool = False,
            layer_ab: bool = False) -> dict:
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    gen = torch.Generator().manual_seed(1)
    model.setup_cache(1, context + max(rows) + 1)
    model(torch.randint(0, cfg.vocab_size, (1, context), generator=gen), 0)
    linears = layer_linears(model)
    xs = {t: {lin.in_features: torch.randn(1, t, lin.in_features, generator=gen).to(dtype) for lin in linears}
          for t in rows}
    hidden = {t: torch.randn(1, t, cfg.hidden_size, generator=gen).to(dtype) for t in rows}
    toks = {t: torch.randint(0, cfg.vocab_size, (1, t), generator=gen) for t in rows}
    attn = attention_mixers(model)
    delta = deltanet_mixers(model)
    rule_in = {t: rule_inputs(delta[0], t, gen) for t in rows} if delta else {}

    def attention(t):  # the decoder's own choice of path: the native kernel (Attention.attend_cached's rule), else
        # SDPA under the step's plan (Attention.plan / attend), mask built once per step
        q = torch.randn(1, cfg.num_attention_heads, t, cfg.head_dim, dtype=dtype)
        if t <= NATIVE_MAX_ROWS and ops.usable(q, attn[0].cache.k):
            for a in attn:
                ops.attention(q, a.cache.k, a.cache.v, context, 0, a.window)
            return
        mask, folded = attn[0].plan(context, t, q.dtype, q.device)
        for a in attn:
            a.attend(q, a.cache.k[:, :, : context + t], a.cache.v[:, :, : context + t], mask, folded)

    def rule(t):  # the form a verify runs (deltas kept for the rollback), from each layer's own state
        q, k, v, g, beta = rule_in[t]
        for m in delta:
            gated_delta_rule(q, k, v, g, beta, m.cache.state, m.key_dim ** -0.5, m.chunk_size, need_delta=True,
                             allow_fla=m.allow_fla)

    parts = {"step": lambda t: model(toks[t], context),
             "linears": lambda t: [lin(xs[t][lin.in_features]) for lin in linears],
             "attention": attention,
             "lm_head": lambda t: model.lm_head(hidden[t])}
    if delta:
        parts["rule"] = rule
    if ab:
        parts["reference_step"] = lambda t: reference_step(model, toks[t], context)
    if layer_ab:
        parts["modules_step"] = lambda t: modules_step(model, toks[t], context)
    samples = {(p, t): [] for p in parts for t in rows}
    with torch.inference_mode():
        for fn in parts.values():  # warm-up: backend choices, repacks, allocator
            for t in rows:
                fn(t)
        for _ in range(reps):
            for t in rows:
                for p, fn in parts.items():
                    samples[(p, t)].append(timed(lambda: fn(t)))
    res = {}
    for t in rows:
        med = {p: statistics.median(samples[(p, t)]) for p in parts}
        s = samples[("step", t)]
        rule_s = med.get("rule", 0.0)
        res[t] = {"ms": med["step"] * 1e3, "spread": (max(s) - min(s)) / med["step"],
                  "linears_ms": med["linears"] * 1e3, "attention_ms": med["attention"] * 1e3,
                  "rule_ms": rule_s * 1e3, "lm_head_ms": med["lm_head"] * 1e3,
                  "rest_ms": (med["step"] - med["linears"] - med["attention"] - rule_s - med["lm_head"]) * 1e3}
        if ab:
            res[t]["reference_ms"] = med["reference_step"] * 1e3
        if layer_ab:
            res[t]["modules_ms"] = med["modules_step"] * 1e3
    model.clear_cache()
    return res


def rule_inputs(m: GatedDeltaNet, t: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q, k (L2-normalised), v, g, beta of t tokens for a DeltaNet layer's shape, in the rule's fp32."""
    q, k = (l2_normalize(torch.randn(1, t, m.key_heads, m.key_dim, generator=gen)) for _ in range(2))
    v = torch.randn(1, t, m.value_heads, m.value_dim, generator=gen)
    g = -torch.rand(1, t, m.value_heads, generator=gen)
    return q, k, v, g, torch.rand(1, t, m.value_heads, generator=gen)


def packaged_decode(model: Transformer, context: int, reps: int) -> dict:
    """The one-token decode step as an AOTInductor package (decode.aot, what `generate --aot` runs): built on first
    use (its build seconds reported), then timed over 10 x reps steps after a context-token prompt. Timed after the
    eager rows, not interleaved with them: a packaged step needs the model's cache in the static layout."""
    from specquant.decode.compile_cache import compile_cache_dir
    from specquant.decode.compiled import Stepper

    gen = torch.Generator().manual_seed(2)
    stepper = Stepper(model, aot="build")
    packages = compile_cache_dir() / "aot"
    before = set(packages.glob("*.pt2"))
    t0 = time.perf_counter()
    stepper.setup(1, context + 10 * reps + 2)
    build_s = time.perf_counter() - t0
    built = bool(set(packages.glob("*.pt2")) - before)
    if not stepper.aot_steps:
        raise SystemExit("no AOT package could be built or loaded for this model")
    toks = torch.randint(0, model.config.vocab_size, (1, context + 10 * reps), generator=gen)
    samples = []
    with torch.inference_mode():
        stepper(toks[:, :context], 0, True)
        for i in range(10 * reps):
            samples.append(timed(lambda: stepper(toks[:, context + i : context + i + 1], context + i, True)))
    model.clear_cache()
    ms = statistics.median(samples[2:]) * 1e3
    return {"ms": ms, "decode_tok_s": 1e3 / ms, "build_s": build_s, "built": built}


def prefill(model: Transformer, lengths: list[int], reps: int) -> dict:
    """The engine's prefill of a prompt of each length from an empty cache (model(ids, 0, last_only=True): the
    head on the last row only, as loop.prefill runs it), timed after one untimed run of the length; median ms, its
    tok/s and spread over reps."""
    gen = torch.Generator().manual_seed(2)
    out = {}
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen)
        times = []
        for rep in range(reps + 1):
            model.setup_cache(1, n + 1)
            elapsed = timed(lambda: model(ids, 0, last_only=True))
            if rep:
                times.append(elapsed)
        med = statistics.median(times)
        out[n] = {"ms": med * 1e3, "tok_s": n / med, "spread": (max(times) - min(times)) / med}
    model.clear_cache()
    return out


def weight_bytes(model: Transformer) -> int:
    """Bytes of the weights one step reads: every decoder layer's tensors (linears, norms, a DeltaNet's conv, A_log
    and dt_bias), the final norm and the head; the embedding only as the tied head (a step reads one row of it)."""
    return sum(module_bytes(m) for m in (*model.model.layers, model.model.norm, model.lm_head))


def step_bytes(model: Transformer, context: int, t: int) -> int:
    """Bytes one step of t tokens moves: weights, K/V of the attention layers, DeltaNet states (read + write)."""
    cfg = model.config
    kv = 2 * len(attention_mixers(model)) * cfg.num_key_value_heads * (context + t) * cfg.head_dim
    kv *= model.model.embed_tokens.weight.element_size()
    state = sum(2 * 4 * m.value_heads * m.key_dim * m.value_dim for m in deltanet_mixers(model))  # fp32 state
    return sum(module_bytes(m) for m in layer_linears(model)) + module_bytes(model.lm_head) + kv + state


def llama_bench(root: Path | None, shape: str, mode: str, rows: list[int]) -> dict | str:
    """llama-bench tok/s for decode (tg) and pp<T>, or why not."""
    if root is None:
        return "not asked"
    exe = next((p for p in (root / "build" / "bin" / "llama-bench", root / "bin" / "llama-bench") if p.is_file()),
               None) or shutil.which("llama-bench", path=str(root))
    if exe is None:
        return "not built"
    gguf = gguf_path(root, shape, mode)
    if not gguf.is_file():
        return "no gguf"
    cmd = [str(exe), "-m", str(gguf), "-t", str(torch.get_num_threads()), "-o", "json", "-r", "3",
           "-p", ",".join(str(t) for t in rows if t > 1), "-n", "32"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True, env=child_env()).stdout
    except subprocess.CalledProcessError as e:  # the tool's own last words, not the (long) command line
        tail = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["no output"]
        return f"failed: {exe.name} exit {e.returncode}: {tail[0][:160]}"
    except (subprocess.SubprocessError, OSError) as e:
        return f"failed: {str(e).splitlines()[0][:80]}"
    res = {}
    for r in json.loads(out):
        key = "tg" if r.get("n_gen") else f"pp{r['n_prompt']}"
        res[key] = r["avg_ts"]
    return res


def beside_ratios(results: list[dict]) -> list[dict]:
    """Each hybrid row against its Qwen3 row of the same mode in this run: step-time ratios (decode and every T)."""
    by = {(r["shape"], r["mode"]): r for r in results}
    out = []
    for r in results:
        other = by.get((r["beside"], r["mode"])) if r["beside"] else None
        if other is None:
            continue
        ms, oms = r["per_rows"], other["per_rows"]
        out.append({"shape": r["shape"], "mode": r["mode"], "beside": r["beside"],
                    "parameters_ratio": r["parameters"] / other["parameters"],
                    "decode_step_ratio": ms[1]["ms"] / oms[1]["ms"],
                    "verify_ms_ratio": {t: ms[t]["ms"] / oms[t]["ms"] for t in ms if t > 1 and t in oms}})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny-target,qwen3-0.6b,qwen3-1.7b",
                    help=f"comma-separated: {', '.join(SHAPES)}, or 'hybrid' (each Qwen3.5 shape beside its Qwen3)")
    ap.add_argument("--modes", default=None,
                    help=f"comma-separated: {', '.join(MODES)} (default: all; w4a8 only where its kernel is built)")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=128, help="tokens in the KV cache before the timed steps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--lm-head", default="dense", choices=HEAD_PRECISIONS,
                    help="W4 models: the head's precision (specquant.quant.head)")
    ap.add_argument("--attention", default="auto", choices=["auto", "reference", "ab"],
                    help="auto: the decoder's rule (folded few-query attention where it measured faster); "
                    "reference: SDPA with enable_gqa everywhere (Attention.fold_enabled = False); ab: auto, plus "
                    "the reference step timed interleaved with it (a second row, 'reference')")
    ap.add_argument("--layer", default="native", choices=["native", "modules", "ab"],
                    help="native: a layer's step in one native call where it runs (model/native_layer.py, what "
                    "the engines run); modules: every layer on its modules (native_layer.ENABLED = False); ab: "
                    "native, plus the modules' step timed interleaved with it (a second row, 'modules')")
    ap.add_argument("--prefill", default="",
                    help="comma-separated prompt lengths: also time the prefill of each from an empty cache (the "
                    "head on the last row only, as the engines run it), beside llama-bench's pp of that length")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp directory with llama-bench")
    ap.add_argument("--aot", action="store_true",
                    help="also time the AOTInductor-packaged one-token step (decode.aot; built once per shape, mode "
                         "and thread count under $SPECQUANT_CACHE/compile/aot, 0.5-1 min each), after the eager rows")
    args = ap.parse_args()
    w4a8_why = None if LIBRARIES["w4a8"].library() is not None else LIBRARIES["w4a8"].why()
    if args.modes is None:
        modes = [m for m in MODES if m != "w4a8" or w4a8_why is None]
    else:
        modes = args.modes.split(",")
        for mode in modes:
            if mode not in MODES:
                raise SystemExit(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
            if mode == "w4a8" and w4a8_why is not None:
                raise SystemExit(f"mode w4a8 needs the native W4A8 kernel, which is unavailable here ({w4a8_why}); "
                                 "drop it from --modes")
    torch.set_num_threads(args.threads)
    rows = sorted({1, *(int(r) for r in args.rows.split(","))})
    prompts = sorted({int(n) for n in args.prefill.split(",") if n})
    if any(n < 2 for n in prompts):
        raise SystemExit(f"--prefill {args.prefill!r}: prompt lengths must be at least 2 (a one-token prompt is a "
                         "decode step: --rows 1)")
    bw = streamed_bandwidth()
    kernels = {name: f.why() for name, f in LIBRARIES.items()}  # SPECQUANT_NATIVE=avx2,portable: an AVX2 CPU's choice
    print(f"streamed read bandwidth: {bw:.1f} GB/s, {args.threads} threads, context {args.context}, "
          f"load average {os.getloadavg()[0]:.1f}; OpenMP wait: {openmp_wait()}; native kernels: "
          + ", ".join(f"{k} {v}" for k, v in kernels.items()), flush=True)
    head = (f"{'shape':<12} {'mode':<5} {'tok/s':>7} {'floor':>7} "
            + " ".join(f"{'v' + str(t):>6}" for t in rows if t > 1)
            + f" {'lin ms':>7} {'attn':>6} {'rule':>6} {'head':>6} {'rest':>6} {'v4 lin/attn/head':>17} {'spread':>6}"
            "  llama.cpp")
    print(head)
    results = []
    shapes = [s for name in args.shapes.split(",") for s in PRESETS.get(name, [name])]
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)} or {', '.join(PRESETS)}")
        cfg = SHAPES[shape]()
        for mode in modes:
            t0 = time.perf_counter()
            model = build(cfg, mode, args.lm_head)
            set_fold(model, args.attention != "reference")
            build_s = time.perf_counter() - t0
            native_layer.ENABLED = args.layer != "modules"
            res = measure(model, rows, args.context, args.reps, ab=args.attention == "ab", layer_ab=args.layer == "ab")
            floor = {t: step_bytes(model, args.context, t) / (bw * 1e9) * 1e3 for t in rows}
            one = res[1]
            pre = prefill(model, prompts, args.reps)
            lc = llama_bench(args.llama_cpp, shape, mode, sorted({*rows, *prompts}))
            lc_file = None
            if args.llama_cpp is not None and gguf_path(args.llama_cpp, shape, mode).is_file():
                lc_file = gguf_weights(gguf_path(args.llama_cpp, shape, mode))
            row = {"shape": shape, "mode": mode, "lm_head": args.lm_head if mode.startswith("w4") else "dense",
                   "parameters": model.num_parameters(), "beside": BESIDE.get(shape),
                   "decode_tok_s": 1e3 / one["ms"], "floor_tok_s": 1e3 / floor[1],
                   "verify_steps": {t: res[t]["ms"] / one["ms"] for t in rows if t > 1},
                   "floor_verify_steps": {t: floor[t] / floor[1] for t in rows if t > 1},
                   "step_bytes": step_bytes(model, args.context, 1), "weight_bytes": weight_bytes(model),
                   "build_s": build_s, "per_rows": res, "prefill": pre, "llama_cpp": lc, "llama_cpp_gguf": lc_file}
            if mode.startswith("w4"):
                row["dense_layer_linears"] = dense_layer_linears(model)
            results.append(row)
            v4 = res.get(4, one)
            lc_s = lc if isinstance(lc, str) else " ".join(f"{k}={v:.1f}" for k, v in lc.items())
            print(f"{shape:<12} {mode:<5} {row['decode_tok_s']:7.1f} {row['floor_tok_s']:7.1f} "
                  + " ".join(f"{row['verify_steps'][t]:6.2f}" for t in rows if t > 1)
                  + f" {one['linears_ms']:7.2f} {one['attention_ms']:6.2f} {one['rule_ms']:6.2f} "
                  f"{one['lm_head_ms']:6.2f} "
                  f"{one['rest_ms']:6.2f} {v4['linears_ms']:5.1f}/{v4['attention_ms']:4.1f}/{v4['lm_head_ms']:5.1f} "
                  f"{max(r['spread'] for r in res.values()):6.2f}  {lc_s}", flush=True)
            if lc_file is not None:
                other = ", ".join(f"{n} {k}" for n, k in lc_file["other_types"].items())
                print(f"{'  bytes':<12} {mode:<5} weights per step: ours {row['weight_bytes'] / 1e9:.3f} GB, "
                      f"llama.cpp {lc_file['weight_bytes'] / 1e9:.3f} GB ({lc_file['file']}; matrices not "
                      f"{lc_file['main_type']}: {other or 'none'}; 1-D: {'/'.join(lc_file['vector_types'])})",
                      flush=True)
            if pre:
                vs = {n: lc.get(f"pp{n}") if isinstance(lc, dict) else None for n in pre}
                print(f"{'  prefill':<12} {mode:<5} "
                      + ", ".join(f"{n} tokens {p['ms']:.0f} ms, {p['tok_s']:.1f} tok/s (spread {p['spread']:.2f})"
                                  + (f" / llama.cpp pp{n} {vs[n]:.1f} = {p['tok_s'] / vs[n]:.2f}x" if vs[n] else "")
                                  for n, p in pre.items()), flush=True)
            if args.aot:
                row["aot"] = packaged_decode(model, args.context, args.reps)
                a = row["aot"]
                print(f"{'  packaged':<12} {mode:<5} {a['decode_tok_s']:7.1f}  (AOT one-token step, "
                      f"{a['decode_tok_s'] / row['decode_tok_s']:.2f}x eager; package "
                      f"{'built in ' + format(a['build_s'], '.0f') + ' s' if a['built'] else 'loaded'})", flush=True)
            if args.attention == "ab":
                ref = {t: res[t]["reference_ms"] for t in rows}
                row["reference_decode_tok_s"] = 1e3 / ref[1]
                row["reference_verify_steps"] = {t: ref[t] / ref[1] for t in rows if t > 1}
                print(f"{'  reference':<12} {mode:<5} {row['reference_decode_tok_s']:7.1f} {'':>7} "
                      + " ".join(f"{row['reference_verify_steps'][t]:6.2f}" for t in rows if t > 1), flush=True)
            if args.layer == "ab":
                mod = {t: res[t]["modules_ms"] for t in rows}
                row["modules_decode_tok_s"] = 1e3 / mod[1]
                row["modules_verify_steps"] = {t: mod[t] / one["ms"] for t in rows if t > 1}
                print(f"{'  modules':<12} {mode:<5} {row['modules_decode_tok_s']:7.1f} {'':>7} "
                      + " ".join(f"{row['modules_verify_steps'][t]:6.2f}" for t in rows if t > 1)
                      + f"  (every layer on its modules; native layer step x{mod[1] / one['ms']:.2f} faster at one "
                      "row, vT here in native one-row steps)", flush=True)
            del model
    comparisons = beside_ratios(results)
    for c in comparisons:
        print(f"{c['shape']:<12} {c['mode']:<5} beside {c['beside']}: step time x{c['decode_step_ratio']:.2f}, "
              + " ".join(f"v{t} x{r:.2f}" for t, r in c["verify_ms_ratio"].items())
              + f" ({c['parameters_ratio']:.2f}x the parameters)")
    print("columns: tok/s = 1 / one-token step; floor = streamed-bandwidth bound; vT = T-row verify / 1-row step; "
          "lin/attn/rule/head/rest = 1-row ms; v4 = the same parts at 4 rows; 'beside': hybrid / Qwen3 step time "
          "in ms (below 1: the hybrid step is cheaper)")
    print(json.dumps({"benchmark": "shapes", "bandwidth_gb_s": bw, "threads": args.threads, "context": args.context,
                      "reps": args.reps, "attention": args.attention, "layer": args.layer,
                      "load_avg": os.getloadavg()[0],
                      "openmp_wait": openmp_wait(),
                      "kernels": kernels,
                      "torch": torch.__version__,
                      "results": results, "beside": comparisons}))


if __name__ == "__main__":
    main()
