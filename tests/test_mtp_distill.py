"""`specquant distill draft --kind mtp`: the MTP layer trained against a hybrid target in two stages, resumed, and
written into a copy of the target for `--draft mtp`."""

from __future__ import annotations

import json

import pytest
import torch
from _qad_models import TOKENIZER
from _qwen35_models import hf_config, hf_model
from test_mtp import HFReferenceMTP, ours

from specquant.cli import main
from specquant.drafter_loader import load_mtp_drafter
from specquant.loader import load_model
from specquant.model.checkpoint import save_model
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafters import kind_of_checkpoint
from specquant.spec_decode.engine import generate

VOCAB = 8192  # the bundled tokenizer's, so the bundled training and held-out text run unchanged
FAST = ["--steps", "3", "--seq-len", "48", "--batch", "2", "--eval-samples", "2", "--eval-seq-len", "48",
        "--save-every", "3", "--eval-every", "0", "--no-progress", "--lr", "3e-3", "--warmup", "1"]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """(fp target without mtp.*, its noised copy standing in for the W4 target) as checkpoint directories."""
    root = tmp_path_factory.mktemp("mtp")
    teacher = ours(hf_model("gva", 4, seed=11, scale=0.35, vocab_size=VOCAB))
    save_model(teacher, root / "teacher", tokenizer_from=TOKENIZER)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    save_model(teacher, root / "student", tokenizer_from=TOKENIZER)
    return root / "teacher", root / "student"


def test_two_stages_resume_and_write_into_the_target(hybrids, tmp_path, capsys):
    teacher, student = hybrids
    out, with_mtp = tmp_path / "run", tmp_path / "student-mtp"
    args = ["distill", "draft", "--kind", "mtp", "--target", str(student), "--stage1-target", str(teacher),
            "--out", str(out), "--mtp-into-target", str(with_mtp), "--mtp-w4", str(tmp_path / "w4"),
            "--mtp-w4-group", "-1", "--mtp-head", "w8", "--json", *FAST, "--stage2-steps", "2"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s1, s2 = result["stages"]
    assert [s1["steps"], s2["steps"]] == [3, 2]
    assert s1["best_eval"]["kl"] < s1["start_eval"]["kl"], "stage 1 did not lower the held-out KL"
    assert {"top1_agree", "top1_agree_2", "top1_agree_3"} <= set(s1["best_eval"])  # --mtp-steps 3: three drafts
    for stage in ("stage1", "stage2"):
        assert kind_of_checkpoint(out / stage / "model").name == "mtp"
    meta = json.loads((out / "stage2" / "model" / "config.json").read_text())["specquant_distill_draft"]
    assert meta["init"].endswith("stage1/model") and meta["target"].endswith("student")
    # stage 2 started from stage 1's layer, not from a fresh one: its step-0 KL is stage 1's best, on its target
    assert s2["start_eval"]["kl"] < s1["start_eval"]["kl"]
    # the copy of the target holds the trained layer under vLLM's names, and --draft mtp drafts with it
    trained = load_mtp_drafter(out / "stage2" / "model")
    target = load_model(with_mtp)
    assert set(target.extra_tensors) == {f"mtp.{k}" for k in trained.state_dict()}
    assert all(torch.equal(target.extra_tensors[f"mtp.{k}"].float(), v) for k, v in trained.state_dict().items())
    eng = build_engine(with_mtp, "mtp", spec=SpecConfig(draft_len=3))
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    assert eng.generate(prompt, 24, stop_on_eos=False).token_ids[0] == \
        generate(load_model(student), prompt, 24, stop_on_eos=False).token_ids[0]
    # the W4 copy: every Linear quantized, drafting through its own w8 head, and still lossless
    w4 = load_mtp_drafter(tmp_path / "w4")
    assert w4.quantization and w4.head_precision == "w8" and (tmp_path / "w4" / "tokenizer.json").exists()
    eng = build_engine(student, str(tmp_path / "w4"), spec=SpecConfig(draft_len=3))
    assert eng.drafter.head is not eng.target.lm_head
    assert eng.generate(prompt, 24, stop_on_eos=False).token_ids[0] == \
        generate(load_model(student), prompt, 24, stop_on_eos=False).token_ids[0]
    before = (out / "stage2" / "model" / "model.safetensors").read_bytes()
    assert main(args + ["--resume"]) == 0  # both stages done: nothing retrained, the copy rewritten
    capsys.readouterr()
    assert (out / "stage2" / "model" / "model.safetensors").read_bytes() == before


def test_a_target_with_mtp_tensors_starts_from_them(hybrids):
    from specquant.train.mtp import starting_mtp

    target = load_model(hybrids[0])
    torch.manual_seed(4)
    ref = HFReferenceMTP(hf_config("gva", 4, vocab_size=VOCAB))
    target.extra_tensors = {f"mtp.{k}": v.detach().clone() for k, v in ref.state_dict().items()
                            if "rotary_emb" not in k}
    mtp = starting_mtp(target, None, seed=0, device="cpu")
    assert all(torch.equal(v, target.extra_tensors[f"mtp.{k}"]) for k, v in mtp.state_dict().items())


def test_mtp_into_target_needs_kind_mtp(hybrids, tmp_path, capsys):
    assert main(["distill", "draft", "--kind", "block", "--target", str(hybrids[0]), "--out", str(tmp_path / "o"),
                 "--mtp-into-target", str(tmp_path / "t"), *FAST]) == 2
    err = capsys.readouterr().err
    assert "--kind mtp" in err and len(err.strip().splitlines()) == 1
