"""Tree verification against chains at an equal verify budget (the same number of target rows per step).

Pairs (--pairs): the bundled targets (tiny-target: dense; tiny-hybrid: Qwen3.5 layout) with the suffix drafter and
their block drafters (tiny-block-draft, tiny-hybrid-block-draft). Per budget N: the chain drafts up to N tokens
(suffix: SuffixConfig.max_draft_len N; block: draft_len min(N, block - 1)), the tree up to N nodes (suffix: the chain
plus the match's other continuations, spec_decode/suffix_tree.py; block: best-first over the block's per-position
distributions, spec_decode/tree.py), so both verify at most N + 1 rows. Greedy, fp32, eager; content prompts of the
packaged prompt file (prose, code, qa; their last --prompt-tokens tokens), --new tokens each, EOS off. Per row:
`tok/fwd` = tokens per verify forward (new tokens after the prefill's / target forwards after the prefill), `tok/s`
= the requests' new tokens over their wall time (prefill included), `match` = outputs equal to target-only greedy.
Rows of one pair run interleaved per prompt after a warm-up, so background load hits them alike; `vs chain` is the
tree's tok/s over the chain's at the same N.

Verify cost (--shape): at a Qwen3.5 shape (benchmarks/shapes.py's configs; --layers keeps the first L layers, the
3:1 DeltaNet / attention pattern intact) in --mode (fp32, or w4: shapes.build's RTN g32), a prompt of --context
tokens in the caches, then one target forward of R = N + 1 rows: as a chain (the engine's verify), and as trees of
N nodes: `ddtree` (best_first_tree over peaky random per-depth distributions, depth 8: a few long branches) and `star`
(every node a child of the root: the most segments, the worst case for the segment-wise native paths). `commit` is
Transformer.commit_tree on the ddtree's longest path. Medians over --reps, all shapes of one N interleaved.

Usage: python benchmarks/tree.py [--pairs] [--budgets 4,8,16] [--new 64] [--prompts 6]
       [--shape qwen3.5-4b --layers 4 --mode w4 --nodes 8,16,32 --context 512 --reps 5] [--threads N]
A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from specquant.bench import shapes
from specquant.bench.prompts import DEFAULT_PROMPTS, encode, read_jsonl
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer, resolve
from specquant.model.tree import TreeLayout
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import generate
from specquant.spec_decode.suffix_drafter import SuffixConfig
from specquant.spec_decode.tree import best_first_tree, layout

PAIRS = {"tiny-target": "tiny-block-draft", "tiny-hybrid": "tiny-hybrid-block-draft"}
BLOCK_MAX = 15  # the bundled block drafters' block_size - 1


def prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    rows = [r for r in read_jsonl(DEFAULT_PROMPTS) if r["category"] in ("prose", "code", "qa")]
    rows = sorted(rows, key=lambda r: (r["id"].split("-")[1], r["category"]))[:count]  # alternate the sets
    return [encode(tokenizer, r["text"])[-tokens:] for r in rows]


def engines(target, block_dir: str, budget: int) -> dict[str, object]:
    """The four rows of one budget: (suffix | block) x (chain | tree)."""
    out = {}
    for shape, nodes in (("chain", 0), ("tree", budget)):
        suffix = SuffixConfig(max_draft_len=budget)
        out[f"suffix {shape}"] = build_engine(target, "suffix", spec=SpecConfig(tree_nodes=nodes),
                                              draft_options={"suffix": suffix})
        k = min(budget, BLOCK_MAX)
        out[f"block {shape}"] = build_engine(target, block_dir, spec=SpecConfig(draft_len=k if not nodes
                                                                                 else BLOCK_MAX, tree_nodes=nodes))
    return out


def run_pairs(args) -> list[dict]:
    results = []
    budgets = [int(b) for b in args.budgets.split(",")]
    for name, block_dir in PAIRS.items():
        target = load_model(name).eval()
        ids = prompts(load_tokenizer(resolve(name)), args.prompts, args.prompt_tokens)
        rows = {"target only": None}
        for b in budgets:
            rows.update({f"{key} N={b}": e for key, e in engines(target, block_dir, b).items()})
        stats = {key: {"new": 0, "fwd": 0, "s": 0.0, "match": 0} for key in rows}
        refs = []
        with torch.no_grad():
            for i, p in enumerate(ids):
                prompt = torch.tensor([p])
                refs.append(generate(target, prompt, args.new, stop_on_eos=False).token_ids[0])
                if i == 0:  # warm-up: every row once, not counted
                    for e in rows.values():
                        if e is not None:
                            e.generate(prompt, 8, stop_on_eos=False)
                for key, e in rows.items():
                    t0 = time.perf_counter()
                    out = generate(target, prompt, args.new, stop_on_eos=False) if e is None else \
                        e.generate(prompt, args.new, stop_on_eos=False)
                    dt = time.perf_counter() - t0
                    st = stats[key]
                    st["new"] += out.stats["new_tokens"] - 1
                    st["fwd"] += out.stats["target_forwards"] - 1
                    st["s"] += dt
                    st["match"] += out.token_ids[0] == refs[-1]
        for key, st in stats.items():
            results.append({"target": name, "row": key, "tokens_per_forward": st["new"] / st["fwd"],
                            "tok_s": (st["new"] + len(ids)) / st["s"], "match": f"{st['match']}/{len(ids)}"})
        for r in results:
            if r["target"] == name and " tree " in r["row"]:
                chain = next(c for c in results if c["target"] == name and c["row"] == r["row"].replace("tree",
                                                                                                        "chain"))
                r["vs_chain"] = r["tok_s"] / chain["tok_s"]
        del target
    print(f"{'target':<12} {'row':<22} {'tok/fwd':>8} {'tok/s':>8} {'vs chain':>9} {'match':>6}")
    for r in results:
        vs = f"{r['vs_chain']:.2f}x" if "vs_chain" in r else ""
        print(f"{r['target']:<12} {r['row']:<22} {r['tokens_per_forward']:8.2f} {r['tok_s']:8.1f} {vs:>9} "
              f"{r['match']:>6}")
    return results


def shape_trees(nodes: int) -> dict[str, TreeLayout]:
    gen = torch.Generator().manual_seed(nodes)
    logprobs = torch.log_softmax(torch.randn(8, 64, generator=gen) * 3, -1)  # peaky: a few long branches
    _, parents = best_first_tree(logprobs, nodes)
    return {"chain": TreeLayout.chain(nodes + 1), "ddtree": layout(parents), "star": layout((0,) * nodes)}


def run_shape(args) -> list[dict]:
    cfg = shapes.SHAPES[args.shape]()
    cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers, layer_types=cfg.layer_types[: args.layers])
    model = shapes.build(cfg, args.mode, "dense")
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
    model.setup_cache(1, args.context + 64, window=None)
    results = []
    with torch.no_grad():
        model(prompt, 0, last_only=True)
        # a commit moves the DeltaNet anchor past the context: each one is undone from this snapshot
        snaps = [None if c is None else c.snapshot(args.context) for c in model.caches()]
        for nodes in [int(n) for n in args.nodes.split(",")]:
            trees = shape_trees(nodes)
            tokens = torch.randint(0, vocab, (1, nodes + 1), generator=gen)
            times = {k: [] for k in (*trees, "commit")}
            for rep in range(args.reps + 1):  # the first repetition warms up
                for key, tree in trees.items():
                    t0 = time.perf_counter()
                    if key == "chain":
                        model(tokens, args.context)
                    else:
                        model(tokens, args.context, tree=tree)
                    dt = time.perf_counter() - t0
                    if key == "ddtree":
                        leaf = max(range(len(tree)), key=lambda i: tree.depth[i])
                        t1 = time.perf_counter()
                        model.commit_tree(args.context, tree.path(leaf))
                        if rep:
                            times["commit"].append(time.perf_counter() - t1)
                        for cache, snap in zip(model.caches(), snaps):
                            if cache is not None:
                                cache.restore(snap)
                    model.rollback(args.context)
                    if rep:
                        times[key].append(dt)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            results.append({"shape": args.shape, "layers": args.layers, "mode": args.mode, "nodes": nodes,
                            "rows": nodes + 1, "chain_ms": med["chain"], "ddtree_ms": med["ddtree"],
                            "star_ms": med["star"], "commit_ms": med["commit"],
                            "ddtree_segments": len(trees["ddtree"].segments),
                            "ddtree_depth": max(trees["ddtree"].depth)})
    print(f"\n{'shape':<12} {'layers':>6} {'mode':>5} {'rows':>5} {'chain ms':>9} {'ddtree ms':>10} {'(segs)':>6} "
          f"{'star ms':>8} {'commit ms':>10} {'ddtree/chain':>13}")
    for r in results:
        print(f"{r['shape']:<12} {r['layers']:>6} {r['mode']:>5} {r['rows']:>5} {r['chain_ms']:9.1f} "
              f"{r['ddtree_ms']:10.1f} {r['ddtree_segments']:>6} {r['star_ms']:8.1f} {r['commit_ms']:10.2f} "
              f"{r['ddtree_ms'] / r['chain_ms']:12.2f}x")
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", action="store_true", help="tree vs chain on the bundled pairs")
    p.add_argument("--budgets", default="4,8,16", help="verify budgets N (draft tokens / tree nodes)")
    p.add_argument("--new", type=int, default=64, help="new tokens per request")
    p.add_argument("--prompts", type=int, default=6, help="content prompts (prose, code, qa alternating)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="each prompt's last this many tokens")
    p.add_argument("--shape", default=None, help="a benchmarks/shapes.py shape for the verify cost (qwen3.5-4b)")
    p.add_argument("--layers", type=int, default=4, help="the shape's first L layers (memory)")
    p.add_argument("--mode", default="w4", choices=("fp32", "w4"), help="the shape's weights")
    p.add_argument("--nodes", default="8,16,32", help="tree sizes N (verify rows N + 1)")
    p.add_argument("--context", type=int, default=512, help="cached positions before the verify")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.pairs and not args.shape:
        p.error("give --pairs, --shape SHAPE, or both")
    out = {"threads": torch.get_num_threads()}
    if args.pairs:
        out["pairs"] = run_pairs(args)
    if args.shape:
        out["verify_cost"] = run_shape(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
