"""QAD of a W4 student on its frozen grid: step-0 equality, zero-difference export, chunked KL, bad input."""

import json

import pytest
import torch
from _qad_models import tiny_lm, write_pair, write_student, write_teacher
from safetensors.torch import load_file

from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import save_model
from specquant.quant import QuantLinear, set_backend
from specquant.quant.quality import compare, heldout_tokens
from specquant.train.config import QADConfig, TrainConfig
from specquant.train.data import BlockOrder, load_blocks
from specquant.train.qad import (BUNDLED_HELDOUT, FakeQuantLinear, QADTask, chunked_kl, exported_weight, load_pair,
                                 set_trainable)
from specquant.train.trainer import Trainer

FAST = ["--steps", "3", "--seq-len", "32", "--batch", "2", "--eval-samples", "2", "--eval-seq-len", "32",
        "--save-every", "3", "--eval-every", "0", "--no-progress"]


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def pair(request, tmp_path_factory):
    """The teacher / W4 student pair of each architecture (_qad_models.ARCHS): a dense Qwen3-layout LM and a
    Qwen3.5 hybrid (Gated DeltaNet + gated attention)."""
    return write_pair(tmp_path_factory.mktemp(f"qad_{request.param}"), arch=request.param)


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory):
    """For the tests of input checks and run bookkeeping, which do not depend on the architecture."""
    return write_pair(tmp_path_factory.mktemp("qad"))


def _task(pair, cfg: QADConfig | None = None):
    from specquant.model.checkpoint import load_tokenizer

    teacher, student = pair
    cfg = cfg or QADConfig(eval_samples=4, eval_seq_len=32)
    t, s, _, s_dir, s_hf = load_pair(str(teacher), str(student))
    set_trainable(s, cfg)
    tok = load_tokenizer(s_dir)
    eval_tokens = heldout_tokens(tok, BUNDLED_HELDOUT, cfg.eval_samples, cfg.eval_seq_len)
    return QADTask(t, s, eval_tokens, cfg, s_dir, s_hf, {}), tok


def test_step0_student_is_the_loaded_checkpoint(pair):
    """Latent weights start at the dequantized codes: same logits and the same KL as the normal loader's model."""
    task, _ = _task(pair)
    loaded = load_model(pair[1])
    set_backend(loaded, "reference")  # dequantize + dense GEMM: the math the fake-quant forward does
    tokens = task.eval_tokens
    with torch.no_grad():
        assert torch.equal(task.student(tokens), loaded(tokens))
    step0 = task.evaluate()
    assert step0["kl"] == compare(task.teacher, loaded, tokens)["kl"]
    assert step0["kl"] > 0  # the student really is quantized
    for m in task.student.modules():
        if isinstance(m, FakeQuantLinear):
            assert torch.equal(m.fake_quant_weight(), m.weight.detach())  # on the grid at step 0


def test_evaluate_keeps_the_teachers_logprobs_and_matches_the_uncached_path(dense_pair, monkeypatch):
    """The teacher is frozen: its held-out log-probabilities are computed once, and every evaluation equals the
    one that runs the teacher again (TEACHER_CACHE_BYTES = 0: the reference path)."""
    import specquant.train.qad as qad

    task, _ = _task(dense_pair)
    first, again = task.evaluate(), task.evaluate()
    assert task._teacher_logprobs is not None and first == again
    monkeypatch.setattr(qad, "TEACHER_CACHE_BYTES", 0)
    uncached, _ = _task(dense_pair)
    assert uncached.evaluate() == first and uncached._teacher_logprobs is None


def test_training_moves_codes_and_export_equals_fake_quant_exactly(pair, tmp_path):
    """After training, the written codes dequantize to exactly the training forward's weights (zero difference);
    every exported scale is the student checkpoint's, bit for bit; our loader and transformers both load the
    export; only latent weights changed (norms, embeddings and a hybrid's dense DeltaNet tensors frozen)."""
    task, tok = _task(pair)
    blocks = load_blocks(BUNDLED_HELDOUT.with_name("calib.txt"), tok, 32, 8192)
    cfg = TrainConfig(steps=4, lr=3e-2, warmup=0, batch=2, seq_len=32, eval_every=0, save_every=4)
    before = {n: m.codes().clone() for n, m in task.student.named_modules() if isinstance(m, FakeQuantLinear)}
    frozen = {n: p.detach().clone() for n, p in task.student.named_parameters()
              if not n.endswith(".weight") or not isinstance(task.student.get_submodule(n[:-7]), FakeQuantLinear)}
    Trainer(task, BlockOrder(blocks, 0), cfg, tmp_path / "run", progress=False).fit()
    fq = {n: m for n, m in task.student.named_modules() if isinstance(m, FakeQuantLinear)}
    changed = sum(int((m.codes() != before[n]).sum()) for n, m in fq.items())
    assert changed > 0, "a high learning rate must move some codes to neighbouring grid points"
    for n, p in task.student.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n

    out = tmp_path / "export"
    task.export(out, task.module.state_dict())
    exported, original = load_file(out / "model.safetensors"), load_file(pair[1] / "model.safetensors")
    scales = [k for k in original if k.endswith("weight_scale")]
    assert len(scales) == len(fq)
    for k in scales:  # the frozen grid: every scale unchanged, bit for bit
        assert exported[k].dtype == original[k].dtype and torch.equal(exported[k], original[k]), k
    loaded = load_model(out)
    for name, m in fq.items():
        q = loaded.get_submodule(name)
        assert isinstance(q, QuantLinear)
        diff = (q.dequantized_weight().float() - m.fake_quant_weight().float()).abs().max()
        assert diff == 0, f"{name}: export differs from the training fake-quant weight by {diff}"
        assert torch.equal(exported_weight(m, m.weight.detach()), m.fake_quant_weight())
    set_backend(loaded, "reference")
    tokens = task.eval_tokens
    with torch.no_grad():
        assert torch.equal(loaded(tokens), task.student(tokens))
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["quantization_config"]["format"] == "pack-quantized" and hf_cfg["torch_dtype"] == "bfloat16"

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        # transformers decompresses to dense Linears: only attention / norm kernels differ (observed ~1e-6)
        torch.testing.assert_close(hf(tokens).logits, task.student(tokens), rtol=0, atol=1e-4)


def test_best_step_is_exported_and_generate_runs_it(pair, tmp_path):
    out = tmp_path / "run"
    assert main(["distill", "target", "--teacher", str(pair[0]), "--student", str(pair[1]), "--out", str(out),
                 "--lr", "1e-2", *FAST, "--eval-every", "1"]) == 0
    evals = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("event") == "eval"]
    best = min(evals, key=lambda e: e["kl"])
    assert evals[-1]["best_step"] == best["step"]
    meta = json.loads((out / "model" / "config.json").read_text())["specquant_qad"]
    assert meta["teacher_sha256"] and meta["student_sha256"]
    # --aot off: generate's default "cached" refuses hybrids (Transformer.compiled_steps_refusal) even when no
    # package is on disk
    assert main(["generate", "--target", str(out / "model"), "--draft", "none", "--prompt", "The",
                 "--max-new-tokens", "4", "--aot", "off", "--json"]) == 0


@pytest.mark.parametrize("t,chunk", [(10, 3), (8, 8)])
def test_chunked_kl_equals_full_vocabulary_reference(t, chunk):
    """The chunked, checkpointed KL and its gradient equal the plain one-shot formula."""
    teacher, student = tiny_lm(0), tiny_lm(1)
    gen = torch.Generator().manual_seed(t * 100 + chunk)  # seeded: the inputs were unseeded, so the test was flaky
    hidden_t = torch.randn(2, t, 64, generator=gen)
    hidden_s = torch.randn(2, t, 64, generator=gen).requires_grad_()
    got = chunked_kl(hidden_s, hidden_t, student.lm_head, teacher.lm_head, chunk)
    (g_got,) = torch.autograd.grad(got, hidden_s)
    tlp = torch.log_softmax(teacher.lm_head(hidden_t).float(), -1)
    slp = torch.log_softmax(student.lm_head(hidden_s).float(), -1)
    ref = (tlp.exp() * (tlp - slp)).sum(-1).mean()
    (g_ref,) = torch.autograd.grad(ref, hidden_s)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    # absolute tolerance scaled to the gradient: fp32 sums in a different order (chunks, thread count) differ by
    # ~1e-7 on entries near zero, where a pure relative tolerance fails; a wrong chunking is off by orders more
    torch.testing.assert_close(g_got, g_ref, rtol=1e-4, atol=1e-5 * float(g_ref.abs().max()))


def test_max_start_kl_refuses_before_writing_anything(dense_pair, tmp_path, capsys):
    out = tmp_path / "never"
    rc = main(["distill", "target", "--teacher", str(dense_pair[0]), "--student", str(dense_pair[1]), "--out", str(out),
               "--max-start-kl", "1e-9", *FAST])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--max-start-kl" in err
    assert not out.exists()


def _bad_cases(pair, root):
    teacher, student = pair
    other_arch = write_teacher(root / "wide", hidden_size=128)
    other_vocab_student = write_student(write_teacher(root / "v", vocab_size=4096), root / "v_student")
    empty = root / "empty.txt"
    empty.write_text("")
    malformed = root / "bad.jsonl"
    malformed.write_text('{"prompt_ids": [1, 2]}\n')
    nonempty = root / "busy"
    nonempty.mkdir()
    (nonempty / "notes.txt").write_text("mine")
    dense_copy = root / "dense_copy"
    save_model(load_model(teacher), dense_copy, tokenizer_from=teacher)
    return {
        "unquantized student": (["--student", str(dense_copy)], "not quantized"),
        "different architecture": (["--teacher", str(other_arch)], "hidden_size"),
        "different vocabulary": (["--student", str(other_vocab_student)], "vocab_size"),
        "empty data": (["--data", str(empty)], "0 tokens"),
        "malformed data": (["--data", str(malformed)], "completion_ids"),
        "non-empty --out": (["--out", str(nonempty)], "--overwrite"),
        "held-out as data": (["--data", str(BUNDLED_HELDOUT)], "held-out"),
    }


def test_bad_input_one_line_error_and_nothing_written(dense_pair, tmp_path, capsys):
    for case, (extra, match) in _bad_cases(dense_pair, tmp_path).items():
        out = tmp_path / f"out-{case.replace(' ', '_')}"
        args = {"--teacher": str(dense_pair[0]), "--student": str(dense_pair[1]), "--out": str(out)}
        for k, v in zip(extra[::2], extra[1::2]):
            args[k] = v
        rc = main(["distill", "target", *[x for kv in args.items() for x in kv], *FAST])
        err = capsys.readouterr().err.strip()
        assert rc == 2, case
        assert len(err.splitlines()) == 1 and match in err, (case, err)
        if args["--out"] == str(out):
            assert not out.exists(), case
    busy = tmp_path / "busy"
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]


def test_overwrite_clears_only_our_outputs(dense_pair, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "log.jsonl").write_text('{"step": 99}\n')
    assert main(["distill", "target", "--teacher", str(dense_pair[0]), "--student", str(dense_pair[1]),
                 "--out", str(out), "--overwrite", *FAST]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert '"step": 99' not in (out / "log.jsonl").read_text()
    assert sorted(load_file(out / "checkpoints" / "step-0000003" / "trainable.safetensors"))


def test_data_order_is_a_function_of_the_sample_index():
    blocks = torch.arange(50).view(10, 5)
    order = BlockOrder(blocks, seed=3)
    first = order.rows(0, 25)
    again = BlockOrder(blocks, seed=3).rows(12, 8)
    assert torch.equal(first[12:20], again)
    assert sorted(first[:10, 0].tolist()) == list(range(0, 50, 5))  # each epoch is a permutation
    with pytest.raises(SpecquantError, match="does not exist"):
        load_blocks("/nonexistent.txt", None, 8, 10)


def test_recipe_runs_regen_then_qad_and_reuses_its_cache(dense_pair, tmp_path):
    from specquant.train.config import RegenConfig
    from specquant.train.recipe import QADRecipe, qad_target

    recipe = QADRecipe(regen=RegenConfig(limit=4, max_new_tokens=8, batch=4),
                       train=TrainConfig(steps=2, seq_len=16, batch=2, eval_every=0, save_every=2),
                       qad=QADConfig(eval_samples=2, eval_seq_len=32))
    path, info = qad_target(dense_pair[0], dense_pair[1], tmp_path, recipe, log=lambda *_: None)
    assert info["produced"] and info["steps"] == 2 and isinstance(load_model(path).model.layers[0].mlp.up_proj,
                                                                   QuantLinear)
    rows = (path.parent.parent / "regen.jsonl").read_text().splitlines()
    assert len(rows) == 4
    again, info2 = qad_target(dense_pair[0], dense_pair[1], tmp_path, recipe, log=lambda *_: None)
    assert again == path and not info2["produced"]
