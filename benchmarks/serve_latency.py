"""The three `specquant latency` runs of the serving issue's closing note, side by side: one pair, three servers,
one client protocol.

  specquant+w4   `specquant serve --target T --draft W4` (the W4 GPTQ drafter)
  specquant      `specquant serve --target T --draft none` (target only: the baseline the speedups divide)
  llama-server   llama.cpp's server on `specquant export --for llama.cpp --target T --draft W4` (its W4 tensors
                 are Q4_0 / Q4_1, exact), with `--metrics` so its speculative counters give the MAL

Each server is started as its own process on a free loopback port (engines/process.py), waited for, timed with
`specquant latency` (also a subprocess: a client apart from the server, as the competition's), then stopped.
Without --w4-draft the bundled draft is quantized first (`specquant quantize --method gptq`) into --work.
llama-server comes from llama.cpp's build cache (export/llama_cpp_build.py) or --llama-cpp DIR; the row is left
out, with the reason, when it is not built. Note: llama-server reuses a repeated prompt's KV (its prompt cache is
on by default; `latency` reports the cached tokens), ours only with --prefix-cache, which --prefix-cache passes on.

The recipe by hand, for the bundled pair:
    specquant quantize --model tiny-draft --method gptq --out runs/w4-draft
    specquant serve --draft runs/w4-draft --port 8001 &   specquant serve --draft none --port 8002 &
    specquant export --for llama.cpp --target tiny-target --draft runs/w4-draft --out runs/gguf
    llama-server -m runs/gguf/target.gguf -md runs/gguf/draft.gguf --spec-type draft-simple --metrics --port 8003 &
    specquant latency --server http://127.0.0.1:8001 --baseline-server http://127.0.0.1:8002   (and 8003)

Usage: python benchmarks/serve_latency.py [--target tiny-target] [--draft tiny-draft] [--w4-draft DIR]
       [--work runs/serve_latency] [--categories short,medium,long] [--runs 50] [--warmup 5] [--threads N]
       [--llama-cpp DIR] [--rows specquant+w4,specquant,llama-server] [--prefix-cache] [--tiny]
--tiny: the short category, 2 runs after 1 warm-up (a smoke test, not a measurement).
The last stdout line is one JSON object: {"benchmark": "serve_latency", "rows": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from specquant.engines import Server
from specquant.engines.process import free_port, running
from specquant.runtime import child_env
from specquant.util.flags import print_json

ROWS = ("specquant+w4", "specquant", "llama-server")
SPECQUANT = [sys.executable, "-m", "specquant.cli"]
START_TIMEOUT_S = 300  # a cold start compiles nothing by default, but loads and may build kernels


def call(cmd: list, log) -> str:
    log("$ " + shlex.join(map(str, cmd)))
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=child_env())
    if proc.returncode:
        raise SystemExit(f"error: {cmd[0]} ... exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    return proc.stdout


@contextmanager
def server(cmd: list, port: int, log_path: Path, log):
    """cmd (listening on port) started by the engines' server runner, output in log_path; yields its URL once it
    serves; its process group stopped after."""
    log("$ " + shlex.join(map(str, cmd)) + f"   (log: {log_path})")
    with running(Server([str(c) for c in cmd], label=Path(str(cmd[0])).name), port, log_path,
                 START_TIMEOUT_S) as url:
        yield url


def latency(url: str, baseline: str | None, args, log) -> dict:
    cmd = [*SPECQUANT, "latency", "--server", url, "--categories", args.categories, "--runs", args.runs,
           "--warmup", args.warmup, "--json"]
    if baseline:
        cmd += ["--baseline-server", baseline]
    return json.loads(call(cmd, log).strip().splitlines()[-1])


def llama_server_bin(llama_cpp: str | None) -> Path | None:
    from specquant.export.llama_cpp import default_bin_dir

    path = Path(llama_cpp).expanduser() / "llama-server" if llama_cpp else default_bin_dir() / "llama-server"
    return path if os.access(path, os.X_OK) else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="tiny-target")
    p.add_argument("--draft", default="tiny-draft", help="the draft --w4-draft is quantized from when not given")
    p.add_argument("--w4-draft", default=None, help="a W4 draft checkpoint (default: GPTQ of --draft into --work)")
    p.add_argument("--work", default="runs/serve_latency", help="where the W4 draft, the GGUF files and logs go")
    p.add_argument("--categories", default="short,medium,long")
    p.add_argument("--runs", default="50")
    p.add_argument("--warmup", default="5")
    p.add_argument("--threads", type=int, default=0, help="threads per server (0: torch's / llama.cpp's default)")
    p.add_argument("--llama-cpp", default=None, help="directory holding llama-server (default: the build cache)")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--prefix-cache", action="store_true", help="serve ours with --prefix-cache")
    p.add_argument("--tiny", action="store_true", help="short only, 2 runs after 1 warm-up")
    args = p.parse_args(argv)
    if args.tiny:
        args.categories, args.runs, args.warmup = "short", "2", "1"
    rows = [r for r in args.rows.split(",") if r]
    if not rows or set(rows) - set(ROWS):
        print(f"error: --rows {args.rows!r}: use some of {','.join(ROWS)}", file=sys.stderr)
        return 2
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 (stdout: the table and JSON)
    w4 = args.w4_draft
    if w4 is None and {"specquant+w4", "llama-server"} & set(rows):
        w4 = str(work / "w4-draft")
        if not (Path(w4) / "config.json").exists():
            call([*SPECQUANT, "quantize", "--model", args.draft, "--method", "gptq", "--out", w4, "--overwrite"], log)
    threads = ["--threads", str(args.threads)] if args.threads else []
    serve = [*SPECQUANT, "serve", "--target", args.target, *threads,
             *(["--prefix-cache"] if args.prefix_cache else [])]
    base_port = free_port()
    results, skipped = {}, {}
    # the target-only server runs throughout: every row's speedup is against it, measured in that row's run
    with server([*serve, "--draft", "none", "--port", base_port], base_port, work / "specquant.log", log) as base_url:
        if "specquant" in rows:
            results["specquant"] = latency(base_url, None, args, log)
        if "specquant+w4" in rows:
            port = free_port()
            with server([*serve, "--draft", w4, "--port", port], port, work / "specquant-w4.log", log) as url:
                results["specquant+w4"] = latency(url, base_url, args, log)
        if "llama-server" in rows:
            binary = llama_server_bin(args.llama_cpp)
            if binary is None:
                skipped["llama-server"] = ("llama-server is not built: `python -m specquant.export.llama_cpp_build` "
                                           "builds it, or pass --llama-cpp DIR")
            else:
                gguf = work / "gguf"
                report = json.loads(call([*SPECQUANT, "export", "--for", "llama.cpp", "--target", args.target,
                                          "--draft", w4, "--out", gguf, "--overwrite", "--json"], log))
                port = free_port()
                cmd = shlex.split(report["commands"]["llama-server"])
                cmd[0] = str(binary)
                cmd[cmd.index("--port") + 1] = str(port)
                cmd += ["--host", "127.0.0.1", "--metrics", *(["-t", str(args.threads)] if args.threads else [])]
                with server(cmd, port, work / "llama-server.log", log) as url:
                    results["llama-server"] = latency(url, base_url, args, log)
    cats = [c for c in args.categories.split(",") if c]
    print(f"{'server':<14} {'category':<9} {'prompt':>6} {'median ms':>10} {'p90 ms':>9} {'MAL':>5} {'speedup':>8} "
          f"{'cached':>6}")
    for name in ROWS:
        if name not in results:
            continue
        for cat in cats:
            r = results[name]["categories"][cat]
            mal = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
            speed = f"{r['speedup']:.2f}x" if "speedup" in r else "1.00x"
            cached = f"{r['mean_cached_prompt_tokens']:.0f}" if r["mean_cached_prompt_tokens"] is not None else "-"
            print(f"{name:<14} {cat:<9} {r['prompt_tokens']:>6} {r['median_ms']:>10.1f} {r['p90_ms']:>9.1f} {mal:>5} "
                  f"{speed:>8} {cached:>6}")
    for name, why in skipped.items():
        print(f"{name}: not run ({why})")
    print_json({"benchmark": "serve_latency", "target": args.target, "w4_draft": w4, "rows": results,
                "skipped": skipped})
    return 0


if __name__ == "__main__":
    sys.exit(main())
