"""SpecEngine: a target and a drafter held across requests; `generate` runs one request (batch size 1).

The loop itself is spec_decode/loop.py; this file validates a request, sizes the caches, times prefill and
decode around the loop (never inside it), stops at EOS and keeps engine-wide metrics.
"""

from __future__ import annotations

import time

import torch

from specquant.decode.compiled import Stepper
from specquant.decode.graphs import GraphStepper
from specquant.decode.generate import GenerationResult, check_context, request_stats
from specquant.util.device import sync
from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.model.decoder import Transformer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafter import Drafter, check_vocab
from specquant.spec_decode.lm_drafter import LMDrafter
from specquant.spec_decode.loop import decode_steps, prefill
from specquant.spec_decode.metrics import SpecMetrics
from specquant.spec_decode.timing import timed


class SpecEngine:
    """draft: a draft Transformer (wrapped in an LMDrafter) or any Drafter. profile: add per-component times to
    each request's stats (syncs the device around every forward; see timing.py)."""

    def __init__(self, target: Transformer, draft: Transformer | Drafter, config: SpecConfig | None = None,
                 target_tokenizer=None, draft_tokenizer=None, compile: bool = False, profile: bool = False,
                 graphs: bool = False, aot: str = "off"):
        self.config = (config or SpecConfig()).validate()
        if isinstance(draft, Transformer):
            check_vocab(target.config.vocab_size, draft.config.vocab_size, target_tokenizer, draft_tokenizer)
            draft = LMDrafter(draft, self.config, compile, graphs, aot)
        bad = [i for i in draft.target_layers if not 0 <= i < target.config.num_hidden_layers]
        if bad:
            raise SpecquantError(f"drafter reads target layers {bad}; the target has layers 0.."
                                 f"{target.config.num_hidden_layers - 1}")
        self.target, self.drafter = target, draft
        # graphs: the target's verify (and prefill, when short) steps replayed as CUDA graphs over a static cache
        # (decode/graphs.py; on CPU an eager stand-in over the same buffers); compile then covers the verify shape
        verify = (self.config.longest_draft + 1,)
        if graphs and aot != "off":
            raise SpecquantError("CUDA-graph steps and AOT packages do not combine; use one")
        # aot: a package of the full-length verify step (decode.aot); it returns logits only, so not for a drafter
        # that reads the target's hidden states
        self.target_step = (GraphStepper(target, compile, compile_shapes=verify) if graphs
                            else Stepper(target, compile, compile_shapes=verify,
                                         aot="off" if draft.target_layers else aot, aot_shapes=((verify[0], False),)))
        self.profile = profile
        self.metrics = SpecMetrics()  # accumulated over requests

    def _check(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> int:
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
            raise SpecquantError(f"speculative decoding takes one prompt (batch 1); got shape {list(prompt_ids.shape)}")
        plen = prompt_ids.shape[1]
        need = check_context(self.target, plen, max_new_tokens) + self.config.longest_draft + 1
        if isinstance(self.drafter, LMDrafter) and not self.config.draft_window \
                and self.drafter.model.config.sliding_window is None:
            check_context(self.drafter.model, plen, max_new_tokens, role="draft")
        return need

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig | None = None,
                 stop_on_eos: bool = True) -> GenerationResult:
        """prompt_ids [1, prompt_len] -> new tokens, timing stats and this request's spec metrics."""
        sampling = (sampling or SamplingConfig()).validate()
        need = self._check(prompt_ids, max_new_tokens)
        device = prompt_ids.device
        target, drafter, times = self.target_step, self.drafter, None
        if self.profile:
            target, drafter, times = timed(target, drafter, device)
        self.target_step.setup(1, need)
        drafter.setup(1, need)
        gen = torch.Generator(device=device).manual_seed(sampling.seed)
        eos = set(self.target.config.eos_ids) if stop_on_eos else set()
        m = SpecMetrics()
        plen = prompt_ids.shape[1]
        seq = torch.empty(1, plen + max_new_tokens + self.config.longest_draft + 1, dtype=torch.long, device=device)
        seq[:, :plen] = prompt_ids

        sync(device)
        t0 = time.perf_counter()
        new = [prefill(target, drafter, prompt_ids, sampling, gen)]  # the draft's prefill counts to TTFT
        seq[0, plen] = new[0]
        sync(device)
        t1 = time.perf_counter()
        verify_steps = 0
        if new[0] not in eos:
            for step in decode_steps(target, drafter, seq, plen + 1, max_new_tokens - 1, self.config, sampling, gen,
                                     m):
                verify_steps += 1
                new += _until_eos(step, eos)
                if new[-1] in eos:
                    break
        sync(device)
        t2 = time.perf_counter()
        self.metrics.merge(m)
        stats = {**request_stats(len(new), t1 - t0, t2 - t1), "target_forwards": 1 + verify_steps, **m.to_dict()}
        if times is not None:
            stats.update(times.to_dict())
        return GenerationResult([new], stats, spec=m)


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
