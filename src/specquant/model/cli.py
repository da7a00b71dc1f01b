"""`specquant models [DIR ...]`: the bundled models (and any checkpoint directories given), their architectures,
paths, sizes and parameter counts."""

from __future__ import annotations

import torch

from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel, is_block_draft_config
from pathlib import Path

from specquant.model.checkpoint import BUNDLED, BUNDLED_DIR, read_hf_config, resolve
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.util.flags import print_json


# the script that builds each bundled model (what a "not built" row points to)
BUILT_BY = {"tiny-block-draft": "scripts/train_block_draft.sh", "tiny-hybrid": "scripts/train_tiny_hybrid.sh",
            "tiny-hybrid-block-draft": "scripts/train_tiny_hybrid.sh block-draft"}


def add_parser(sub):
    p = sub.add_parser("models", help="list the bundled models (and describe checkpoint directories)")
    p.add_argument("paths", nargs="*", help="checkpoint directories to describe as well")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def param_count(cfg) -> int:
    """Transformer.num_parameters of the architecture, built on the meta device (no memory, no weights read)."""
    with torch.device("meta"):
        return Transformer(cfg).num_parameters()


def describe(paths: tuple[str, ...] = ()) -> list[dict]:
    rows = []
    for name, path in [(n, BUNDLED_DIR / n) for n in BUNDLED] + [(str(p), Path(p)) for p in paths]:
        if name in paths:
            path = resolve(path)  # a directory the user named: a missing one is an error, not "not built"
        if not (path / "config.json").exists():
            rows.append({"name": name, "path": str(path), "available": False})
            continue
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        hf = read_hf_config(path)
        if is_block_draft_config(hf):  # its own weights only: embeddings and lm_head are the target's
            bcfg = BlockDraftConfig.from_hf(hf)
            with torch.device("meta"):
                params = BlockDraftModel(bcfg).num_parameters()
            rows.append({"name": name, "path": str(path), "available": True, "bytes": size, "parameters": params,
                         "kind": "block drafter", "architecture": "DFlashDraftModel", "layers": bcfg.num_hidden_layers, "hidden": bcfg.hidden_size,
                         "block_size": bcfg.block_size, "target_layer_ids": bcfg.target_layer_ids})
            continue
        cfg = ModelConfig.from_hf(hf)
        rows.append({"name": name, "path": str(path), "available": True, "bytes": size, "architecture": cfg.describe(),
                     "parameters": param_count(cfg), "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                     "vocab": cfg.vocab_size, "context": cfg.max_position_embeddings})
    return rows


def run(args):
    rows = describe(tuple(getattr(args, "paths", ())))
    if args.json:
        print_json({"models": rows})
        return 0
    w = max(16, *(len(r["name"]) for r in rows))
    print(f"{'name':<{w}} {'params':>10} {'size':>10}  path  (architecture)")
    for r in rows:
        if r["available"]:
            print(f"{r['name']:<{w}} {r['parameters'] / 1e6:>9.2f}M {r['bytes'] / 2**20:>8.1f}MB  {r['path']}  "
                  f"({r['architecture']})")
        else:
            print(f"{r['name']:<{w}} {'-':>10} {'-':>10}  {r['path']} (not built: run "
                  f"{BUILT_BY.get(r['name'], 'scripts/train_bundled.py')})")
    return 0
