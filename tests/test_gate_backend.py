"""The `specquant` lm-eval backend: speculative generation equals target-only (greedy is lossless), log-likelihoods
equal a plain forward's, rolling windows cover every token, the chat-template error, and shell registration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from specquant.errors import SpecquantError
from specquant.gate.backend import SpecquantLM
from specquant.gate.datasets import FIXTURES
from specquant.loader import load_model


@pytest.fixture(scope="module")
def target_lm():
    return SpecquantLM(target="tiny-target", device="cpu")


@pytest.fixture(scope="module")
def spec_lm():
    return SpecquantLM(target="tiny-target", draft="tiny-draft", draft_len="3", device="cpu")


def _req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def _prompts(n):
    rows = [json.loads(x) for x in (FIXTURES / "ifeval" / "train.jsonl").read_text().splitlines()]
    return [r["prompt"] for r in rows[:n]]


def test_speculative_generation_equals_target_only(target_lm, spec_lm):
    # long enough for several draft/verify rounds and two stop-check chunks (32, then the last 4)
    reqs = [_req("generate_until", (p, {"until": ["\n\n\n"], "max_gen_toks": 36, "do_sample": False}), i)
            for i, p in enumerate(_prompts(2))]
    plain = target_lm.generate_until(reqs, disable_tqdm=True)
    spec = spec_lm.generate_until(reqs, disable_tqdm=True)
    assert plain == spec
    assert all(len(target_lm.tok_encode(t)) > 8 for t in plain)  # real continuations, not empty strings
    assert spec_lm.engine.draft_steps > 0  # the draft really ran


def test_stop_sequences_and_generation_limit(target_lm):
    prompt = _prompts(1)[0]
    full = target_lm.generate_until([_req("generate_until", (prompt, {"until": [], "max_gen_toks": 24}))], True)[0]
    stop = full.strip()[:6][-3:]  # a string that occurs in the free continuation
    cut = target_lm.generate_until([_req("generate_until", (prompt, {"until": [stop], "max_gen_toks": 24}))], True)[0]
    assert cut == full.split(stop)[0]
    assert len(target_lm.tok_encode(full)) <= 24


def test_loglikelihood_equals_plain_forward(target_lm):
    model = load_model("tiny-target")
    context, continuation = "The meaning of the word", " is not known"
    (score, greedy), = target_lm.loglikelihood([_req("loglikelihood", (context, continuation))], disable_tqdm=True)
    ctx = target_lm.tok_encode(context)
    whole = target_lm.tok_encode(context + continuation)
    cont = whole[len(ctx):]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), -1)
    expected = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert score == pytest.approx(expected, abs=1e-4)
    assert greedy == all(int(logp[len(ctx) - 1 + i].argmax()) == t for i, t in enumerate(cont))


def test_loglikelihood_rolling_covers_every_token_with_windows(target_lm):
    text = " ".join(_prompts(6))
    n = len(target_lm.tok_encode(text))
    small = SpecquantLM(target="tiny-target", max_length="48", device="cpu")
    assert n > 3 * 48  # several windows
    (full,) = target_lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))], disable_tqdm=True)
    (windowed,) = small.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))], disable_tqdm=True)
    assert full < 0 and windowed < 0
    # less context per token can only make it slightly worse on average; same order of magnitude
    assert 0.8 < windowed / full < 1.5


def test_chat_template_missing_is_a_clear_error(target_lm):
    with pytest.raises(SpecquantError, match="no chat template"):
        target_lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert target_lm.chat_template(False) is None


def test_bad_model_args_are_one_line_errors():
    with pytest.raises(SpecquantError, match="unknown specquant model_args bogus"):
        SpecquantLM(target="tiny-target", bogus="1")
    with pytest.raises(SpecquantError, match="does not exist"):
        SpecquantLM(target="/nonexistent/model")


def test_lm_eval_resolves_specquant_in_a_fresh_interpreter():
    """What `lm_eval --model specquant` does first: look the name up in a process that never imported specquant."""
    code = ("import sys; from lm_eval.api.registry import get_model; cls = get_model('specquant'); "
            "print(cls.__module__ + ':' + cls.__name__); print('specquant.gate' in ''.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["specquant.gate.backend:SpecquantLM", "True"]
