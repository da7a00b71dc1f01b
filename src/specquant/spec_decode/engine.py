"""SpecEngine: a target and a drafter held across requests; `stream` runs one request step by step, `generate`
collects it. `generate` (the function) is target-only decoding: the same engine with the none drafter.

The loop itself is spec_decode/loop.py; this file validates a request, sizes the caches, stops at EOS, times
prefill and decode around the loop (never inside it) and keeps engine-wide metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from specquant.decode.compiled import Stepper
from specquant.decode.graphs import GraphStepper
from specquant.decode.result import GenerationResult, check_context, request_stats
from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.model.decoder import Transformer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Drafter
from specquant.spec_decode.drafters import KINDS, kind_of_model
from specquant.spec_decode.loop import decode_steps, prefill as loop_prefill
from specquant.spec_decode.metrics import SpecMetrics, StepMetrics
from specquant.spec_decode.timing import StepTimes, timed
from specquant.util.device import sync


@dataclass(frozen=True)
class Step:
    """What `SpecEngine.stream` yields per step: the tokens it committed and its counters. The first step is the
    prefill's token (metrics.proposed 0)."""

    token_ids: list[list[int]]  # per batch row, cut after EOS; [] for a row that had already finished
    metrics: StepMetrics


class SpecEngine:
    """target: a Transformer, or a Stepper / GraphStepper over one (its compiled or packaged steps are then used
    as they are). draft: None (target only), a Drafter, or a loaded draft model of a drafter kind (a
    Transformer: the LM drafter; a BlockDraftModel: the block drafter; spec_decode/drafters/). profile: add
    per-component times to each request's stats (syncs the device around every forward; see timing.py)."""

    def __init__(self, target: Transformer | Stepper | GraphStepper, draft=None, config: SpecConfig | None = None,
                 target_tokenizer=None, draft_tokenizer=None, compile: bool = False, profile: bool = False,
                 graphs: bool = False, aot: str = "off"):
        self.config = (config or SpecConfig()).validate()
        given_step = None if isinstance(target, Transformer) else target
        if given_step is not None:
            target = given_step.model
        if graphs and aot != "off":
            raise SpecquantError("CUDA-graph steps and AOT packages do not combine; use one")
        if self.config.tree_nodes and aot == "cached":
            aot = "off"  # packages are used when there and suit the step; a tree's steps are eager (model/tree.py)
        drafter = self._drafter(draft, target, compile=compile, graphs=graphs, aot=aot,
                                target_tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
        bad = [i for i in drafter.target_layers if not 0 <= i < target.config.num_hidden_layers]
        if bad:
            raise SpecquantError(f"drafter reads target layers {bad}; the target has layers 0.."
                                 f"{target.config.num_hidden_layers - 1}")
        self.target, self.drafter = target, drafter
        limit = getattr(drafter, "max_draft_len", None)
        # the most draft tokens a step verifies; 0: no step has drafts (target only)
        self.longest = self.config.longest_draft if limit is None else min(self.config.longest_draft, limit)
        self.speculative = self.longest > 0
        if self.config.tree_nodes:
            _check_tree(drafter, target, given_step, compile, graphs, aot)
            self.longest = max(self.longest, self.config.tree_nodes)  # a tree writes every node into the caches
        # graphs: the target's verify (and prefill, when short) steps replayed as CUDA graphs over a static cache
        # (decode/graphs.py; on CPU an eager stand-in over the same buffers); compile then covers the verify shape.
        # aot: a package of the full-length verify step (decode.aot); it returns logits only, so not for a
        # drafter that reads the target's hidden states. Without drafts the step is the one-token decode step.
        verify = (self.longest + 1,)
        self.target_step = given_step or (
            GraphStepper(target, compile, compile_shapes=verify) if graphs
            else Stepper(target, compile, compile_shapes=verify, aot="off" if drafter.target_layers else aot,
                         aot_shapes=((verify[0], not self.speculative),)))
        self.profile = profile
        self.metrics = SpecMetrics()  # accumulated over requests

    def _drafter(self, draft, target: Transformer, **engine_options) -> Drafter:
        if draft is None:
            return KINDS["none"].build(None, target, self.config, **engine_options)
        if isinstance(draft, Drafter):  # the protocol's members, checked at run time
            return draft
        return kind_of_model(draft).build(draft, target, self.config, **engine_options)

    def _check(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> int:
        if prompt_ids.dim() != 2 or (self.speculative and prompt_ids.shape[0] != 1):
            raise SpecquantError(f"speculative decoding takes one prompt (batch 1); got shape {list(prompt_ids.shape)}")
        plen = prompt_ids.shape[1]
        need = check_context(self.target, plen, max_new_tokens)
        check_request = getattr(self.drafter, "check_request", None)
        if check_request is not None:
            check_request(plen, max_new_tokens)
        return need + self.longest + 1 if self.speculative else need

    def stream(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig | None = None,
               stop_on_eos: bool = True, times: StepTimes | None = None, prefill=None) -> Iterator[Step]:
        """prompt_ids [batch, prompt_len] (batch 1 with drafts) -> the request's steps, each with the tokens it
        committed; ends after max_new_tokens tokens or once every row has emitted EOS (kept; with stop_on_eos).
        The request is checked and the caches are set up before this returns; the forwards run as steps are
        asked for. times: with profile=True, where this request's per-component times are added. prefill: a
        stand-in for loop.prefill with its signature and result (serve's prefix cache)."""
        sampling = (sampling or SamplingConfig()).validate()
        need = self._check(prompt_ids, max_new_tokens)
        device = prompt_ids.device
        target, drafter = self.target_step, self.drafter
        if self.profile:
            target, drafter, _ = timed(target, drafter, device, times)
        batch, plen = prompt_ids.shape
        self.target_step.setup(batch, need)
        drafter.setup(batch, need)
        gen = torch.Generator(device=device).manual_seed(sampling.seed)
        eos = set(self.target.config.eos_ids) if stop_on_eos else set()
        seq = torch.empty(batch, plen + max_new_tokens + self.longest + 1, dtype=torch.long, device=device)
        seq[:, :plen] = prompt_ids
        return self._steps(target, drafter, prompt_ids, seq, max_new_tokens, sampling, gen, eos, prefill or
                           loop_prefill)

    def _steps(self, target, drafter, prompt_ids: torch.Tensor, seq: torch.Tensor, max_new_tokens: int,
               sampling: SamplingConfig, gen: torch.Generator, eos: set[int], prefill) -> Iterator[Step]:
        plen = prompt_ids.shape[1]
        first = prefill(target, drafter, prompt_ids, sampling, gen)  # the draft's prefill counts to TTFT
        seq[:, plen] = first
        done = [False] * seq.shape[0]
        yield Step(_until_eos(first[:, None].tolist(), eos, done), StepMetrics(0, 0))
        if all(done):
            return
        for tokens, metrics in decode_steps(target, drafter, seq, plen + 1, max_new_tokens - 1, self.config,
                                            sampling, gen):
            self.metrics.record_step(metrics.proposed, metrics.accepted)
            yield Step(_until_eos(tokens, eos, done), metrics)
            if all(done):
                return

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig | None = None,
                 stop_on_eos: bool = True) -> GenerationResult:
        """prompt_ids [batch, prompt_len] (batch 1 with drafts) -> new tokens, timing stats and (speculative)
        this request's spec metrics."""
        times = StepTimes() if self.profile else None
        steps = self.stream(prompt_ids, max_new_tokens, sampling, stop_on_eos, times)
        device = prompt_ids.device
        rows = [[] for _ in range(prompt_ids.shape[0])]
        spec, forwards = SpecMetrics(), 0
        sync(device)
        t0 = time.perf_counter()
        for step in steps:
            for row, new in zip(rows, step.token_ids):
                row += new
            spec.record_step(step.metrics.proposed, step.metrics.accepted)
            forwards += 1
            if forwards == 1:
                sync(device)
                t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        stats = {**request_stats(max(len(r) for r in rows), t1 - t0, t2 - t1), "target_forwards": forwards}
        if not self.speculative:
            return GenerationResult(rows, stats)
        stats.update(spec.to_dict())
        if times is not None:
            stats.update(times.to_dict())
        return GenerationResult(rows, stats, spec=spec)


def _check_tree(drafter: Drafter, target: Transformer, given_step, compile: bool, graphs: bool, aot: str):
    """Tree drafts need a drafter that drafts trees and an eager target on full caches (model/tree.py)."""
    if not hasattr(drafter, "propose_tree"):
        raise SpecquantError(f"the {type(drafter).__name__} drafts chains only; use --tree-nodes 0, or a suffix or "
                             "block drafter")
    given_eager = given_step is None or (type(given_step) is Stepper and not given_step.compile
                                         and given_step.aot == "off")
    if compile or graphs or aot != "off" or not given_eager:
        raise SpecquantError("tree verify runs eager steps; drop --compile / --graphs / --aot, or use --tree-nodes 0")
    if target.config.sliding_window:
        raise SpecquantError(f"tree verify needs full attention; this target has a sliding window of "
                             f"{target.config.sliding_window} (use --tree-nodes 0)")


def _until_eos(tokens: list[list[int]], eos: set[int], done: list[bool]) -> list[list[int]]:
    """Each row's tokens up to and including its first EOS; marks rows that reached one in done."""
    out = []
    for r, row in enumerate(tokens):
        if done[r]:
            out.append([])
            continue
        for i, t in enumerate(row):
            if t in eos:
                row, done[r] = row[: i + 1], True
                break
        out.append(row)
    return out


@torch.no_grad()
def generate(model: Transformer | Stepper, prompt_ids: torch.Tensor, max_new_tokens: int,
             sampling: SamplingConfig | None = None, stop_on_eos: bool = True) -> GenerationResult:
    """Target-only decoding: prompt_ids [batch, prompt_len] (rows share one length) -> new tokens and timing
    stats. The engine's loop with the none drafter: one prefill, then one one-token forward per token.

    Pass a `Stepper(model, compile=True)` or `Stepper(model, aot="cached")` instead of the model for a compiled
    decode step."""
    return SpecEngine(model).generate(prompt_ids, max_new_tokens, sampling, stop_on_eos)
