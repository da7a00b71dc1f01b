"""Validation at the HTTP boundary: an OpenAI request body -> a Request, or a RequestError naming the field.

Only what the engine can honour is accepted: n = 1, no logprobs / echo / penalties. Unknown fields are ignored (as
OpenAI-compatible servers do), so clients that send extras still work."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from specquant.decode.sampling import SamplingConfig
from specquant.serve.config import ServeConfig

MAX_SEED = 2**63 - 1
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROLES = ("system", "user", "assistant")
# field -> the value that means "not asked for"; anything else is refused rather than silently ignored
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
               "suffix": (None, ""), "tools": (None, []), "response_format": (None, {"type": "text"})}


class RequestError(Exception):
    """A bad request: HTTP status, the offending field (OpenAI's `param`) and a message naming value and fix."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension; the latency protocol leaves it off


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False, lo_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise RequestError(name, f"{name} {value!r} is not {kind}; pass {kind} in {'(' if lo_open else '['}{lo}, {hi}]")
    if not (lo < value <= hi if lo_open else lo <= value <= hi):
        raise RequestError(name, f"{name} {value} is outside {'(' if lo_open else '['}{lo}, {hi}]")
    return value


def _stop(body: dict, config: ServeConfig) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > config.max_stop:
        raise RequestError("stop", f"stop has {len(stop)} strings; the limit is {config.max_stop}")
    long = [s for s in stop if len(s) > config.max_stop_chars]
    if long:
        raise RequestError("stop", f"stop string {long[0][:20]!r}... is longer than {config.max_stop_chars} characters")
    return stop


def prompt_ids_of(body: dict, tokenizer) -> list[int]:
    """/v1/completions' prompt: a string, token ids, or a list holding one of those (one prompt per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < len(tokenizer)]
        if bad:
            raise RequestError("prompt", f"prompt token id {bad[0]} is outside the vocabulary 0..{len(tokenizer) - 1}")
        return prompt
    raise RequestError("prompt", "prompt must be a string or a list of token ids (one prompt per request)")


def chat_ids_of(body: dict, tokenizer, template: str | None) -> list[int]:
    """/v1/chat/completions' messages through the chat template (template None: the server has none)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of {role, content} objects")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError("messages", f"messages[{i}] needs a role, one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError("messages", f"messages[{i}].content parts must all be text parts")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError("messages", f"messages[{i}].content must be a string")
        flat.append({"role": m["role"], "content": content})
    if template is None:
        raise RequestError("messages", "the served model's tokenizer has no chat template; restart the server with "
                                       "--chat-template FILE (or chatml), or use /v1/completions")
    text = tokenizer.apply_chat_template(flat, chat_template=template, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def parse_request(body, prompt_ids_fn, config: ServeConfig, context: int, chat: bool = False) -> Request:
    """body: the decoded JSON; prompt_ids_fn(body) -> the prompt's token ids; context: the target's positions."""
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise RequestError(name, f"{name} is not supported by this server; leave it out")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise RequestError("n", f"n {n!r} is not supported; this server returns one choice (n=1)")
    for name in ("stream", "ignore_eos"):
        if body.get(name) not in (None, True, False):
            raise RequestError(name, f"{name} must be true or false")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and options.get("include_usage") in (None, True, False)):
        raise RequestError("stream_options", "stream_options must be an object like {\"include_usage\": true}")
    temperature = _number(body, "temperature", 1.0, 0.0, config.max_temperature)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _number(body, "top_k", -1, -1, 1 << 30, integer=True)  # -1 or 0: off (vLLM's convention)
    seed = _number(body, "seed", None, 0, MAX_SEED, integer=True)
    stop = _stop(body, config)
    prompt_ids = prompt_ids_fn(body)
    if not prompt_ids:
        raise RequestError("messages" if chat else "prompt", "the prompt is empty; give at least one token")
    room = context - len(prompt_ids)
    if room < 1:
        raise RequestError("messages" if chat else "prompt", f"the prompt has {len(prompt_ids)} tokens; the "
                           f"model's context is {context}, which leaves no room for new tokens: shorten it")
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    name = next((k for k in names if body.get(k) is not None), names[-1])
    max_tokens = _number(body, name, min(config.default_max_tokens, room), 1, config.max_tokens_limit, integer=True)
    if max_tokens > room:
        raise RequestError(name, f"prompt of {len(prompt_ids)} tokens + {name} {max_tokens} exceeds the model's "
                                 f"context of {context} tokens; lower {name} to at most {room}")
    sampling = SamplingConfig(temperature=float(temperature), top_k=max(top_k, 0), top_p=float(top_p),
                              seed=secrets.randbelow(1 << 62) if seed is None else seed).validate()
    return Request(prompt_ids, max_tokens, sampling, stop, bool(body.get("stream")),
                   bool((options or {}).get("include_usage")), bool(body.get("ignore_eos")))
