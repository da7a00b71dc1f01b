"""Compiled vs eager decode end to end in FRESH processes: does `Stepper(compile=True)` pay for a typical request?

Each trial is a new Python process (so nothing is warm but the disk), run in turn per round (interleaved, so
background load hits every mode alike):
  eager          the eager decode step
  cold           compiled, empty compile cache (a new SPECQUANT_CACHE directory): the first process ever
  warm           compiled, cache filled by an earlier process (what every later process sees)
  cold_cppw /    the same with inductor's `cpp_wrapper` (C++ instead of Python wrapper code around the kernels)
  warm_cppw
A process loads the model, then runs the same request (prompt + --new-tokens greedy tokens) --requests times.
Reported per mode (median over --rounds): `start_s` = process start -> first request done (imports, load,
compilation, request: what a user of `specquant generate` waits for), `first_s` = the first request alone,
`tpot_ms` = time per output token of the last request (steady state), `e2e_tok_s` = new tokens / start_s.
Usage: python benchmarks/compile_start.py [--model tiny-target] [--new-tokens 64] [--rounds 3] [--modes ...]
A table, then one JSON line. Use `taskset -c 0` and OMP_NUM_THREADS=1 on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
import torch
from specquant.decode.compiled import Stepper
from specquant.decode.generate import generate
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
model_name, mode, new_tokens, requests, threads = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(threads)
if mode.endswith("cppw"):
    torch._inductor.config.cpp_wrapper = True
model = load_model(model_name, "float32", "cpu", fuse=True)
ids = load_tokenizer(model_name).encode("The meaning of the word", add_special_tokens=False)
prompt = torch.tensor([ids])
step = Stepper(model, compile=mode != "eager")
out = []
for i in range(requests):
    t1 = time.perf_counter()
    r = generate(step, prompt, new_tokens, stop_on_eos=False)
    t2 = time.perf_counter()
    if i == 0:
        start_s, first_s = time.time() - t0, t2 - t1
    out.append(r.token_ids[0])
print(json.dumps({"start_s": start_s, "first_s": first_s, "tpot_ms": r.stats["tpot_s"] * 1e3, "tokens": out[-1]}))
"""


def run_child(model: str, mode: str, new_tokens: int, requests: int, threads: int, cache: str) -> dict:
    env = dict(os.environ, SPECQUANT_CACHE=cache, OMP_NUM_THREADS=str(threads))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    res = subprocess.run([sys.executable, "-c", CHILD, repr(time.time()), model, mode, str(new_tokens),
                          str(requests), str(threads)], env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{mode} process failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-target")
    ap.add_argument("--new-tokens", type=int, default=64, help="the request: `specquant generate`'s default")
    ap.add_argument("--requests", type=int, default=2, help="requests per process (the last gives tpot)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="eager,cold,warm,cold_cppw,warm_cppw")
    args = ap.parse_args()
    modes = args.modes.split(",")
    root = tempfile.mkdtemp(prefix="compile_start-")
    try:
        measure(args, modes, root)
    finally:
        shutil.rmtree(root)  # the compile caches this run made (created above, never a user's directory)


def measure(args, modes: list[str], root: str):
    warm_dir = {"warm": os.path.join(root, "warm"), "warm_cppw": os.path.join(root, "warm_cppw")}
    for mode, d in warm_dir.items():  # fill the caches the warm modes read (not timed)
        if mode in modes:
            run_child(args.model, mode, 4, 1, args.threads, d)
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            cache = warm_dir.get(mode) or os.path.join(root, f"{mode}-{r}")
            samples[mode].append(run_child(args.model, mode, args.new_tokens, args.requests, args.threads, cache))
    eager_tokens = samples[modes[0]][0]["tokens"]
    rows = []
    print(f"{args.model}, fp32, {args.new_tokens} new tokens, {args.threads} thread(s), median of {args.rounds}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<10} {'start_s':>8} {'first_s':>8} {'tpot_ms':>8} {'e2e_tok_s':>9} {'steady_tok_s':>12}  same tokens")
    for mode, ss in samples.items():
        med = {k: statistics.median(s[k] for s in ss) for k in ("start_s", "first_s", "tpot_ms")}
        row = {"mode": mode, **med, "e2e_tok_s": args.new_tokens / med["start_s"],
               "steady_tok_s": 1e3 / med["tpot_ms"], "same_tokens": all(s["tokens"] == eager_tokens for s in ss)}
        rows.append(row)
        print(f"{mode:<10} {row['start_s']:8.2f} {row['first_s']:8.2f} {row['tpot_ms']:8.2f} {row['e2e_tok_s']:9.1f} "
              f"{row['steady_tok_s']:12.1f}  {row['same_tokens']}")
    print(json.dumps({"model": args.model, "new_tokens": args.new_tokens, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
