"""specquant serve through the official openai client against a server started on loopback (uvicorn in a thread,
a free port), over the bundled tiny-target + tiny-draft; and specquant latency against it."""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from specquant import cli  # noqa: E402
from specquant.model.checkpoint import load_tokenizer  # noqa: E402
from specquant.serve import latency, loopback  # noqa: E402
from specquant.serve.app import create_app  # noqa: E402
from specquant.serve.config import ServeConfig  # noqa: E402
from specquant.serve.metrics import ServerMetrics  # noqa: E402
from specquant.serve.requests import CHATML, RequestError, chat_ids_of  # noqa: E402
from specquant.serve.text import TextStream  # noqa: E402
from specquant.spec_decode.build import build_engine  # noqa: E402
from specquant.spec_decode.runtime import RuntimeConfig  # noqa: E402
from specquant.spec_decode.metrics import SpecMetrics  # noqa: E402
from specquant.util.flags import config_from_args  # noqa: E402

MODEL = "tiny-target"
PROMPT = "The meaning of the word"


@contextmanager
def serving(app):
    """app served on a free loopback port in a thread; yields the base URL, then checks it shut down."""
    with loopback.serving(app) as url:
        yield url


def make_app(**config):
    tokenizer = load_tokenizer(MODEL)
    engine = build_engine(MODEL, "tiny-draft", RuntimeConfig(), target_tokenizer=tokenizer)
    return create_app(engine, tokenizer, ServeConfig(**config), MODEL), engine


@pytest.fixture(scope="module")
def served():
    app, engine = make_app(chat_template="chatml", max_queue=64)
    with serving(app) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def post(url: str, path: str, data: bytes | dict):
    """(status, headers, parsed JSON body) of a raw POST."""
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    req = urllib.request.Request(url + path, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^specquant:{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def generated(prompt: str, max_new_tokens: int, capsys) -> str:
    """`specquant generate`'s text for the same greedy request (eager steps, as the test server runs)."""
    capsys.readouterr()
    assert cli.main(["generate", "--prompt", prompt, "--max-new-tokens", str(max_new_tokens), "--aot", "off",
                     "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]


def test_completion_stream_and_chat_equal_generate(client, capsys):
    want = generated(PROMPT, 24, capsys)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert reply.choices[0].text == want
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens <= 24
    assert reply.choices[0].finish_reason == ("length" if reply.usage.completion_tokens == 24 else "stop")

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # it really streamed
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is the king?"}]
    tokenizer = load_tokenizer(MODEL)
    rendered = tokenizer.apply_chat_template(messages, chat_template=CHATML, tokenize=False, add_generation_prompt=True)
    want_chat = generated(rendered, 16, capsys)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == want_chat
    pieces = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == want_chat
    assert client.models.list().data[0].id == MODEL


def test_a_served_request_runs_generates_steps():
    """The worker runs a request exactly as `specquant generate` does on the same engine: the same target and
    draft forwards (token counts in order, so the same verify shapes and draft length), with autograd off and
    torch's thread count, only in the engine's own thread (issue 26: served latency as generate's). Grad mode is
    per thread, so a worker that does not switch it off records every forward for backward."""
    import threading

    import torch

    app, engine = make_app()  # its own engine: generate's request here must not reach the shared server's counters
    calls = []

    def recording(fn, who):
        def wrapper(tokens, *args, **kwargs):
            calls.append((who, tokens.shape[1], torch.is_grad_enabled(), torch.get_num_threads(),
                          threading.current_thread().name))
            return fn(tokens, *args, **kwargs)
        return wrapper

    engine.target_step.step = recording(engine.target_step.step, "target")
    engine.drafter._forward = recording(engine.drafter._forward, "draft")
    ids = load_tokenizer(MODEL).encode(PROMPT, add_special_tokens=False)
    direct = engine.generate(torch.tensor([ids]), 24, stop_on_eos=True)
    generate_calls, calls[:] = list(calls), []
    with serving(app) as url:
        status, _, reply = post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                         "temperature": 0})
    served_calls = list(calls)
    assert status == 200 and reply["usage"]["completion_tokens"] == len(direct.token_ids[0])
    assert sum(who == "target" for who, *_ in generate_calls) == direct.stats["target_forwards"]
    assert direct.stats["num_drafts"] > 0  # it did speculate
    shape = lambda rows: [(who, t) for who, t, *_ in rows]  # noqa: E731
    assert shape(served_calls) == shape(generate_calls)
    threads = torch.get_num_threads()
    assert {(grad, n) for _, _, grad, n, _ in generate_calls + served_calls} == {(False, threads)}
    assert {name for *_, name in served_calls} == {"specquant-engine"}  # the worker's thread (serve/worker.py)


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    want = full[: full.find(stop)]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@"])
    assert reply.choices[0].text == want and reply.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_text_stream_matches_whole_decode():
    tokenizer = load_tokenizer(MODEL)
    text = "Wherefore art thou, Romeo? Deny thy father — and refuse thy name ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for stop in ([], ["thy father"], ["not there"]):
        ts, out = TextStream(tokenizer, stop), ""
        for t in ids:
            out += ts.feed([t])
            if ts.stopped:
                break
        out += ts.finish()
        assert out == (whole[: whole.find(stop[0])] if stop and stop[0] in whole else whole)


BAD = [  # (path, body, the field the 400 names)
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2046}, "max_tokens"),  # in the limit, not the context
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 9}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": 2.5}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": -3}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": "x" * 65}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 7}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "seed": True}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 3}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [5] * 2048}, "prompt"),  # no room left in the context
    ("/v1/completions", {"prompt": [5] * 2000, "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"prompt": [99999]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.split('/')[-1]}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(served, path, body, param):
    status, _, reply = post(served[0], path, {"model": MODEL, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


def test_malformed_json_wrong_model_and_openai_client_errors(served, client):
    status, _, reply = post(served[0], "/v1/completions", b'{"prompt": "x", ')
    assert status == 400 and "JSON" in reply["error"]["message"]
    status, _, reply = post(served[0], "/v1/completions", b"[1, 2]")
    assert status == 400
    status, _, reply = post(served[0], "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and reply["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)
    assert e.value.body["param"] == "n"


def test_chat_without_a_template_is_refused_by_name():
    tokenizer = load_tokenizer(MODEL)
    assert not getattr(tokenizer, "chat_template", None)  # the bundled tokenizer has none: hence --chat-template
    with pytest.raises(RequestError) as e:
        chat_ids_of({"messages": [{"role": "user", "content": "hi"}]}, tokenizer, None)
    assert e.value.param == "messages" and "--chat-template" in str(e.value)


def test_load_64_clients_lose_nothing(served, client):
    """64 concurrent clients, 128 requests, a time limit; every reply equals the same request run alone."""
    url, engine = served
    prompts = [f"{word} the king" for word in ("Long live", "Here comes", "Where is", "Behold", "O", "Now", "Go to",
                                                 "Alas for")]
    alone = {}
    for p in prompts:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        alone[p] = (r.choices[0].text, r.usage.completion_tokens)
    before = (engine.metrics.num_drafts, engine.metrics.num_accepted_tokens)
    start = time.monotonic()

    def one(i):
        p = prompts[i % len(prompts)]
        if i % 2:  # half of them stream
            chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
            return p, "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        return p, r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(128), timeout=240))
    assert time.monotonic() - start < 240
    assert len(results) == 128
    for p, text, n in results:
        assert (text, n) == alone[p]
    text = metrics_text(url)
    assert metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
    # the server's speculative counters are the engine's own, request by request
    assert metric(text, "spec_decode_num_drafts_total") == engine.metrics.num_drafts > before[0]
    assert metric(text, "spec_decode_num_accepted_tokens_total") == engine.metrics.num_accepted_tokens
    assert metric(text, 'spec_decode_num_accepted_tokens_per_pos_total{position="0"}') == \
        engine.metrics.num_accepted_tokens_per_pos[0]
    assert metric(text, "time_to_first_token_seconds_count") >= 128
    assert 1.0 < metric(text, "spec_decode_mean_acceptance_length_rolling") <= 1 + engine.config.draft_len


def wait_for(url: str, check, what: str) -> str:
    """/metrics text once check(text) holds (30 s at most)."""
    deadline = time.monotonic() + 30
    while not check(text := metrics_text(url)):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return text


def test_full_queue_503_and_disconnects_free_their_slots():
    """max_queue 2: a long stream runs, a plain request waits, a third is 503 with Retry-After. The waiting
    client leaves: its slot frees at once, the stream still running; the streaming client leaves mid-stream: the
    engine stops generating for it. Then the server takes a new request."""
    app, engine = make_app(max_queue=2, retry_after_s=3)
    with serving(app) as url:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        stream = urllib.request.urlopen(req, timeout=60)
        assert stream.readline().startswith(b"data: ")  # generating
        waiting = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        raw = json.dumps(body).encode()
        waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        wait_for(url, lambda t: metric(t, "num_requests_waiting") == 1, "the second request never queued")
        status, headers, reply = post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert status == 503 and headers["Retry-After"] == "3" and "queue is full" in reply["error"]["message"]
        waiting.close()  # a waiting client goes away
        text = wait_for(url, lambda t: metric(t, "num_requests_waiting") == 0, "the waiting request kept its slot")
        assert metric(text, "num_requests_running") == 1  # the stream is unaffected
        stream.close()  # the streaming client goes away mid-stream
        text = wait_for(url, lambda t: metric(t, "num_requests_running") == 0, "the cancelled stream never ended")
        assert metric(text, 'requests_total{endpoint="completions",outcome="cancelled"}') == 2
        stopped_at = metric(text, "generation_tokens_total")
        assert stopped_at < 1500  # it stopped early, not after generating everything
        status, _, reply = post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                         "temperature": 0})
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1
        assert metric(metrics_text(url), "generation_tokens_total") == stopped_at + reply["usage"]["completion_tokens"]


def test_rolling_mal_warns_once_below_threshold(caplog):
    m = ServerMetrics(window=2, warn_below=1.5)
    caplog.set_level(logging.WARNING, "specquant.serve")
    m.record_spec(SpecMetrics(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=20,
                              num_accepted_tokens_per_pos=[9, 7, 4]))
    assert not caplog.records and m.mal._value.get() == 3.0
    low = SpecMetrics(num_drafts=30, num_draft_tokens=90, num_accepted_tokens=0, num_accepted_tokens_per_pos=[0])
    m.record_spec(low)
    m.record_spec(low)
    assert m.mal._value.get() == 1.0
    assert len(caplog.records) == 1 and "below 1.50" in caplog.records[0].getMessage()
    assert b'specquant:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 7.0' in m.render()


def test_latency_against_the_server(served, capsys):
    url = served[0]
    capsys.readouterr()
    assert cli.main(["latency", "--server", url, "--model", MODEL, "--categories", "short", "--runs", "2",
                     "--warmup", "1", "--baseline-server", url]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("category") and out[1].startswith("short")
    result = json.loads(out[-1])
    row = result["categories"]["short"]
    assert result["prompt_scale"] == 1.0 and abs(row["prompt_tokens"] - 64) <= 2
    assert row["median_ms"] > 0 and row["p90_ms"] >= row["median_ms"] and row["speedup"] > 0
    assert 1.0 < row["mean_acceptance_length"] <= 4.0


def test_latency_reports_the_first_request_apart_and_serve_replays_it(capsys):
    """`serve --draft suffix` keeps earlier answers: the protocol's repeats of one greedy prompt draft the first
    answer nearly whole (steady-state MAL far above the first request's), and latency reports both."""
    from specquant.serve.cli import build_app

    parser, _ = cli.build_parser()
    app, _ = build_app(parser.parse_args(["serve", "--draft", "suffix", "--aot", "off", "--model-name", MODEL]))
    with serving(app) as url:
        capsys.readouterr()
        assert cli.main(["latency", "--server", url, "--categories", "short", "--runs", "2", "--warmup", "1",
                         "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["categories"]["short"]
    # 128 new tokens, K = 20: a whole replay takes 7 steps of 20 accepted drafts (MAL 21 but for the last step)
    assert row["mean_acceptance_length"] > 15 > row["first_mean_acceptance_length"]
    assert row["first_ms"] > 0 and row["mean_new_tokens"] == 128


def test_latency_scaling_and_percentile():
    # the bundled 2048-token context: long's 8192 + 256 does not fit, so every prompt shrinks by one factor
    assert latency.scale_of(2048, ["short", "long"]) == pytest.approx((2048 - 256 - latency.CONTEXT_MARGIN) / 8192)
    assert latency.scale_of(32768, ["short", "medium", "long"]) == 1.0
    assert latency.scale_of(None, ["long"]) == 1.0
    assert latency.percentile(list(range(1, 11)), 90) == 9 and latency.percentile([5.0], 90) == 5.0


def test_serve_flags_reach_the_app_and_fastapi_stays_lazy():
    from specquant.serve.cli import build_app

    parser, _ = cli.build_parser()
    args = parser.parse_args(["serve", "--max-queue", "3", "--chat-template", "chatml", "--draft-len", "2",
                              "--aot", "off", "--model-name", "pair"])
    app, config = build_app(args)
    assert (config.max_queue, config.model_name, app.state.worker.max_queue) == (3, "pair", 3)
    assert app.state.worker.engine.config.draft_len == 2
    assert config_from_args(ServeConfig, parser.parse_args(["serve"])) == ServeConfig()  # defaults from the dataclass
    # the other verbs never import FastAPI
    code = "import sys; from specquant.cli import build_parser; build_parser(); print('fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_serve_keeps_a_suffix_response_cache_by_default():
    """`serve --draft suffix` (and suffix+DRAFT) drafts from earlier responses unless --suffix-cache-tokens 0;
    generate keeps SuffixConfig's default (off)."""
    from specquant.serve.cli import build_app
    from specquant.spec_decode.drafters import DrafterOptions, serving_options
    from specquant.spec_decode.suffix_drafter import SuffixConfig

    parser, _ = cli.build_parser()
    served = serving_options()["suffix"].cache_tokens
    assert served > 0 == SuffixConfig().cache_tokens and serving_options()["hybrid"] == DrafterOptions()["hybrid"]
    for extra, want in (([], served), (["--suffix-cache-tokens", "0"], 0)):
        app, _ = build_app(parser.parse_args(["serve", "--draft", "suffix", "--aot", "off", *extra]))
        drafter = app.state.worker.engine.drafter
        assert drafter.config.cache_tokens == want and (drafter.cache is None) == (want == 0)
    app, _ = build_app(parser.parse_args(["serve", "--draft", "suffix+tiny-draft", "--aot", "off",
                                          "--suffix-min-token-prob", "0.2"]))
    hybrid = app.state.worker.engine.drafter
    assert hybrid.suffix.cache is not None and hybrid.suffix.config.min_token_prob == 0.2
    gen = parser.parse_args(["generate", "--draft", "suffix"])
    assert config_from_args(DrafterOptions, gen)["suffix"].cache_tokens == 0


def test_shutdown_stops_the_running_request():
    app, _ = make_app()
    with serving(app) as url:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        stream = urllib.request.urlopen(req, timeout=60)
        assert stream.readline().startswith(b"data: ")
        start = time.monotonic()
    # serving() asserted the server and its worker stopped; a 2000-token request would still be generating
    assert time.monotonic() - start < 10 and not app.state.worker.thread.is_alive()
    assert metric(app.state.metrics.render().decode(), "generation_tokens_total") < 2000
    stream.close()


def test_prefix_cache_serves_the_same_tokens_and_counts_hits(client):
    """--prefix-cache: the same replies as the plain server for a prompt, its repeat, an extension and one that
    diverges; /metrics counts the lookups and the tokens restored."""
    prompts = [PROMPT * 4, PROMPT * 4, PROMPT * 4 + " and the rest", PROMPT + " is plain"]
    app, _ = make_app(prefix_cache=True, prefix_cache_block=8)
    with serving(app) as url:
        cached = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for p in prompts:
            want = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
            got = cached.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
            assert got.choices[0].text == want.choices[0].text
        text = metrics_text(url)
    assert metric(text, 'prefix_cache_requests_total{result="miss"}') == 1
    assert metric(text, 'prefix_cache_requests_total{result="hit"}') == 3
    # the repeat restores its whole prompt, the extension the whole first one
    first = len(load_tokenizer(MODEL)(PROMPT * 4)["input_ids"])
    assert metric(text, "prefix_cache_hits_total") >= 2 * first
    assert metric(text, "prefix_cache_queries_total") == metric(text, "prompt_tokens_total")
    assert metric(text, "prefix_cache_entries") == 3 and metric(text, "prefix_cache_bytes") > 0


def test_demo_serve_step_times_the_pair(monkeypatch):
    """`specquant demo --serve`: after the bench, the W4 pair (here the bundled one, the bench stubbed) is served
    on loopback and timed with latency's protocol; off by default."""
    from types import SimpleNamespace

    import specquant.bench.ablation as ablation
    import specquant.bench.report as report
    import specquant.gate.kl as kl
    from specquant.bench.demo import run_demo

    fake = SimpleNamespace(quantized={"quantized_target": {"path": MODEL}, "quantized_draft": "tiny-draft"},
                           to_json=lambda: {"rows": []})
    monkeypatch.setattr(ablation, "run_bench", lambda *a, **k: (fake, []))
    monkeypatch.setattr(kl, "demo_gate", lambda *a, **k: {"passed": True})
    monkeypatch.setattr(report, "summary_table", lambda results: "")
    logged = []
    assert "served" not in run_demo("unused", "quick", log=logged.append)
    out = run_demo("unused", "quick", log=logged.append, serve=True)
    row = out["served"]["categories"]["short"]
    assert out["served"]["config"]["runs"] == 3 and abs(row["prompt_tokens"] - 64) <= 2
    assert row["median_ms"] > 0 and 1.0 <= row["mean_acceptance_length"] <= 4.0
    assert any("specquant latency --server http://127.0.0.1:" in line for line in logged)
    parser, _ = cli.build_parser()
    assert parser.parse_args(["demo"]).serve is False and parser.parse_args(["demo", "--serve"]).serve is True
    presets = [parser.parse_args(argv).preset for argv in (["demo"], ["demo", "--full"], ["demo", "--quick"])]
    assert presets == ["default", "full", "quick"]


def test_serve_load_benchmark_at_a_tiny_setting(capsys):
    from conftest import load_benchmark

    bench = load_benchmark("serve_load.py")
    assert bench.main(["--clients", "16", "--requests", "32", "--max-tokens", "4", "--time-limit", "200"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert (result["completed"], result["failures"], result["corrupted"], result["not_run"]) == (32, 0, 0, 0)
    assert result["p99_ms"] >= result["p50_ms"] > 0 and result["requests_per_s"] > 0
    assert any("spec_decode_num_drafts_total" in line for line in result["metrics"])
    assert out[0].startswith("32/32 requests from 16 clients")
    assert bench.main(["--clients", "0"]) == 2


def test_serve_latency_benchmark_runs_our_server(tmp_path, capsys):
    """benchmarks/serve_latency.py with the target-only row: a `specquant serve` process, `specquant latency`
    against it, the side-by-side table and JSON (the W4 and llama-server rows run the same steps on other
    servers)."""
    from conftest import load_benchmark

    bench = load_benchmark("serve_latency.py")
    assert bench.main(["--rows", "specquant", "--tiny", "--work", str(tmp_path), "--threads", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    row = result["rows"]["specquant"]["categories"]["short"]
    assert out[1].split()[:2] == ["specquant", "short"] and row["median_ms"] > 0
    assert row["mean_acceptance_length"] is None  # target only: no drafts, no MAL
    assert not (tmp_path / "w4-draft").exists()  # only the rows that need it quantize the draft
    assert bench.main(["--rows", "vllm"]) == 2


def test_latency_reads_spec_counters_with_and_without_labels():
    """vLLM labels its counters (model_name, engine: one series per engine core): they are summed; ours and
    llama-server's carry none; the per-position series never count as totals."""
    from specquant.serve.latency import spec_totals

    vllm = ('vllm:spec_decode_num_drafts_total{engine="0",model_name="pair"} 10.0\n'
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="pair"} 2.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="pair"} 17.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="pair",position="0"} 9.0\n')
    assert spec_totals(vllm) == (12.0, 17.0)
    assert spec_totals("specquant:spec_decode_num_drafts_total 4\nspec_decode_num_accepted_tokens_total 6\n"
                       'specquant:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3\n') == (4.0, 6.0)
    assert spec_totals("specquant:requests_total 3\n") is None
