"""`specquant`: an lm-evaluation-harness model backend on specquant's engine.

    lm_eval --model specquant --model_args target=DIR,draft=DIR,dtype=float32 --device cpu --tasks ifeval

Registered with `@register_model` and declared as an `lm_eval.models` entry point (pyproject.toml), lm-eval's plugin
mechanism; `specquant.gate.plugin` bridges lm-eval releases that predate entry-point discovery.
Generation runs through the engine: target-only, or speculative when a draft is given (greedy speculative decoding is
lossless, so the scores equal the target's own: tests/test_gate_backend.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.gate.config import GATE_RUNTIME, BackendConfig
from specquant.gate.engine import EvalEngine
from specquant.spec_decode.runtime import RuntimeConfig

log = logging.getLogger(__name__)
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default when a task sets none


def backend_config(model_args: dict) -> BackendConfig:
    """BackendConfig from lm-eval's flat model_args: the gates' runtime settings (GATE_RUNTIME: dtype=, device=,
    ...) go into its RuntimeConfig."""
    runtime = {k: model_args.pop(k) for k in list(model_args) if k in GATE_RUNTIME}
    known = [f.name for f in dataclasses.fields(BackendConfig) if f.name != "runtime"] + list(GATE_RUNTIME)
    return BackendConfig(**_parse(BackendConfig, model_args, known),
                         runtime=RuntimeConfig(**_parse(RuntimeConfig, runtime, known)))


def _parse(cls, raw: dict, known: list[str]) -> dict:
    """lm-eval passes model_args as strings (or already-typed values): coerce them to the dataclass's types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - (set(fields) & set(known)))
    if unknown:
        raise SpecquantError(f"unknown specquant model_args {', '.join(unknown)}; use: {', '.join(known)}")
    out = {}
    for name, value in raw.items():
        default = fields[name].default
        if isinstance(value, str) and value.lower() in ("none", ""):
            value = None
        elif isinstance(default, int) or name in ("max_length", "max_gen_toks_cap"):
            try:
                value = int(value)
            except (TypeError, ValueError):
                raise SpecquantError(f"model_args {name}={value!r} must be an integer") from None
        out[name] = value
    return out


@register_model("specquant")
class SpecquantLM(TemplateLM):
    """lm-eval's three request types on a specquant target, with its draft when given."""

    def __init__(self, batch_size=1, max_batch_size=None, **model_args):
        super().__init__()
        device = model_args.pop("device", None)
        if "pretrained" in model_args:  # lm-eval's usual name for the model path (its logs are filed under it)
            model_args.setdefault("target", model_args.pop("pretrained"))
        cfg = backend_config(model_args)
        if device is not None:  # lm-eval's --device (its CLI default is cuda:0): fall back to cpu without CUDA
            cfg.runtime.device = str(device)
        if cfg.runtime.device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("device %s requested but CUDA is not available; using cpu", cfg.runtime.device)
            cfg.runtime.device = "cpu"
        self.cfg = cfg
        self.engine = EvalEngine(cfg.target, cfg.draft, cfg.runtime, cfg.draft_len)
        self.tokenizer = self.engine.tokenizer
        self._device = self.engine.device
        self._max_length = cfg.max_length or self.engine.max_length
        if self._max_length > self.engine.max_length:
            raise SpecquantError(f"max_length {self._max_length} exceeds the target's context of "
                                 f"{self.engine.max_length} tokens; lower it or omit it")
        self.truncated = 0  # requests whose prompt or generation had to be cut to fit the context

    # ---- tokenizer facts lm-eval asks for
    @property
    def eot_token_id(self) -> int:
        return self.engine.eos_ids[0]

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise SpecquantError(
                f"the tokenizer of {self.cfg.target} has no chat template (no chat_template in its "
                "tokenizer_config.json or chat_template.jinja); run without --apply_chat_template"
            )
        if isinstance(template, dict):
            name = chat_template if isinstance(chat_template, str) else "default"
            if name not in template:
                raise SpecquantError(f"chat template {name!r} not found; the tokenizer has {', '.join(template)}")
            return template[name]
        return template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        self.chat_template(True)  # the one-line error when the tokenizer has none
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ---- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context_ids, continuation_ids) -> (sum log p, is greedy)."""
        out = []
        for key, context_ids, continuation_ids in tqdm(requests, disable=disable_tqdm, desc="loglikelihood"):
            # the last max_length tokens of context+continuation, minus the final one, predict the continuation
            window = (context_ids + continuation_ids)[-(self.max_length + 1):][:-1]
            n = len(continuation_ids)
            logp = self.engine.logprobs(window)[-n:]  # [n, vocab]
            target = torch.tensor(continuation_ids, device=logp.device)
            score = float(logp.gather(-1, target[:, None]).sum())
            greedy = bool((logp.argmax(-1) == target).all())
            out.append((score, greedy))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, (score, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents in disjoint max_length windows (as lm-eval's HF backend does)."""
        out = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="loglikelihood_rolling"):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            total = sum(s for s, _ in scores)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    # ---- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm, desc="generate_until"):
            text = self._generate_one(context, dict(gen_kwargs))
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out

    def _generate_one(self, context: str, gen_kwargs: dict) -> str:
        kw = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=DEFAULT_MAX_GEN_TOKS)
        until = handle_stop_sequences(kw.pop("until", None), eos=self.tok_decode([self.eot_token_id]) or None)
        until = [s for s in until if s]
        sampling = SamplingConfig(
            temperature=float(kw.get("temperature") or 0.0) if kw.get("do_sample") else 0.0,
            top_p=float(kw.get("top_p") or 1.0), top_k=int(kw.get("top_k") or 0),
        ).validate()
        max_new = int(kw["max_gen_toks"])
        if self.cfg.max_gen_toks_cap:
            max_new = min(max_new, self.cfg.max_gen_toks_cap)
        ids, max_new = self._fit_context(self.tok_encode(context), max_new)
        new: list[int] = []
        chunk = self.cfg.first_chunk
        eos = set(self.engine.eos_ids)
        while len(new) < max_new:
            # a sampled run keeps one generator seed per chunk; greedy runs are chunk-invariant up to ties
            step = min(chunk, max_new - len(new))
            tokens, _ = self.engine.generate(ids + new, step, sampling)
            new += tokens
            text = self.tok_decode(new)
            if (tokens and tokens[-1] in eos) or any(s in text for s in until):
                break
            chunk *= 2
        text = self.tok_decode(new)
        for s in until:  # lm-eval's convention: cut at the first stop sequence, which is not returned
            text = text.split(s)[0]
        return text

    def _fit_context(self, ids: list[int], max_new: int) -> tuple[list[int], int]:
        """Keep prompt + generation within the context: generation keeps at least half of it (or what it asked
        for), the prompt is cut from the left (as lm-eval's HF backend does)."""
        if not ids:
            ids = [self.prefix_token_id]
        room = self.max_length
        if len(ids) + max_new <= room:
            return ids, max_new
        self.truncated += 1
        keep_gen = min(max_new, room // 2)
        ids = ids[-(room - keep_gen):] if len(ids) > room - keep_gen else ids
        return ids, min(max_new, room - len(ids))
