"""BenchConfig: the one home of the benchmark's defaults; `specquant bench` builds its flags from these fields.

It holds a SpecConfig and a SamplingConfig rather than copies of their fields: their defaults, checks and flag help
live there. Why each default is what it is: docs/BENCH.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.quant.config import METHODS
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafters import DrafterOptions
from specquant.spec_decode.runtime import RuntimeConfig

DTYPES = ("float32", "bfloat16")  # the names of util.dtypes.DTYPES whose rows the bench supports
# the bench's share of RuntimeConfig (its --device is its own flag; rows run eagerly: no --compile / --aot)
BENCH_RUNTIME = {
    "dtype": {"help": "activation dtype of every row", "choices": DTYPES},
    "w4_activations": {"help": "activations of the W4 targets' 4-bit layers: auto = int8 where the W4A8 kernel "
                               "runs (W4A8, as llama.cpp's Q4_0 on CPUs), float (W4A16, the checkpoint's "
                               "arithmetic) or int8"},
    "draft_w4_activations": {"help": "activations of the W4 drafters' 4-bit layers (LM and block): auto = int8 "
                                     "where the W4A8 kernel runs (a drafter only proposes: acceptance may move, the "
                                     "output cannot), float or int8"},
    "threads": {},
}


def _bench_spec() -> SpecConfig:
    # draft_window is the window row (e) uses (rows c and d run the draft with full attention); 128 from the
    # window sweep in docs/BENCH.md
    return SpecConfig(draft_window=128)


@dataclass
class BenchConfig:
    max_new_tokens: int = field(default=128, metadata={"help": "new tokens per request (EOS ignored)"})
    runs: int = field(default=3, metadata={"help": "timed runs per prompt and row (median reported)"})
    warmup: int = field(default=1, metadata={"help": "untimed runs first"})
    # False: the warm-up rounds run each row on the first length prompt only (the shortest category's). A row's
    # first call pays its one-time costs (lazy imports, the native kernels' first call, first touch of its weights);
    # on CPU nothing is compiled per prompt length, so warming every prompt costs a whole round for little. The
    # demo's presets use False; `specquant bench` keeps warming every prompt.
    warmup_all_prompts: bool = True
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    spec: SpecConfig = field(default_factory=_bench_spec)
    # Prompt lengths in target tokens per length category: 64 / 2048 / 8192 scaled to a 2048-token context. For a
    # model whose context cannot hold the longest + max_new_tokens, all shrink by one factor (prompts.fit_lengths).
    lengths: dict[str, int] = field(default_factory=lambda: {"short": 32, "medium": 256, "long": 1024})
    content_sets: tuple[str, ...] = ("prose", "code", "qa")  # acceptance is reported per content set
    # repeating text, reported apart from the content sets (bench/prompts.py): the competition's latency prompt
    filler_sets: tuple[str, ...] = ("filler",)
    content_max_tokens: int = 512  # content prompts longer than this keep their last tokens
    prompts_per_length: int = field(default=2, metadata={"help": "prompts per length category (first N in the file)"})
    prompts_per_set: int = field(default=3, metadata={"help": "prompts per content set (first N in the file)"})
    prompts: str | None = field(default=None, metadata={
        "help": 'JSONL of {"id","category","text"} replacing the packaged bench/prompts/default.jsonl'})
    out: str = field(default="runs/bench", metadata={"help": "output directory"})
    overwrite: bool = field(default=False, metadata={
        "help": "write into --out even when it is a non-empty directory specquant did not create"})
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata={"fields": BENCH_RUNTIME})
    hf_compare: bool = field(default=True, metadata={
        "help": "the transformers generate(assistant_model=...) comparison row"})
    # timed runs of that row (None: `runs`, as every row). It is a reference point, not a ratio the report
    # derives anything from, and transformers' generate is the slowest row per token: the demo times it once
    hf_runs: int | None = None
    # Quantizers for missing quantized inputs; overrides are QuantConfig fields (e.g. a smaller calibration set).
    target_method: str = "awq"
    draft_method: str = "gptq"
    quant_overrides: dict = field(default_factory=dict)
    # The drafter is compressed harder than the target: its lm_head is quantized too (the embedding lookup stays
    # dense); the target keeps its lm_head in high precision, as the reference recipe does (docs/BENCH.md).
    draft_quant_overrides: dict = field(default_factory=lambda: {"ignore": ["embed_tokens"]})
    # Row (q) "W4 + QAD target": regen + `distill target` on the W4 target (train/recipe.py), cached in out/cache;
    # the draft rows (c)-(e) then run against it.
    qad: bool = field(default=True, metadata={
        "help": "row (q) W4 + QAD target, and the draft rows against it (--no-qad: against the W4 target)"})
    qad_steps: int = field(default=60, metadata={"help": "QAD steps for row (q) when --qad-target is not given"})
    qad_prompts: int = field(default=64, metadata={"help": "regen prompts for row (q)'s training text"})
    qad_new_tokens: int = field(default=64, metadata={"help": "tokens the teacher writes per regen prompt"})
    qad_eval_samples: int = 8  # held-out sequences of row (q)'s KL at the start and the end (QADConfig.eval_samples)
    # Rows (f)-(h), the block drafter (run_bench's block_draft): k per step. A block drafter pays one forward per
    # step whatever k (up to block_size - 1), so k is bounded by its acceptance and by the verify forward, which
    # grows with k on a CPU. 3: the best predicted MAL / (drafter forward + verify) over k = 1..4 for tiny-block-draft
    # against the demo's W4 target (benchmarks/block_acceptance.py; docs/BLOCK_DRAFT.md).
    block_draft_len: int = field(default=3, metadata={"help": "rows (f)-(h): block drafter tokens per step (k)"})
    # GPTQ W4 of the block drafter when --quantized-block-draft is not given: calibrated on the features of the
    # target its rows run against (quant/block_draft_gptq.py)
    block_draft_quant: dict = field(default_factory=lambda: {"method": "gptq", "bits": 4, "group_size": 128,
                                                             "calib_samples": 16, "seq_len": 256})
    # Rows (s), (u), (p): the suffix drafter, the hybrid (suffix, else the W4 block drafter) and the W4 block
    # drafter with a pruned head; their flags are the drafter kinds' own (--suffix-*, --hybrid-*: every kind's
    # settings, keyed by kind name, spec_decode/drafters). Rows (s) and (u) run without the response cache whatever
    # --suffix-cache-tokens says; a non-zero value adds row (r), the suffix drafter with the cache, a replay of the
    # bench's own repeated prompts (bench/ablation.py). flat: dests and results.json keys as generate's ("suffix")
    drafters: DrafterOptions = field(default_factory=DrafterOptions, metadata={"flat": True})
    # 0.5: about the 2nd leaderboard entry's 131,101 of 248,320 ids (../shared/PEERS.md); benchmarks/prune_head.py at dfedb37
    # sweeps it
    pruned_head_fraction: float = field(default=0.5, metadata={
        "help": "row (p): the share of the vocabulary the block drafter's head keeps (the most frequent ids on the "
                "calibration text)"})
    # Which rows run: their ids (e.g. a b q d e g s n); empty: every row the inputs allow. Row (a), the baseline
    # every speedup is over, always runs; so does the row of each target a kept row drafts against (b or q), whose
    # tokens the row must reproduce. The demo's default preset keeps one row per story (demo.PRESETS).
    rows: list[str] = field(default_factory=list, metadata={
        "help": "run only these rows (ids, e.g. a b q d e s); row (a) and the target-only row each kept draft row "
                "checks its tokens against always run"})
    # the block rows again with k = block_size - 1 on the content prompts (untimed): acceptance at every block position
    whole_block_pass: bool = True
    cost_reps: int = field(default=15, metadata={
        "help": "repetitions per forward timing (c, verify ratio, drafter latency curve); the median is kept"})
    # contexts (fractions of the model context) at which the drafter's one-token forward is timed for the plot
    curve_fractions: tuple[float, ...] = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4)

    def validate(self) -> "BenchConfig":
        for name in ("max_new_tokens", "runs", "prompts_per_length", "prompts_per_set", "content_max_tokens",
                     "cost_reps", "qad_steps", "qad_prompts", "qad_new_tokens", "qad_eval_samples",
                     "block_draft_len"):
            if getattr(self, name) < 1:
                raise SpecquantError(f"{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.hf_runs is not None and self.hf_runs < 1:
            raise SpecquantError(f"hf-runs {self.hf_runs} must be at least 1 (or None: as --runs)")
        if self.warmup < 0:
            raise SpecquantError(f"warmup {self.warmup} must be 0 or more")
        self.sampling.validate()
        self.spec.validate()
        self.drafters.validate()
        if not 0.0 < self.pruned_head_fraction <= 1.0:
            raise SpecquantError(f"pruned-head-fraction {self.pruned_head_fraction} must lie in (0, 1]; e.g. 0.5")
        if self.spec.draft_window is None:
            raise SpecquantError("row (e) needs a drafter window; pass --draft-window W")
        self.runtime.validate()
        if self.runtime.dtype not in DTYPES:
            raise SpecquantError(f"dtype {self.runtime.dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        if not self.lengths or any(not isinstance(v, int) or v < 1 for v in self.lengths.values()):
            raise SpecquantError(f"lengths {self.lengths} must map category names to positive token counts")
        clash = set(self.lengths) & set(self.content_sets)
        if clash:
            raise SpecquantError(f"categories {sorted(clash)} are both length categories and content sets")
        clash = (set(self.lengths) | set(self.content_sets)) & set(self.filler_sets)
        if clash:
            raise SpecquantError(f"categories {sorted(clash)} are filler sets and length categories or content sets; "
                                 "name each in one place")
        for name in ("target_method", "draft_method"):
            if getattr(self, name) not in METHODS:
                raise SpecquantError(f"{name} {getattr(self, name)!r} is not a quantization method; use one of "
                                     f"{', '.join(METHODS)}")
        return self

    def spec_for(self, window: bool) -> SpecConfig:
        """The SpecConfig of a speculative row: with the drafter window (row e) or full attention."""
        return dataclasses.replace(self.spec, draft_window=self.spec.draft_window if window else None)

    def block_spec_for(self, window: bool, draft_len: int | None = None) -> SpecConfig:
        """The SpecConfig of a block row: k = block_draft_len (or draft_len), the window as spec_for."""
        return dataclasses.replace(self.spec_for(window), draft_len=draft_len or self.block_draft_len,
                                   adaptive=False)

    def qad_recipe(self):
        """The regen + QAD sizes for row (q) (train/recipe.py); held-out evaluation at the start and the end."""
        from specquant.train.config import QADConfig, RegenConfig, TrainConfig
        from specquant.train.recipe import QADRecipe

        # one checkpoint, at the last step (the trainer always writes that one): each holds the latent weights and
        # both Adam moments (145 MB for the bundled target), and an interrupted run of this size loses less by
        # training again than a mid-run checkpoint costs every run
        # warm-up: TrainConfig's 10 steps, or a quarter of a shorter run (the demo's default QAD: 20 steps would
        # spend half of them warming up)
        warmup = min(TrainConfig().warmup, self.qad_steps // 4)
        return QADRecipe(regen=RegenConfig(limit=self.qad_prompts, max_new_tokens=self.qad_new_tokens),
                         train=TrainConfig(steps=self.qad_steps, warmup=warmup, eval_every=0,
                                           save_every=self.qad_steps),
                         qad=QADConfig(eval_samples=self.qad_eval_samples))

    def quant_overrides_for(self, role: str) -> dict:
        """QuantConfig overrides for producing the W4 'target' or 'draft'."""
        return {**self.quant_overrides, **(self.draft_quant_overrides if role == "draft" else {})}

    def to_json(self) -> dict:
        # drafters flat, as its flags: results.json's "suffix", "hybrid", .. (one per kind with settings), in place
        return {key: value for name, field_value in dataclasses.asdict(self).items()
                for key, value in (field_value.items() if name == "drafters" else ((name, field_value),))}
