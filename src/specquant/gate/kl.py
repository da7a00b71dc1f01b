"""The kl gate: a compressed model against its baseline on held-out text (quant.quality.compare: KL, perplexity,
top-1 agreement), for models that score near chance on the benchmarks (the bundled pair) and as a fast check."""

from __future__ import annotations

from pathlib import Path

from specquant.errors import SpecquantError
from specquant.gate.config import GateConfig

HELDOUT = Path(__file__).resolve().parent.parent / "data" / "heldout.txt"


def kl_stats(model: str, baseline: str, cfg: GateConfig, text: str | None = None, dtype: str = "float32",
             w4_activations: str = "float") -> dict:
    """KL(baseline || model) nats/token, perplexities and their ratio, top-1 agreement on held-out blocks.

    A vocabulary-pruned model (specquant/quant/prune_vocab.py) against its unpruned baseline: the blocks are cut from
    the text as the pruned model's own tokenizer spells it (the baseline reads the same tokens as full-vocabulary
    ids), and the mass the baseline puts on the cut ids is reported apart (`lost_mass`, gated by max_lost_mass):
    quant.quality.compare says how."""
    from specquant.loader import load_model
    from specquant.model.checkpoint import load_tokenizer, read_config, read_hf_config, resolve
    from specquant.quant.prune_vocab import full_vocab_size, read_vocab_map
    from specquant.quant.quality import compare, heldout_tokens

    m_cfg, b_cfg = read_config(model), read_config(baseline)
    m_hf = read_hf_config(resolve(model))
    kept = read_vocab_map(m_hf)
    if kept is not None and read_vocab_map(read_hf_config(resolve(baseline))) is not None:
        raise SpecquantError(f"the kl gate's baseline {baseline} is vocabulary-pruned too; compare with the "
                             "unpruned checkpoint")
    if kept is not None and full_vocab_size(m_hf) != b_cfg.vocab_size:
        raise SpecquantError(f"{model} was pruned from a {full_vocab_size(m_hf)}-token vocabulary, baseline "
                             f"{baseline} has {b_cfg.vocab_size}; use the checkpoint it was pruned from")
    if kept is None and m_cfg.vocab_size != b_cfg.vocab_size:
        raise SpecquantError(f"the kl gate compares next-token distributions: {model} has {m_cfg.vocab_size} tokens, "
                             f"baseline {baseline} has {b_cfg.vocab_size}; use a baseline with the same tokenizer")
    path = Path(text) if text else HELDOUT
    if not path.is_file():
        raise SpecquantError(f"held-out text {str(path)!r} does not exist; pass --kl-text FILE (plain text)")
    tokens = heldout_tokens(load_tokenizer(baseline if kept is None else model), path, cfg.kl_samples,
                            cfg.kl_seq_len)
    reference = load_model(baseline, dtype, w4_activations=w4_activations)
    stats = compare(reference, load_model(model, dtype, w4_activations=w4_activations), tokens, cfg.kl_batch_size,
                    kept=kept)
    nll = stats.pop("nll_tokens")  # per token, model minus baseline
    stats["ppl_ratio"] = stats["ppl"] / stats["ppl_ref"]
    stats["nll_diff_stderr"] = float(nll.std() / nll.numel() ** 0.5)
    stats["tokens"] = int(tokens.numel())
    stats["text"] = str(path)
    return stats


def kl_gate(model: str, baseline: str, cfg: GateConfig | None = None, rules: dict | None = None,
            text: str | None = None, dtype: str = "float32", w4_activations: str = "float"):
    """(stats, rows) of the kl gate with the default (or given) bounds: what `specquant demo` prints."""
    from specquant.gate.config import KL_GATE
    from specquant.gate.thresholds import decide_kl

    cfg = cfg or GateConfig()
    stats = kl_stats(model, baseline, cfg, text, dtype, w4_activations)
    return stats, decide_kl(rules or cfg.default_thresholds[KL_GATE], stats)


def demo_gate(model: str, baseline: str, quick: bool = False, log=print) -> dict:
    """`specquant demo`'s quality step: the kl gate with its default bounds, printed as a pass/fail table."""
    import dataclasses

    from specquant.gate.thresholds import exit_code, table

    cfg = GateConfig()
    if quick:  # the quick demo's budget: 4 x 128 held-out tokens instead of 16 x 256
        cfg = dataclasses.replace(cfg, kl_samples=4, kl_seq_len=128)
    stats, rows = kl_gate(model, baseline, cfg)
    passed = exit_code(rows) == 0
    log(f"quality gate (kl, {stats['tokens']} held-out tokens): {model} against {baseline}")
    log(table(rows))
    log(f"quality gate: {'PASS' if passed else 'FAIL'}")
    return {"kl": stats, "gates": [r.to_dict() for r in rows], "passed": passed}
