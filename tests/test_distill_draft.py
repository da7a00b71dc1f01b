"""`specquant distill draft`: block and lm drafters on the shared trainer, two stages, resume, bad input."""

import json
import shutil

import pytest
import torch
from _qad_models import write_pair, write_teacher

from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.drafter_loader import load_block_draft
from specquant.spec_decode.drafters import kind_of_checkpoint
from specquant.loader import load_model
from specquant.model.checkpoint import save_model
from specquant.train.draft import DraftConfig

FAST = ["--steps", "3", "--seq-len", "48", "--batch", "2", "--eval-samples", "2", "--eval-seq-len", "48",
        "--save-every", "3", "--eval-every", "0", "--no-progress", "--num-anchors", "4"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("draft"), num_hidden_layers=4)


def test_block_two_stages_then_resume_is_a_no_op(pair, tmp_path, capsys):
    teacher, student = pair
    out = tmp_path / "run"
    args = ["distill", "draft", "--kind", "block", "--target", str(student), "--stage1-target", str(teacher),
            "--out", str(out), "--layers", "1", "--block-size", "4", "--json", *FAST, "--stage2-steps", "2"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["stage"] for s in result["stages"]] == ["stage1", "stage2"]
    assert [s["steps"] for s in result["stages"]] == [3, 2]  # stage 2: its own, shorter schedule
    assert result["stages"][0]["target"].endswith("teacher") and result["stages"][1]["target"].endswith("student")
    for stage in ("stage1", "stage2"):
        assert kind_of_checkpoint(out / stage / "model").name == "block"
    d2 = load_block_draft(out / "stage2" / "model")
    assert d2.config.block_size == 4 and d2.config.target_layer_ids == [1, 2]  # spread over 4 target layers
    assert d2.config.num_hidden_layers == 1
    # stage 2 started from stage 1's weights (not a fresh init) and then trained: both differ from a fresh init
    log2 = [json.loads(ln) for ln in (out / "stage2" / "log.jsonl").read_text().splitlines()]
    assert json.loads((out / "stage2" / "model" / "config.json").read_text())["specquant_distill_draft"]["init"] \
        .endswith("stage1/model")
    assert any(r.get("event") == "train_start" for r in log2)
    before = (out / "stage2" / "model" / "model.safetensors").read_bytes()
    assert main(args + ["--resume"]) == 0  # both stages complete: nothing left to train, nothing rewritten
    capsys.readouterr()
    assert (out / "stage2" / "model" / "model.safetensors").read_bytes() == before


def test_lm_kind_adapts_a_small_lm_by_kl(pair, tmp_path, capsys):
    teacher, _ = pair
    draft = tmp_path / "lm"
    save_model(load_model(write_teacher(tmp_path / "d0", seed=3, num_hidden_layers=1)), draft,
               tokenizer_from=teacher)
    out = tmp_path / "run"
    assert main(["distill", "draft", "--kind", "lm", "--target", str(teacher), "--init", str(draft),
                 "--out", str(out), "--lr", "3e-3", "--json", *FAST]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    st = result["stages"][0]
    assert st["best_eval"]["kl"] <= st["start_eval"]["kl"]
    assert kind_of_checkpoint(out / "model").name == "lm"
    assert load_model(out / "model").config.num_hidden_layers == 1


def test_bad_input_is_one_line(pair, tmp_path, capsys):
    teacher, _ = pair
    assert main(["distill", "draft", "--kind", "block", "--target", str(teacher), "--out", str(tmp_path / "o"),
                 "--data", str(tmp_path / "missing.txt"), *FAST]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["distill", "draft", "--kind", "lm", "--target", str(teacher), "--out", str(tmp_path / "o"),
                 *FAST]) == 2
    assert "--init" in capsys.readouterr().err


def test_default_layer_ids_spread():
    from specquant.model.config import ModelConfig

    dense = lambda n: ModelConfig(num_hidden_layers=n)  # noqa: E731
    assert DraftConfig().layer_ids(dense(8)) == [1, 3, 4, 6]
    assert DraftConfig().layer_ids(dense(36)) == [1, 12, 23, 34]
    assert DraftConfig(target_layer_ids="2,5").layer_ids(dense(8)) == [2, 5]


def test_resume_at_the_last_step_evaluates_and_exports(pair, tmp_path, capsys):
    """The shared trainer: a run stopped at a checkpoint and resumed with --steps lowered to that step (to end it
    there) has nothing left to train; its weights are still evaluated and, being better than the best so far,
    exported to model/."""
    teacher, _ = pair
    out = tmp_path / "run"
    args = ["distill", "draft", "--kind", "block", "--target", str(teacher), "--out", str(out), "--layers", "1",
            "--block-size", "4", "--lr", "1e-2", "--warmup", "1", "--keep-checkpoints", "3", *FAST]
    assert main([*args, "--steps", "4", "--save-every", "2"]) == 0
    # the state of a run killed right after its step-2 checkpoint: no later checkpoint, no export since step 0
    shutil.rmtree(out / "checkpoints" / "step-0000004")
    shutil.rmtree(out / "model")
    assert main([*args, "--steps", "2", "--resume"]) == 0
    capsys.readouterr()
    evals = [e for e in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if e.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 2]
    assert evals[1]["loss"] < evals[0]["loss"], "training did not lower the held-out loss; the test proves nothing"
    assert evals[1]["best_step"] == 2
    assert (out / "model" / "model.safetensors").exists()


def test_block_init_from_target_copies_its_last_layers(pair):
    from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel
    from specquant.train.draft import init_block_drafter

    target = load_model(pair[0])
    cfg = BlockDraftConfig.for_target(target.config, num_hidden_layers=2, block_size=4, target_layer_ids=[0, 2],
                                      mask_token_id=1)
    drafter = BlockDraftModel(cfg)
    init_block_drafter(drafter, target, seed=0, mode="target")
    for i, src in ((0, 2), (1, 3)):
        mine, theirs = drafter.layers[i].state_dict(), target.model.layers[src].state_dict()
        assert all(torch.equal(mine[k], theirs[k].float()) for k in mine)
    h = cfg.hidden_size
    assert torch.equal(drafter.fc.weight[:, -h:], torch.eye(h))  # the last tap (layer 2) passes through
    assert torch.equal(drafter.hidden_norm.weight, target.model.layers[3].input_layernorm.weight.float())
    with pytest.raises(SpecquantError, match="fewer --layers"):
        init_block_drafter(BlockDraftModel(BlockDraftConfig.for_target(
            target.config, num_hidden_layers=5, block_size=4, target_layer_ids=[0, 2], mask_token_id=1)),
            target, seed=0, mode="target")
