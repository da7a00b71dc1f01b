"""Rolling a Gated DeltaNet state back after a verify: the engine's design against the known alternatives.

After the target verifies k+1 tokens and accepts j of them, every DeltaNet layer's recurrent state (fp32
[value_heads, K, V]) and conv state must become the ones after token j. At a Qwen3.5 shape (default the 4B: 24
DeltaNet layers, 32 value heads and 16 key heads of 128, conv_dim 8192; benchmarks/shapes.py's configs), per k:

- rank1 (the engine's, model/gated_delta.py): the verify runs the chunked rule, which yields each token's delta_i,
  and keeps the factors (k_i, delta_i, g_i) and the pre-conv inputs; rollback rebuilds S_j = e^{G_j} S_0 +
  sum_i e^{G_j - G_i} k_i delta_i^T (one small matmul per layer) and slices the conv inputs.
- slots (vLLM's / SGLang's per-position states): the verify runs token by token and stores the state after every
  token; rollback copies slot j into the state.
- rerun (llama.cpp's / mlx-lm's snapshot): the verify runs the chunked rule after copying the state aside; rollback
  copies it back and runs the j accepted tokens through the whole model again (`--no-rerun`: only the DeltaNet rule
  on j tokens, a lower bound that leaves out the weights the re-forward reads again).

Columns per design and k: `extra MiB` = memory held beyond the state itself, over all DeltaNet layers; `rule ms`
= the verify's gated delta rule over all layers in the design's form; `keep ms` = what the verify adds to keep the
rollback possible (the factor record / the slot stores are in the rule for slots / the snapshot copy); `back ms` =
the rollback, mean over every accepted j in 0..k; `total` = rule + keep + back, per round. Layer-level work is
timed on random tensors of the layer's shape; the re-forward on a random-init model (benchmarks/shapes.py's,
built in --dtype: about 8 GiB at 4B in bf16). Figures are medians over --reps; all designs of one k are timed
interleaved in each repetition so background load hits them alike.

Usage: python benchmarks/rollback.py [--shape qwen3.5-4b] [--ks 1,3,7,15] [--reps 5] [--context 128]
       [--dtype bfloat16] [--no-rerun] [--threads N]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/shapes.py: the shapes' configs
from shapes import SHAPES, random_model  # noqa: E402

from specquant.model.gated_delta import chunk_rule, l2_normalize, state_after  # noqa: E402
from specquant.util.dtypes import DTYPES  # noqa: E402

MIB = 1 << 20
DESIGNS = ("rank1", "slots", "rerun")


def layer_shape(cfg) -> dict:
    return {"layers": sum(t == "linear_attention" for t in cfg.layer_types), "hk": cfg.linear_num_key_heads,
            "hv": cfg.linear_num_value_heads, "dk": cfg.linear_key_head_dim, "dv": cfg.linear_value_head_dim,
            "conv": 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim, "kernel": cfg.linear_conv_kernel_dim}


def slots_rule(q, k, v, g, beta, state, scale: float, slots: torch.Tensor):
    """The rule one token at a time, storing the state after every token in slots [T, batch, heads, K, V]: what a
    per-position-state verify does (the recurrence of gated_delta.recurrent_rule, plus one state store a token)."""
    heads = v.shape[2]
    rep = heads // k.shape[2]
    q, k = (x.repeat_interleave(rep, dim=2).transpose(1, 2) for x in (q, k))
    v, g, beta = v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2)
    s = state
    outs = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t, None, None].exp()
        delta = beta[:, :, t, None] * (v[:, :, t] - (k[:, :, t, :, None] * s).sum(-2))
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((q[:, :, t, :, None] * s).sum(-2) * scale)
        slots[t].copy_(s)
    return torch.stack(outs, 1), s


class Layers:
    """Random inputs and states of every DeltaNet layer of the shape, for T = k+1 tokens."""

    def __init__(self, shape: dict, t: int, act_dtype: torch.dtype, gen: torch.Generator):
        n, hk, hv, dk, dv = shape["layers"], shape["hk"], shape["hv"], shape["dk"], shape["dv"]
        self.t, self.scale, self.kernel = t, dk ** -0.5, shape["kernel"]
        r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        self.q = [l2_normalize(r(1, t, hk, dk)) for _ in range(n)]
        self.k = [l2_normalize(r(1, t, hk, dk)) for _ in range(n)]
        self.v = [r(1, t, hv, dv) for _ in range(n)]
        self.g = [-torch.rand(1, t, hv, generator=gen) for _ in range(n)]
        self.beta = [torch.rand(1, t, hv, generator=gen) for _ in range(n)]
        self.state = [r(1, hv, dk, dv) * 0.1 for _ in range(n)]
        self.pre_conv = [r(1, shape["kernel"] - 1 + t, shape["conv"]).to(act_dtype) for _ in range(n)]  # time-major
        # rank1's record (as DeltaNetCache holds it), slots' per-token states, rerun's snapshot
        self.rec_k = [torch.empty(1, t, hk, dk) for _ in range(n)]
        self.rec_d = [torch.empty(1, t, hv, dv) for _ in range(n)]
        self.rec_g = [torch.empty(1, t, hv) for _ in range(n)]
        self.rec_conv = [torch.empty_like(p) for p in self.pre_conv]
        self.slots = [torch.empty(t, 1, hv, dk, dv) for _ in range(n)]
        self.conv_slots = [torch.empty(t, 1, shape["kernel"] - 1, shape["conv"], dtype=act_dtype) for _ in range(n)]
        self.snap = [torch.empty_like(s) for s in self.state]
        self.snap_conv = [torch.empty(1, shape["kernel"] - 1, shape["conv"], dtype=act_dtype) for _ in range(n)]
        self.deltas = [None] * n

    def chunked(self):
        for i in range(len(self.q)):
            _, _, self.deltas[i] = chunk_rule(self.q[i], self.k[i], self.v[i], self.g[i], self.beta[i],
                                              self.state[i], self.scale)

    def keep_rank1(self):
        for i in range(len(self.q)):
            self.rec_k[i].copy_(self.k[i])
            self.rec_d[i].copy_(self.deltas[i])
            self.rec_g[i].copy_(self.g[i])
            self.rec_conv[i].copy_(self.pre_conv[i])

    def back_rank1(self, j: int):
        for i in range(len(self.q)):
            state_after(self.state[i], self.rec_k[i], self.rec_d[i], self.rec_g[i], j)
            self.rec_conv[i][:, j : j + self.kernel - 1].clone()

    def rule_slots(self):
        for i in range(len(self.q)):
            slots_rule(self.q[i], self.k[i], self.v[i], self.g[i], self.beta[i], self.state[i], self.scale,
                       self.slots[i])
            for t in range(self.t):  # the conv state after each token, as the per-position kernels keep it
                self.conv_slots[i][t].copy_(self.pre_conv[i][:, t + 1 : t + self.kernel])

    def back_slots(self, j: int):
        for i in range(len(self.q)):
            if j:
                self.state[i].copy_(self.slots[i][j - 1])
                self.snap_conv[i].copy_(self.conv_slots[i][j - 1])

    def keep_snapshot(self):
        for i in range(len(self.q)):
            self.snap[i].copy_(self.state[i])
            self.snap_conv[i].copy_(self.pre_conv[i][:, : self.kernel - 1])

    def restore(self):
        for i in range(len(self.q)):
            self.state[i].copy_(self.snap[i])

    def rule_prefix(self, j: int):  # --no-rerun: the rule alone on the j accepted tokens
        for i in range(len(self.q)):
            if j:
                chunk_rule(self.q[i][:, :j], self.k[i][:, :j], self.v[i][:, :j], self.g[i][:, :j],
                           self.beta[i][:, :j], self.state[i], self.scale)


def extra_mib(shape: dict, design: str, t: int, act_bytes: int) -> float:
    """Memory a design holds beyond the state itself, over all DeltaNet layers, for a verify of t tokens."""
    n, hk, hv, dk, dv, conv, kern = (shape[x] for x in ("layers", "hk", "hv", "dk", "dv", "conv", "kernel"))
    state = hv * dk * dv * 4
    if design == "rank1":  # factors per token, pre-conv inputs, and the anchor state (kept, not copied, eagerly)
        per_layer = t * (hk * dk + hv * dv + hv) * 4 + (kern - 1 + t) * conv * act_bytes + state
    elif design == "slots":
        per_layer = t * state + t * conv * (kern - 1) * act_bytes
    else:  # one snapshot of the state and the conv state
        per_layer = state + conv * (kern - 1) * act_bytes
    return n * per_layer / MIB


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


WARMUP = 3  # untimed repetitions per k: with one, the first k run was ~2x slower than later ones


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hybrids = [s for s, f in SHAPES.items() if s.startswith("qwen3.5")]
    ap.add_argument("--shape", default="qwen3.5-4b", help=f"one of {', '.join(hybrids)}")
    ap.add_argument("--ks", default="1,3,7,15", help="draft lengths k (verify k+1 tokens)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=128, help="tokens before the verify (the re-forward's position)")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES),
                    help="activations (the conv inputs) and the re-forward's model")
    ap.add_argument("--no-rerun", action="store_true",
                    help="rerun: time only the rule on the accepted tokens instead of a whole-model re-forward")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    if args.shape not in SHAPES or "linear_attention" not in SHAPES[args.shape]().layer_types:
        raise SystemExit(f"--shape {args.shape!r} is not a hybrid shape; use one of {', '.join(hybrids)}")
    torch.set_num_threads(args.threads)
    cfg = SHAPES[args.shape]()
    shape = layer_shape(cfg)
    dtype = DTYPES[args.dtype]
    act_bytes = torch.empty(0, dtype=dtype).element_size()
    ks = [int(k) for k in args.ks.split(",")]
    gen = torch.Generator().manual_seed(0)
    model = None
    if not args.no_rerun:
        model = random_model(cfg, dtype).eval()
        model.setup_cache(1, args.context + max(ks) + 2)
        with torch.inference_mode():
            model(torch.randint(0, cfg.vocab_size, (1, args.context), generator=gen), 0)
    print(f"{args.shape}: {shape['layers']} DeltaNet layers, state {shape['hv']}x{shape['dk']}x{shape['dv']} fp32, "
          f"{args.threads} threads, {args.dtype}, load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'design':<7} {'k':>3} {'extra MiB':>10} {'rule ms':>8} {'keep ms':>8} {'back ms':>8} {'total':>8}")
    results = []
    with torch.inference_mode():
        for k in ks:
            t = k + 1
            lay = Layers(shape, t, dtype, gen)
            toks = torch.randint(0, cfg.vocab_size, (1, t), generator=gen)

            def reforward(j):
                if j and model is not None:
                    model(toks[:, :j], args.context)
                    model.rollback(args.context)
                elif j:
                    lay.rule_prefix(j)

            parts = {
                ("rank1", "rule"): lay.chunked, ("rank1", "keep"): lay.keep_rank1,
                ("rank1", "back"): lambda: [lay.back_rank1(j) for j in range(t)],
                ("slots", "rule"): lay.rule_slots, ("slots", "keep"): lambda: None,
                ("slots", "back"): lambda: [lay.back_slots(j) for j in range(t)],
                ("rerun", "rule"): lay.chunked, ("rerun", "keep"): lay.keep_snapshot,
                ("rerun", "back"): lambda: [(lay.restore(), reforward(j)) for j in range(t)],
            }
            samples = {p: [] for p in parts}
            for rep in range(WARMUP + args.reps):  # warm-ups: allocator, kernels, first-touch pages of this k
                for p, fn in parts.items():
                    s = timed(fn)
                    if rep >= WARMUP:
                        samples[p].append(s / t if p[1] == "back" else s)  # back: mean over the t accepted j
            for d in DESIGNS:
                ms = {x: statistics.median(samples[(d, x)]) * 1e3 for x in ("rule", "keep", "back")}
                row = {"design": d, "k": k, "extra_mib": extra_mib(shape, d, t, act_bytes),
                       "rule_ms": ms["rule"], "keep_ms": ms["keep"], "back_ms": ms["back"],
                       "total_ms": sum(ms.values()),
                       "rerun_back": (("whole model" if model is not None else "rule only") if d == "rerun" else None)}
                results.append(row)
                print(f"{d:<7} {k:>3} {row['extra_mib']:10.1f} {ms['rule']:8.2f} {ms['keep']:8.2f} "
                      f"{ms['back']:8.2f} {row['total_ms']:8.2f}", flush=True)
    print("columns: extra MiB = memory beyond the state, all DeltaNet layers; rule = the verify's rule; keep = what "
          "the verify adds for the rollback; back = rollback, mean over accepted j in 0..k"
          + ("; rerun's back is the rule alone (--no-rerun)" if model is None else
             "; rerun's back includes a whole-model forward of the j accepted tokens"))
    print(json.dumps({"benchmark": "rollback", "shape": args.shape, "deltanet_layers": shape["layers"],
                      "dtype": args.dtype, "threads": args.threads, "reps": args.reps, "context": args.context,
                      "rerun_model": model is not None, "load_avg": os.getloadavg()[0], "torch": torch.__version__,
                      "results": results}))


if __name__ == "__main__":
    main()
