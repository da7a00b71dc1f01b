"""Timing shared by `specquant bench` and benchmarks/*.py beside engines/timing.py (runners, Sample, the one
interleaved loop): transformers' assisted generation as a runner, forward probes (named by ForwardKey in bench),
summaries (Timing), the environment."""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specquant.decode.sampling import SamplingConfig
from specquant.engines.timing import Sample, sample_from
from specquant.runtime import openmp_wait
from specquant.util.device import sync


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
           "threads": torch.get_num_threads(), "openmp_wait": openmp_wait(), "device": str(device),
           "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


class _FirstTokenClock:
    """transformers streamer that stamps the first put() after the prompt (the first new tokens)."""

    def __init__(self):
        self.puts, self.first_time, self.first_count = 0, None, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first_time, self.first_count = time.perf_counter(), int(value.numel())

    def end(self):
        pass


def hf_assisted(hf_target, hf_draft, max_new_tokens: int, draft_len: int, sampling: SamplingConfig):
    """A runner for transformers' generate(assistant_model=...): fixed k (constant schedule, no confidence stop),
    EOS disabled on both models so exactly max_new_tokens come out, as in our rows.

    transformers has no separate prefill: its first target forward takes the prompt and the first k draft tokens,
    so ttft_s is the time to that first verified block (the streamer's first put after the prompt).
    """
    for m in (hf_target, hf_draft):
        m.generation_config.eos_token_id = None  # None in generate() kwargs would fall back to this default
    hf_draft.generation_config.num_assistant_tokens = draft_len
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    hf_draft.generation_config.assistant_confidence_threshold = 0.0
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, pad_token_id=0)
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)  # 0 = off in both

    def run(prompt_ids: torch.Tensor) -> Sample:
        torch.manual_seed(sampling.seed)
        clock = _FirstTokenClock()
        sync(prompt_ids.device)
        t0 = time.perf_counter()
        out = hf_target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), assistant_model=hf_draft,
                                 streamer=clock, **kwargs)
        sync(prompt_ids.device)
        t1 = time.perf_counter()
        new = out[0, prompt_ids.shape[1]:].tolist()
        ttft = (clock.first_time or t1) - t0
        # its first block carried several tokens: TPOT over the rest
        return sample_from(t1 - t0, ttft, len(new), new, decode_tokens=len(new) - max(clock.first_count, 1) + 1)

    return run


class BlockForward:
    """A block drafter behind the model interface `forward_times` probes: the prefill call appends `context`
    positions of (random) target features to its context cache; every timed call is one drafter forward proposing
    `k` tokens at that context (`propose`), which is a block drafter's whole per-step cost."""

    def __init__(self, drafter, k: int):
        self.drafter, self.k = drafter, k
        self.config = drafter.config
        self.model = drafter  # forward_times reads model.embed_tokens.weight.device (the target's embeddings)
        self._gen = torch.Generator().manual_seed(0)

    def setup_cache(self, batch: int, length: int, max_block: int = 64, window: int | None = -1):
        self.drafter.setup_cache(length, window=window)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, start: int, last_only: bool = False):
        d = self.drafter
        if start == 0:  # the prefill: context features for every position of `ids`
            width = len(d.config.target_layer_ids) * d.config.hidden_size
            feats = torch.randn(1, ids.shape[1], width, generator=self._gen).to(d.norm.weight)
            d.append_context(feats)
            return None
        d.rollback(start)
        return d.propose(ids[0, -1], self.k)

    def clear_cache(self):
        self.drafter.clear_cache()


class BlockAccept(BlockForward):
    """A block drafter's `accept` behind the same interface: every timed call appends n_tokens positions of target
    features after `context` (the fc and K/V projections of the accepted rows; spec_decode/drafters/block.py), which a
    block drafter pays every step on top of its forward.

    It works on its own copy of the drafter (the attached target's modules shared, not copied): forward_times sets
    up one context cache per probed object, and a BlockForward of the same drafter needs its own."""

    def __init__(self, drafter):
        shared = {id(m): m for m in drafter._target_modules or ()}
        super().__init__(copy.deepcopy(drafter, shared), 0)
        self._rows: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, start: int, last_only: bool = False):
        if start == 0:
            return super().__call__(ids, start, last_only)
        d, t = self.drafter, ids.shape[1]
        if t not in self._rows:  # made on the first call (an untimed round), reused after
            width = len(d.config.target_layer_ids) * d.config.hidden_size
            self._rows[t] = torch.randn(1, t, width, generator=self._gen).to(d.norm.weight)
        d.rollback(start)
        d.append_context(self._rows[t])


class MTPForward:
    """An MTP layer (spec_decode/drafters/mtp.py) behind the model interface `forward_times` probes: the prefill
    call fills its KV cache with `context` entries of (random) target hidden states; every timed call is one MTP
    forward of the new entries at that context plus its head's logits, which the MTP drafter runs once per drafted
    token (one entry: a chained draft)."""

    def __init__(self, mtp_model, target):
        from specquant.spec_decode.drafters.mtp import draft_head

        self.mtp, self.target = mtp_model, target
        self.head = draft_head(target, getattr(mtp_model, "head_precision", "shared"))
        self.config = target.config
        self.model = target.model  # forward_times reads model.embed_tokens.weight.device (the target's embeddings)
        self._gen = torch.Generator().manual_seed(0)
        self._hidden: dict[int, torch.Tensor] = {}

    def setup_cache(self, batch: int, length: int, max_block: int = 64, window: int | None = -1):
        self.mtp.setup_cache(batch, length)

    def _h(self, t: int) -> torch.Tensor:
        if t not in self._hidden:  # made on the first call (an untimed round), reused after
            w = self.target.model.embed_tokens.weight
            self._hidden[t] = torch.randn(1, t, self.config.hidden_size, generator=self._gen).to(w)
        return self._hidden[t]

    def __call__(self, ids: torch.Tensor, start: int, last_only: bool = False):
        embeds = self.target.model.embed_tokens(ids)
        if start == 0:
            self.mtp(self._h(ids.shape[1]), embeds, 0)
            return None
        self.mtp.rollback(start)
        return self.head(self.mtp(self._h(ids.shape[1]), embeds, start)[:, -1])

    def clear_cache(self):
        self.mtp.clear_cache()


# Probe.burst of a model's step as a loop that runs only that model sees it (a target decoding alone): timed after
# two untimed calls of the same model. Timed between other probes instead, the fp32 target's step read 1.4x its
# measured TPOT at 2 threads (docs/BENCH.md).
WARM_BURST = 3


@dataclass(frozen=True)
class ForwardKey:
    """Names one forward that `specquant bench` times (a key of forward_times' probes and of its costs): the model
    by role and precision, the call, and how it is timed. `name` is its key in results.json.

    role: "target" or a drafter kind's name (spec_decode/drafters/); precision: "hp", "w4" or "qad";
    call: "step" (one token; a block drafter's propose), "verify" (draft_len + 1 tokens), "verify_block"
    (block_draft_len + 1 tokens) or "accept" (a block drafter projecting `rows` rows of target features);
    window: with the draft's sliding window; alone: timed after its own step (WARM_BURST), as a loop that runs only
    this model sees it."""

    role: str
    precision: str
    call: str = "step"
    rows: int = 0
    window: bool = False
    alone: bool = False

    @property
    def name(self) -> str:
        rows = self.rows if self.call == "accept" else ""
        return (f"{self.role}_{self.precision}_{self.call}{rows}_s" + ("_window" if self.window else "")
                + ("_alone" if self.alone else ""))


@dataclass(frozen=True)
class Probe:
    """One forward to time: `model` taking n_tokens new tokens after the context; window = a sliding window for
    the draft (None = the checkpoint's own attention, as SpecEngine sets it up); burst = calls in a row per
    repetition, the last one timed (1: the forward right after other probes' forwards, as in a loop that alternates
    models; more: right after its own, as in a loop that runs this model alone)."""

    model: torch.nn.Module
    n_tokens: int = 1
    window: int | None = None
    burst: int = 1


@torch.no_grad()
def forward_times(probes: dict, context: int, reps: int, on_rep: Callable[[], None] | None = None) -> dict:
    """Median seconds of each probe's cached forward after `context` earlier tokens: {key: Probe} -> {key: seconds},
    any hashable key (bench uses ForwardKey). on_rep: called after each of the 2 + reps repetitions (progress).

    Interleaved: every repetition times every probe once, so background load hits them alike and ratios between
    them (c, verify ratio, window vs full) are taken side by side. Each (model, window) gets its own prefilled
    cache (a model probed with two windows is timed through a copy); every timed call writes the same positions
    again, which the cache contract allows (model.decoder), so each repetition sees exactly `context` tokens. A
    recurrent layer (a hybrid's Gated DeltaNet) gets there by rolling its state back to `context` first, to its
    anchor: a state copy, not the state_after of an accepted prefix that a real verify's rollback costs.
    """
    instances: dict[tuple[int, int | None], torch.nn.Module] = {}
    for probe in probes.values():
        key = (id(probe.model), probe.window)
        if key not in instances:
            taken = any(k[0] == id(probe.model) for k in instances)
            instances[key] = copy.deepcopy(probe.model) if taken else probe.model
    gen = torch.Generator().manual_seed(0)
    for (model_id, window), model in instances.items():
        longest = max(p.n_tokens for p in probes.values() if (id(p.model), p.window) == (model_id, window))
        model.setup_cache(1, context + longest, max_block=max(64, longest + 2), window=window if window else -1)
        device = model.model.embed_tokens.weight.device
        model(torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device), 0, last_only=True)
    calls = {}
    for name, p in probes.items():
        model = instances[(id(p.model), p.window)]
        x = torch.randint(0, model.config.vocab_size, (1, p.n_tokens), generator=gen)
        calls[name] = (model, x.to(model.model.embed_tokens.weight.device))
    samples: dict = {name: [] for name in probes}
    for rep in range(2 + reps):  # two untimed rounds first
        for name, (model, x) in calls.items():
            for _ in range(probes[name].burst - 1):
                model(x, context, last_only=x.shape[1] == 1)
            sync(x.device)
            t0 = time.perf_counter()
            model(x, context, last_only=x.shape[1] == 1)  # verify forwards return every position's logits
            sync(x.device)
            if rep >= 2:
                samples[name].append(time.perf_counter() - t0)
        if on_rep is not None:
            on_rep()
    for model in instances.values():
        model.clear_cache()
    return {name: statistics.median(v) for name, v in samples.items()}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass(frozen=True)
class Timing:
    """A runner's times over a set of prompts (summarize)."""

    latency_s: float
    ttft_s: float
    tpot_s: float
    tokens_per_s: float


def summarize(per_prompt: dict[str, list[Sample]]) -> Timing:
    """{prompt id: samples} -> each time as the median over a prompt's runs, then the mean over prompts."""
    return Timing(**{f.name: sum(median([getattr(s, f.name) for s in ss]) for ss in per_prompt.values())
                     / len(per_prompt) for f in dataclasses.fields(Timing)})
