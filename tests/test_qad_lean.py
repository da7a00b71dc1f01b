"""Lean (block-wise) QAD: the streamed forward equals the model's, the export is exactly what the blocks ran (zero
difference, same KL as the loaded checkpoint), SIGKILL + resume gives the same checkpoint, bad input writes
nothing."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _qad_models import ROOT, distill_args, run_in_process, write_pair
from safetensors.torch import load_file

from specquant.cli import main
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer, read_hf_config
from specquant.quant import QuantLinear, set_backend
from specquant.quant.quality import compare, heldout_tokens
from specquant.train.lean_qad import Streamed, _layer, layer_forward, stream_eval
from specquant.train.qad import BUNDLED_HELDOUT, FakeQuantLinear

RUN = ["--lean", "--seq-len", "32", "--batch", "2", "--eval-samples", "2", "--eval-seq-len", "32", "--eval-every", "0",
       "--warmup", "0", "--no-progress"]


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def pair(request, tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp(f"lean_{request.param}"), arch=request.param)


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("lean"))


def _args(pair, out, *extra):
    return distill_args(pair, out, *RUN, *extra)


def _eval_tokens(student, n=2, t=32):
    return heldout_tokens(load_tokenizer(student), BUNDLED_HELDOUT, n, t)


def test_streamed_layers_equal_the_models_forward(pair):
    """Embedding, then each layer materialized alone from the files, then the final norm: the same hidden states as
    Transformer.forward on the whole loaded model (teacher dense, student fake-quant at step 0 == its loader's
    reference backend), and the step-0 gate's KL is compare()'s on the loaded pair."""
    teacher_dir, student_dir = pair
    tokens = _eval_tokens(student_dir)
    for path, fake in ((teacher_dir, False), (student_dir, True)):
        streamed = Streamed(path, read_hf_config(path), torch.float32, torch.device("cpu"), fake_quant=fake)
        x = streamed.embed(tokens)
        for i in range(streamed.config.num_hidden_layers):
            with torch.no_grad():
                x = layer_forward(_layer(streamed, i), x)
        model = load_model(path)
        set_backend(model, "reference")  # dequantize + dense GEMM: the fake-quant forward's math
        with torch.no_grad():
            assert torch.equal(streamed.part("model.norm")(x), model(tokens, hidden_only=True)), path
    t, s = (Streamed(p, read_hf_config(p), torch.float32, torch.device("cpu"), f) for p, f in
            ((teacher_dir, False), (student_dir, True)))
    gate = stream_eval(t, s, tokens, batch=1)
    student = load_model(student_dir)
    set_backend(student, "reference")
    ref = compare(load_model(teacher_dir), student, tokens)
    assert gate["kl"] > 0
    torch.testing.assert_close(gate["kl"], ref["kl"], rtol=1e-6, atol=0)


def test_lean_export_is_exactly_what_the_blocks_ran(pair, tmp_path):
    """Training moves codes (lr 3e-3: a best step past 0 in at least one block of either pair); every scale stays
    the student's bit for bit; each written layer dequantizes to exactly its block's fake-quant weights (zero
    difference); every tensor off the grid is the student's (norms and a hybrid's dense DeltaNet tensors frozen);
    the held-out KL the run reports is the KL of the written checkpoint as load_model loads it."""
    out = tmp_path / "run"
    run_in_process(_args(pair, out, "--steps", "6", "--lr", "3e-3", "--save-every", "2"))
    exported, original = load_file(out / "model" / "model.safetensors"), load_file(pair[1] / "model.safetensors")
    assert set(exported) == set(original)
    packed = [k for k in original if k.endswith("weight_packed")]
    moved = sum(int((exported[k] != original[k]).sum()) for k in packed)
    assert moved > 0, "training must move some codes to neighbouring grid points (best step > 0 in some block)"
    for k, v in original.items():
        if not k.endswith("weight_packed"):
            assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k

    loaded = load_model(out / "model")
    hf = read_hf_config(pair[1])
    student = Streamed(pair[1], hf, torch.float32, torch.device("cpu"), fake_quant=True)
    for i in range(student.config.num_hidden_layers):
        block = load_file(out / "lean" / "blocks" / f"layer-{i:03d}" / "model" / "block.safetensors")
        layer = _layer(student, i, {k.removeprefix(f"model.layers.{i}."): v for k, v in block.items()})
        for name, m in layer.named_modules():
            if isinstance(m, FakeQuantLinear):
                q = loaded.get_submodule(f"model.layers.{i}.{name}")
                assert isinstance(q, QuantLinear)
                diff = (q.dequantized_weight().float() - m.fake_quant_weight().float()).abs().max()
                assert diff == 0, f"layer {i} {name}: export differs from the block's fake-quant weight by {diff}"
    rows = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    final = [r for r in rows if r.get("event") == "eval"][-1]
    assert [r["block"] for r in rows if r.get("event") == "block"] == list(range(student.config.num_hidden_layers))
    set_backend(loaded, "reference")
    ref = compare(load_model(pair[0]), loaded, _eval_tokens(pair[1]))
    torch.testing.assert_close(final["kl"], ref["kl"], rtol=1e-6, atol=0)
    meta = json.loads((out / "model" / "config.json").read_text())
    assert meta["specquant_qad"]["mode"] == "lean" and meta["quantization_config"] == hf["quantization_config"]


def _kill_when(out, path_glob, args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specquant.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out.glob(path_glob)) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("where", ["lean/blocks/layer-000/checkpoints/step-*", "lean/acts-001.safetensors",
                                   "lean/blocks/layer-001/model"])
def test_sigkill_then_resume_gives_the_same_checkpoint(dense_pair, tmp_path, where):
    """Killed inside block 0 (after a block checkpoint), between blocks (the activations entering block 1 written)
    and inside block 1 (after its step-0 export): --resume ends with the checkpoint an uninterrupted run writes."""
    steps = ["--steps", "6", "--save-every", "2", "--lr", "3e-3"]
    run_in_process(_args(dense_pair, tmp_path / "ref", *steps))
    out = tmp_path / "killed"
    _kill_when(out, where, _args(dense_pair, out, *steps))
    assert list(out.glob(where)), f"{where} never appeared before the kill"
    assert not (out / "model").exists(), "the run finished before it could be killed; the test proves nothing"
    run_in_process(_args(dense_pair, out, *steps, "--resume"))
    ref, got = load_file(tmp_path / "ref" / "model" / "model.safetensors"), load_file(out / "model" /
                                                                                       "model.safetensors")
    assert set(ref) == set(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_bad_input_one_line_error_and_nothing_written(dense_pair, tmp_path, capsys, monkeypatch):
    """full QAD's bad-input cases (tests/test_qad.py) with --lean, and lean's own: each one line, exit 2, no --out."""
    from test_qad import _bad_cases

    cases = {k: (["--lean", *extra], m) for k, (extra, m) in _bad_cases(dense_pair, tmp_path).items()}
    cases.update({"train embeddings": (["--train-embeddings"], "--train-embeddings"),
                  "start KL gate": (["--max-start-kl", "1e-9"], "--max-start-kl"),
                  "negative pool": (["--lean-samples", "-1"], "lean_samples")})
    for case, (extra, match) in cases.items():
        out = tmp_path / f"out-{case.replace(' ', '_')}"
        args = {"--teacher": str(dense_pair[0]), "--student": str(dense_pair[1]), "--out": str(out)}
        flags = [x for x in extra if x == "--lean" or x == "--train-embeddings"]
        rest = [x for x in extra if x not in flags]
        for k, v in zip(rest[::2], rest[1::2]):
            args[k] = v
        rc = main(["distill", "target", *[x for kv in args.items() for x in kv], *flags, *RUN, "--steps", "2"])
        err = capsys.readouterr().err.strip()
        assert rc == 2, case
        assert len(err.splitlines()) == 1 and match in err, (case, err)
        if args["--out"] == str(out):
            assert not out.exists(), case
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "torchrun"
    assert main(_args(dense_pair, out, "--steps", "2")) == 2
    assert "one process" in capsys.readouterr().err and not out.exists()
