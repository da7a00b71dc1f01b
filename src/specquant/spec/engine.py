"""Speculative decoding with an independent draft model sharing the target's tokenizer (batch size 1).

One round: the draft catches up on the tokens it has not seen (the last emitted token, and the last draft token
when all were accepted), proposes k tokens one by one, the target scores [last token, x_1..x_k] in one forward,
`spec.rejection` keeps the accepted prefix and adds a recovered or bonus token, and both caches roll back by
position (O(1), see model.decoder). Terms (accepted / recovered / bonus) are defined in spec/rejection.py.
"""

from __future__ import annotations

import time

import torch

from specquant.decode.compiled import Stepper
from specquant.decode.generate import GenerationResult, check_context, sync
from specquant.decode.sampling import SamplingConfig, logits_to_probs, next_token, sample
from specquant.errors import SpecquantError
from specquant.model.decoder import Transformer
from specquant.spec.config import SpecConfig
from specquant.spec.metrics import SpecMetrics
from specquant.spec.rejection import greedy_verify, rejection_sample


def check_vocab(target: Transformer, draft: Transformer, target_tokenizer=None, draft_tokenizer=None):
    """Draft and target must share one vocabulary: same size and the same text for every id."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise SpecquantError(
            f"draft vocabulary has {dv} entries, target has {tv}; the draft must share the target's tokenizer"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if t_vocab != d_vocab:
            diff = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])
            tok, idx = diff[0]
            raise SpecquantError(
                f"draft and target tokenizers differ (e.g. token {tok!r} / id {idx}); use a draft trained with the "
                "target's tokenizer"
            )


class SpecEngine:
    """Holds a target/draft pair and the engine-wide metrics; `generate` runs one request."""

    def __init__(self, target: Transformer, draft: Transformer, config: SpecConfig | None = None,
                 target_tokenizer=None, draft_tokenizer=None, compile: bool = False):
        self.config = (config or SpecConfig()).validate()
        check_vocab(target, draft, target_tokenizer, draft_tokenizer)
        self.target, self.draft = target, draft
        self.target_step, self.draft_step = Stepper(target, compile), Stepper(draft, compile)
        self.metrics = SpecMetrics()  # accumulated over requests

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig | None = None,
                 stop_on_eos: bool = True) -> GenerationResult:
        """prompt_ids [1, prompt_len] -> new tokens, timing stats and this request's spec metrics."""
        cfg, sampling = self.config, (sampling or SamplingConfig()).validate()
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
            raise SpecquantError(f"speculative decoding takes one prompt (batch 1); got shape {list(prompt_ids.shape)}")
        target, draft, device = self.target, self.draft, prompt_ids.device
        plen = prompt_ids.shape[1]
        longest = cfg.longest_draft
        need = check_context(target, plen, max_new_tokens) + longest + 1
        window = cfg.draft_window
        if window is None and draft.config.sliding_window is None:
            check_context(draft, plen, max_new_tokens, role="draft")
        self.target_step.setup(1, need)
        # the ring cache must survive a rollback of a whole draft (longest + 1 positions)
        self.draft_step.setup(1, need, max_block=max(64, longest + 2), window=window if window else -1)
        gen = torch.Generator(device=device).manual_seed(sampling.seed)
        eos = set(target.config.eos_ids) if stop_on_eos else set()
        m = SpecMetrics()
        tokens = prompt_ids[0].tolist()
        # windowed draft prefilled with its last W tokens only: shift its positions (RoPE is relative)
        off = max(0, plen - window) if window and cfg.draft_prefill == "window" else 0
        draft_valid = off  # draft cache holds tokens[off:draft_valid]

        def run_draft(ids: list[int], start: int) -> torch.Tensor:
            t = time.perf_counter()
            out = self.draft_step(torch.tensor([ids], device=device), start - off, last_only=True)[0, -1]
            sync(device)
            m.draft_s += time.perf_counter() - t
            m.draft_forwards += 1
            return out

        def run_target(ids: list[int], start: int, last_only: bool) -> torch.Tensor:
            t = time.perf_counter()
            out = self.target_step(torch.tensor([ids], device=device), start, last_only=last_only)[0]
            sync(device)
            m.target_s += time.perf_counter() - t
            m.target_forwards += 1
            return out

        sync(device)
        t0 = time.perf_counter()
        first = next_token(run_target(tokens, 0, True)[-1], sampling, gen)
        if plen - 1 > draft_valid:  # draft prefill (all but the last prompt token) belongs to time-to-first-token
            run_draft(tokens[draft_valid : plen - 1], draft_valid)
            draft_valid = plen - 1
        new = [int(first)]
        tokens.append(new[0])
        t1 = time.perf_counter()
        k_cur = cfg.draft_len
        stop_below = cfg.draft_confidence if cfg.adaptive else 0.0  # 0: never stop drafting early
        while len(new) < max_new_tokens and new[-1] not in eos:
            n = len(tokens)  # tokens[n-1] is in neither cache yet
            k = min(k_cur, max_new_tokens - len(new) - 1)
            drafted: list[int] = []
            draft_probs = []
            if k > 0:
                logits = run_draft(tokens[draft_valid:n], draft_valid)  # catch up
                draft_valid = n
                for i in range(k):
                    if sampling.greedy:
                        x = int(logits.argmax())
                        if stop_below and i > 0 and torch.softmax(logits.float(), -1)[x] < stop_below:
                            break
                    else:
                        probs = logits_to_probs(logits, sampling)
                        x = int(sample(probs, gen))
                        if stop_below and i > 0 and probs.max() < stop_below:
                            break
                        draft_probs.append(probs)
                    drafted.append(x)
                    if i < k - 1:
                        logits = run_draft([x], n + i)
                        draft_valid = n + i + 1
            kd = len(drafted)
            target_logits = run_target([tokens[n - 1]] + drafted, n - 1, last_only=False)  # [kd+1, vocab]
            if kd == 0:
                accepted, nxt = 0, int(next_token(target_logits[-1], sampling, gen))
            elif sampling.greedy:
                accepted, nxt = greedy_verify(torch.tensor(drafted, device=device), target_logits)
            else:
                target_probs = logits_to_probs(target_logits, sampling)
                uniforms = torch.rand(kd, generator=gen, device=device)
                noise = torch.empty(target_probs.shape[-1], device=device).exponential_(generator=gen)
                accepted, nxt = rejection_sample(torch.tensor(drafted, device=device), torch.stack(draft_probs),
                                                 target_probs, uniforms, noise)
            m.record_step(kd, accepted)
            emitted = drafted[:accepted] + [nxt]
            draft_valid = min(draft_valid, n + accepted)  # roll back: positions past n+accepted-1 are stale
            for tok in emitted:
                new.append(tok)
                tokens.append(tok)
                if tok in eos or len(new) >= max_new_tokens:
                    break
            if cfg.adaptive and kd > 0:
                k_cur = min(cfg.max_draft_len, k_cur + 2) if accepted == kd else max(1, k_cur - 1)
        sync(device)
        t2 = time.perf_counter()
        self.metrics.merge(m)
        nt = len(new)
        stats = {
            "new_tokens": nt,
            "prefill_s": t1 - t0,
            "decode_s": t2 - t1,
            "tokens_per_s": (nt - 1) / (t2 - t1) if nt > 1 and t2 > t1 else 0.0,
            **{k: v for k, v in m.to_dict().items() if k != "per_position_rate"},
        }
        return GenerationResult([new], stats)
