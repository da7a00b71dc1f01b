"""GateConfig and BackendConfig: the one home of the quality gates' defaults (tasks, generation limits, seeds,
thresholds) and of the lm-eval backend's model arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from specquant.spec_decode.runtime import RuntimeConfig

# gate name -> the lm-eval task or group it runs and the metric it gates on ("metric,filter" as lm-eval reports it).
# The metrics follow the seed's quality protocol (docs/GATES.md): MMLU-Pro as the unweighted mean over the subject
# subtasks, IFEval instruction-level strict accuracy, GPQA-Diamond 0-shot CoT with the flexible extraction.
LM_EVAL_GATES = {
    "mmlu_pro": {"task": "mmlu_pro", "metric": "exact_match,custom-extract", "mean_over_subtasks": True},
    "ifeval": {"task": "ifeval", "metric": "inst_level_strict_acc,none"},
    "gpqa_diamond": {"task": "gpqa_diamond_cot_zeroshot", "metric": "exact_match,flexible-extract"},
}
KL_GATE = "kl"
ALL_GATES = (*LM_EVAL_GATES, KL_GATE)

# BF16 scores and gates of the seed (REFERENCE.md §0): the default thresholds are these ratios to the baseline.
SEED_BASELINE = {"mmlu_pro": 0.690, "ifeval": 0.857, "gpqa_diamond": 0.700}
SEED_GATES = {"mmlu_pro": 0.621, "ifeval": 0.814, "gpqa_diamond": 0.630}


def _seed_ratios() -> dict:
    # 0.621/0.690 = 0.900, 0.814/0.857 = 0.950, 0.630/0.700 = 0.900
    return {name: {"ratio": round(SEED_GATES[name] / SEED_BASELINE[name], 3)} for name in SEED_GATES}


def _kl_defaults() -> dict:
    # Forward KL(baseline || model) in nats per token, perplexity ratio model/baseline, top-1 agreement. Bounds a
    # sound 4-bit model meets with room (the seed accepted a PTQ start at KL 0.037 on its 4B target; the bundled
    # AWQ g32 target measures KL 0.0002, ppl ratio 1.001, top-1 0.985: docs/GATES.md) and a broken one does not
    # (the bundled draft against the target: KL > 1).
    # max_lost_mass (vocabulary-pruned models only, specquant/quant/prune_vocab.py): the baseline's probability on the
    # cut ids, which the pruned model can never emit; 0.01 lets through a cut of ids a model almost never
    # predicts, as the 2nd leaderboard entry's 131,101 of 248,320 were meant to be, not one of text it writes.
    return {"max_kl": 0.05, "max_ppl_ratio": 1.05, "min_top1": 0.90, "max_lost_mass": 0.01}


@dataclass
class GateConfig:
    tasks: tuple[str, ...] = ("mmlu_pro", "ifeval", "gpqa_diamond", "kl")
    limit: int | None = field(default=None, metadata={
        "help": "documents per lm-eval task (per subject for MMLU-Pro); None: all"})
    # lm-eval's seeds (python random, numpy, torch, few-shot sampler); python random drives GPQA's choice shuffle
    seeds: tuple[int, int, int, int] = (0, 1234, 1234, 1234)
    # generation limits (None = the task's own default: MMLU-Pro 2048, IFEval 1280). GPQA's task sets none, so
    # lm-eval would stop CoT at 256 tokens; the seed allowed 12288 for the reasoning.
    mmlu_pro_max_gen_toks: int | None = field(default=None, metadata={
        "help": "MMLU-Pro generation limit; None: lm-eval's task value, 2048"})
    ifeval_max_gen_toks: int | None = field(default=None, metadata={
        "help": "IFEval generation limit; None: lm-eval's task value, 1280"})
    gpqa_max_gen_toks: int = field(default=12288, metadata={
        "help": "GPQA-Diamond generation limit (lm-eval's default of 256 cuts the reasoning)"})
    apply_chat_template: bool = field(default=False, metadata={
        "help": "apply the tokenizer's chat template (with --server: chat completions)"})
    # kl gate: held-out blocks cut from the bundled held-out text (or --kl-text FILE)
    kl_samples: int = field(default=16, metadata={"help": "kl gate: held-out blocks"})
    kl_seq_len: int = field(default=256, metadata={"help": "kl gate: tokens per block"})
    kl_batch_size: int = 4
    default_thresholds: dict = field(default_factory=lambda: {**_seed_ratios(), "kl": _kl_defaults()})


# the gates' share of RuntimeConfig, with their own help (and any device string: lm-eval passes cuda:0)
GATE_RUNTIME = {
    "dtype": {"help": "dtype of local checkpoints"},
    "device": {"help": "device of local checkpoints (cpu, cuda)", "choices": None},
    "w4_activations": {"help": "activations of W4 checkpoints' 4-bit layers (model and baseline): auto (int8 "
                               "where the W4A8 kernel runs, as the engines serve them), float (W4A16) or int8 "
                               "(W4A8): gate the arithmetic that will be served"},
    "draft_w4_activations": {"help": "a W4 drafter's activations: auto (int8 where the W4A8 kernel runs), float or "
                                     "int8; speculative decoding is exact, so this moves speed only"},
}


@dataclass
class BackendConfig:
    """Model arguments of the `specquant` lm-eval backend (`--model_args target=DIR,draft=DIR,...`)."""

    target: str = "tiny-target"
    draft: str | None = None  # speculative decoding when given
    # the runtime settings lm-eval's model_args may carry (flat there: dtype=..., device=...); RuntimeConfig's
    # compile / aot / threads keep their defaults in the gates
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata={"fields": GATE_RUNTIME})
    draft_len: int = field(default=3, metadata={"help": "draft tokens per verify step (k)"})  # SpecConfig's others
    max_length: int | None = None  # context; None = the target's max_position_embeddings
    # stop strings are checked between chunks of generation (the engine has no stop-string hook): the first chunk is
    # this long and each next one twice as long, so a stopped answer costs a few re-prefills, not max_gen_toks tokens
    first_chunk: int = 32
    # the most tokens one generation may produce; lm-eval's max_gen_toks is capped to it and to the context
    max_gen_toks_cap: int | None = field(default=None, metadata={
        "help": "cap every generation at this many tokens (quick runs; changes scores)"})
