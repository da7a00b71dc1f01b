"""Checkpoint directories: save -> load round trips (single file, sharded, read by transformers), every load error
naming what is wrong, bundled-name resolution, and atomic saves."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, needs_bundled, random_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from specquant.errors import SpecquantError
from specquant.model import checkpoint
from specquant.model.checkpoint import BUNDLED_DIR, resolve, save_model, state_dict_for_save
from specquant.loader import load_model
from specquant.model.config import ModelConfig

IDS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(IDS)


@pytest.fixture(scope="module")
def model():
    return random_model("qwen2", seed=1)  # untied, with q/k/v biases: every kind of tensor is present


@pytest.fixture
def saved(model, tmp_path) -> Path:
    return save_model(model, tmp_path / "ckpt")


def write_checkpoint(path: Path, hf_config: dict, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    if tensors is not None:
        save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize("model_type,tied", [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_save_load_round_trip(model_type, tied, tmp_path):
    model = random_model(model_type, seed=2, tie_word_embeddings=tied)
    loaded = load_model(save_model(model, tmp_path / "ckpt"))
    # extra (uninterpreted config.json keys) gains torch_dtype and JSON's string dict keys; the rest is equal
    assert dataclasses.replace(loaded.config, extra={}) == dataclasses.replace(model.config, extra={})
    assert set(model.config.extra) <= set(loaded.config.extra)
    assert torch.equal(logits(loaded), logits(model))
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert "lm_head.weight" not in load_file(tmp_path / "ckpt" / "model.safetensors")


def test_transformers_loads_our_checkpoint(model, saved):
    """The directory is a genuine HF checkpoint: transformers reads config and weights, logits agree."""
    hf = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(IDS).logits - logits(model)).abs().max().item() <= 1e-4


def test_bfloat16_save_load(model, tmp_path):
    out = save_model(random_model("qwen2", seed=1).to(torch.bfloat16), tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(out / "model.safetensors")["model.embed_tokens.weight"].dtype == torch.bfloat16
    loaded = load_model(out, dtype="bfloat16")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))


def test_sharded_index_loads(model, tmp_path):
    tensors = state_dict_for_save(model)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    path = write_checkpoint(tmp_path / "sharded", model.config.to_hf())
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(logits(load_model(path)), logits(model))

    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SpecquantError, match="model-00002-of-00002.safetensors"):
        load_model(path)


# --- errors: each a SpecquantError naming the bad thing ----------------------------------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(SpecquantError, match=r"'.*no-such-model' does not exist.*tiny-target"):
        load_model(tmp_path / "no-such-model")


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(SpecquantError, match=r"model\.safetensors' is a file"):
        load_model(f)


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecquantError, match=r"no config\.json in '.*empty'"):
        load_model(tmp_path / "empty")


def test_invalid_config_json(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(SpecquantError, match=r"config\.json is not valid JSON"):
        load_model(saved)


def test_missing_weights(model, tmp_path):
    path = write_checkpoint(tmp_path / "noweights", model.config.to_hf())
    with pytest.raises(SpecquantError, match=r"no model\.safetensors or model\.safetensors\.index\.json in "
                                             r".*noweights"):
        load_model(path)


def test_only_pickle_weights(model, tmp_path):
    path = write_checkpoint(tmp_path / "pickled", model.config.to_hf())
    (path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(SpecquantError, match=r"only pickle weights.*safetensors"):
        load_model(path)


def test_unsupported_model_type(model, tmp_path):
    hf_config = {**model.config.to_hf(), "model_type": "gpt2"}
    path = write_checkpoint(tmp_path / "gpt2", hf_config, state_dict_for_save(model))
    with pytest.raises(SpecquantError, match=r"'gpt2'.*supported: llama, qwen2, qwen3"):
        load_model(path)


def test_missing_tensor(model, tmp_path):
    tensors = state_dict_for_save(model)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    path = write_checkpoint(tmp_path / "missing", model.config.to_hf(), tensors)
    with pytest.raises(SpecquantError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing.*\[128, 64\]"):
        load_model(path)


def test_wrong_shape_tensor(model, tmp_path):
    tensors = state_dict_for_save(model)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)  # one kv head instead of two
    path = write_checkpoint(tmp_path / "shape", model.config.to_hf(), tensors)
    with pytest.raises(SpecquantError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[16, 64\]; "
                                             r"the config implies \[32, 64\]"):
        load_model(path)


def test_unexpected_tensor(model, tmp_path):
    tensors = {**state_dict_for_save(model), "model.layers.0.self_attn.extra.weight": torch.zeros(2)}
    path = write_checkpoint(tmp_path / "extra", model.config.to_hf(), tensors)
    with pytest.raises(SpecquantError, match=r"'model\.layers\.0\.self_attn\.extra\.weight'"):
        load_model(path)


def test_truncated_safetensors(saved):
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpecquantError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(saved)


def test_bad_dtype_string(saved):
    with pytest.raises(SpecquantError, match=r"unsupported dtype 'fp8'; use one of float32, bfloat16, float16"):
        load_model(saved, dtype="fp8")


# --- bundled names ----------------------------------------------------------------------------------------------------

def test_resolve_bundled_name(model, tmp_path, monkeypatch):
    """A bundled name maps to BUNDLED_DIR/<name>, never to a same-named directory in the working directory."""
    monkeypatch.setattr(checkpoint, "BUNDLED_DIR", tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-target").mkdir()  # a decoy in the cwd
    with pytest.raises(SpecquantError, match=r"bundled model 'tiny-target' is missing its files"):
        resolve("tiny-target")
    save_model(model, tmp_path / "models" / "tiny-target")
    assert resolve("tiny-target") == tmp_path / "models" / "tiny-target"
    assert torch.equal(logits(load_model("tiny-target")), logits(model))


@needs_bundled("tiny-target")
def test_resolve_real_bundled_target():
    path = resolve("tiny-target")
    assert path == BUNDLED_DIR / "tiny-target"
    assert ModelConfig.from_hf(json.loads((path / "config.json").read_text())).vocab_size > 0


# --- atomic save ------------------------------------------------------------------------------------------------------

def failing_save_file(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"half a file")  # the crash happens after something was written
    raise RuntimeError("disk full")


def test_failed_save_leaves_no_directory(model, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "save_file", failing_save_file)
    with pytest.raises(RuntimeError, match="disk full"):
        save_model(model, tmp_path / "out" / "ckpt")
    assert list((tmp_path / "out").iterdir()) == []  # neither the checkpoint nor a temp dir is left behind


def test_failed_overwrite_keeps_previous_checkpoint(model, saved, monkeypatch):
    before = logits(load_model(saved))
    monkeypatch.setattr(checkpoint, "save_file", failing_save_file)
    with pytest.raises(RuntimeError, match="disk full"):
        save_model(random_model("qwen2", seed=3), saved)
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]
    assert torch.equal(logits(load_model(saved)), before)
