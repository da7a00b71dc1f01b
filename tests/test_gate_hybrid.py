"""The gates on a Qwen3.5 hybrid (Gated DeltaNet + gated attention): the kl gate compares its W4 checkpoint with it,
and the `specquant` lm-eval backend scores and generates with it, speculative generation (a hybrid LM draft, whose
DeltaNet state rolls back after rejections) equal to target-only."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from _quant_models import hybrid_checkpoint, noisy_copy
from lm_eval.api.instance import Instance

from specquant.cli import main
from specquant.gate.backend import SpecquantLM
from specquant.gate.datasets import FIXTURES
from specquant.loader import load_model
from specquant.quant import QuantConfig, quantize, save_quantized

SHAPE = dict(layers=2, layer_types=["linear_attention", "full_attention"], max_position_embeddings=256, scale=0.05)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """{dense, w4, draft}: a random 2-layer hybrid, its RTN W4 (g32), and a noisy copy of it as an LM draft."""
    root = tmp_path_factory.mktemp("gate_hybrid")
    dense = hybrid_checkpoint(root / "dense", **SHAPE)
    model = load_model(dense)
    quantize(model, QuantConfig(method="rtn", group_size=32))
    w4 = save_quantized(model, root / "w4", tokenizer_from=dense)
    draft = noisy_copy(dense, root / "draft")
    return {"dense": dense, "w4": w4, "draft": draft}


def test_kl_gate_on_a_hybrid_and_its_w4(hybrid, tmp_path, capsys):
    """Against itself: KL 0, exit 0. The W4 checkpoint against the dense hybrid: a KL above 0 (it is quantized) and
    well below the draft's (a different model)."""
    small = ["--kl-samples", "2", "--kl-seq-len", "32", "--json"]
    out = tmp_path / "gate"
    runs = {}
    for name in ("dense", "w4", "draft"):
        rc = main(["gate", "--model", str(hybrid[name]), "--baseline", str(hybrid["dense"]), "--tasks", "kl",
                   "--out", str(out), *small])
        runs[name] = (rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    rc, same = runs["dense"]
    assert rc == 0 and same["kl"]["kl"] == pytest.approx(0.0, abs=1e-6) and same["kl"]["top1_agree"] == 1.0
    assert 0 < runs["w4"][1]["kl"]["kl"] < runs["draft"][1]["kl"]["kl"]
    assert json.loads((out / "results.json").read_text())["gates"]


def _req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def test_lm_eval_backend_scores_and_generates_on_a_hybrid(hybrid):
    target = SpecquantLM(target=str(hybrid["w4"]), device="cpu")
    spec = SpecquantLM(target=str(hybrid["w4"]), draft=str(hybrid["draft"]), draft_len="3", device="cpu")
    prompts = [json.loads(x)["prompt"] for x in (FIXTURES / "ifeval" / "train.jsonl").read_text().splitlines()[:2]]
    reqs = [_req("generate_until", (p, {"until": [], "max_gen_toks": 24, "do_sample": False}), i)
            for i, p in enumerate(prompts)]
    plain = target.generate_until(reqs, disable_tqdm=True)
    assert spec.generate_until(reqs, disable_tqdm=True) == plain
    assert spec.engine.draft_steps > 0 and all(len(target.tok_encode(t)) > 8 for t in plain)

    context, continuation = "The meaning of the word", " is not known"
    (score, greedy), = target.loglikelihood([_req("loglikelihood", (context, continuation))], disable_tqdm=True)
    ctx, whole = target.tok_encode(context), target.tok_encode(context + continuation)
    cont = whole[len(ctx):]
    model = load_model(hybrid["w4"], w4_activations="auto")  # the arithmetic the backend serves by default
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), -1)
    assert score == pytest.approx(sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)), abs=1e-4)
    assert greedy == all(int(logp[len(ctx) - 1 + i].argmax()) == t for i, t in enumerate(cont))
