"""Compiled vs eager decode end to end in FRESH processes: does a compiled step pay for a typical request?

Each trial is a new Python process (so nothing is warm but the disk), run in turn per round (interleaved, so
background load hits every mode alike):
  eager          the eager decode step
  cold           torch.compile, empty compile cache (a new SPECQUANT_CACHE directory): the first process ever
  warm           torch.compile, cache filled by an earlier process (what every later process sees)
  cold_cppw /    the same with inductor's `cpp_wrapper` (C++ instead of Python wrapper code around the kernels)
  warm_cppw
  aot_cold       AOTInductor package (decode.aot, `Stepper(aot="build")`), empty cache: the build is timed
  aot            AOTInductor package already on disk (`Stepper(aot="cached")`): the process only loads it
A process loads the model, then runs the same request (prompt + --new-tokens greedy tokens) --requests times.
The prompt is the CLI's default text, or with --prompt-tokens N, N fixed pseudo-random token ids.
Reported per mode (median over --rounds):
  `fresh_tok_s` = new tokens / `first_s`, where first_s is the process's first request timed from just before
                  the stepper is made to the last token: compilation or package load, prefill and decode are all
                  inside it (only imports and the checkpoint load, the same for every mode, are not). This is the
                  quantity of "fp32 decode >= 300 tok/s in a fresh process, compilation included".
  `start_s`     = process start -> first request done (imports, load, compilation, request);
  `tpot_ms`     = time per output token of the last request (steady state), `steady_tok_s` = 1000 / tpot_ms.
Usage: python benchmarks/compile_start.py [--model tiny-target] [--new-tokens 64] [--prompt-tokens 0]
       [--rounds 3] [--modes ...]
A table, then one JSON line. Use `taskset -c 1` and OMP_NUM_THREADS=1 on a shared machine.
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
from specquant.spec_decode.engine import generate
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer
model_name, mode, new_tokens, requests, threads, prompt_tokens = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8])
torch.set_num_threads(threads)
if mode.endswith("cppw"):
    torch._inductor.config.cpp_wrapper = True
model = load_model(model_name, "float32", "cpu", fuse=True)
if prompt_tokens:
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
else:
    prompt = torch.tensor([load_tokenizer(model_name).encode("The meaning of the word", add_special_tokens=False)])
out = []
t1 = time.perf_counter()
if mode.startswith("aot"):
    step = Stepper(model, aot="build" if mode == "aot_cold" else "cached")
else:
    step = Stepper(model, compile=mode != "eager")
for i in range(requests):
    r = generate(step, prompt, new_tokens, stop_on_eos=False)
    t2 = time.perf_counter()
    if i == 0:
        start_s, first_s = time.time() - t0, t2 - t1
    out.append(r.token_ids[0])
    assert mode != "aot" or step.aot_steps, "no AOT package was found in the warm cache"
print(json.dumps({"start_s": start_s, "first_s": first_s, "tpot_ms": r.stats["tpot_s"] * 1e3, "tokens": out[-1]}))
"""


def run_child(model: str, mode: str, new_tokens: int, requests: int, threads: int, cache: str,
              prompt_tokens: int) -> dict:
    env = dict(os.environ, SPECQUANT_CACHE=cache, OMP_NUM_THREADS=str(threads))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    res = subprocess.run([sys.executable, "-c", CHILD, repr(time.time()), model, mode, str(new_tokens),
                          str(requests), str(threads), str(prompt_tokens)],
                         env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{mode} process failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-target")
    ap.add_argument("--new-tokens", type=int, default=64, help="the request: `specquant generate`'s default")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="prompt of this many fixed token ids (0: the CLI's default prompt text)")
    ap.add_argument("--requests", type=int, default=2, help="requests per process (the last gives tpot)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="eager,warm,aot,aot_cold")
    args = ap.parse_args()
    modes = args.modes.split(",")
    root = tempfile.mkdtemp(prefix="compile_start-")
    try:
        measure(args, modes, root)
    finally:
        shutil.rmtree(root)  # the compile caches this run made (created above, never a user's directory)


def measure(args, modes: list[str], root: str):
    warm_dir = {m: os.path.join(root, m) for m in ("warm", "warm_cppw", "aot")}
    for mode, d in warm_dir.items():  # fill the caches the warm modes read (not timed; same request length, so
        if mode in modes:            # the same AOT cache capacity)
            run_child(args.model, "aot_cold" if mode == "aot" else mode, args.new_tokens, 1, args.threads, d,
                      args.prompt_tokens)
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            cache = warm_dir.get(mode) or os.path.join(root, f"{mode}-{r}")
            samples[mode].append(run_child(args.model, mode, args.new_tokens, args.requests, args.threads, cache,
                                           args.prompt_tokens))
    eager_tokens = samples[modes[0]][0]["tokens"]
    rows = []
    prompt = f"{args.prompt_tokens}-token prompt" if args.prompt_tokens else "default prompt"
    print(f"{args.model}, fp32, {prompt}, {args.new_tokens} new tokens, {args.threads} thread(s), median of "
          f"{args.rounds}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<10} {'start_s':>8} {'first_s':>8} {'fresh_tok_s':>11} {'tpot_ms':>8} {'steady_tok_s':>12}  "
          "same tokens")
    for mode, ss in samples.items():
        med = {k: statistics.median(s[k] for s in ss) for k in ("start_s", "first_s", "tpot_ms")}
        row = {"mode": mode, **med, "fresh_tok_s": args.new_tokens / med["first_s"],
               "steady_tok_s": 1e3 / med["tpot_ms"], "same_tokens": all(s["tokens"] == eager_tokens for s in ss)}
        rows.append(row)
        print(f"{mode:<10} {row['start_s']:8.2f} {row['first_s']:8.2f} {row['fresh_tok_s']:11.1f} "
              f"{row['tpot_ms']:8.2f} {row['steady_tok_s']:12.1f}  {row['same_tokens']}")
    print(json.dumps({"model": args.model, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                      "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
