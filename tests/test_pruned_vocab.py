"""Target-side vocabulary pruning (specquant/quant/prune_vocab.py, `specquant quantize --prune-vocab N`): the map, the
cut model against the full model's kept logits, the cut tokenizer, drafters over the full vocabulary, the kl gate,
the refusals, and the exports (vLLM layout, GGUF token list; llama.cpp itself in tests/test_export_llama_cpp.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import BUNDLED_DIR, load_tokenizer, read_hf_config
from specquant.quant.prune_vocab import (ATTRIBUTE, CONFIG_KEY, kept_ids, prune_checkpoint, prune_tokenizer,
                                    read_vocab_map, vocab_map_of)

HELDOUT = BUNDLED_DIR.parent / "data" / "heldout.txt"
TEXT = ("The quick brown fox jumps over the lazy dog. Photosynthesis converts sunlight into chemical energy, "
        "and café naïve 日本語 😀 survive a cut vocabulary.")


def _quantize(out, model="tiny-target", keep=4096, *extra):
    assert main(["quantize", "--model", model, "--out", str(out), "--method", "rtn", "--prune-vocab", str(keep),
                 "--json", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    base = tmp_path_factory.mktemp("pruned")
    assert main(["quantize", "--model", "tiny-target", "--out", str(base / "w4"), "--method", "rtn", "--json"]) == 0
    return {"w4": base / "w4", "pruned": _quantize(base / "p4096")}


# --- the map -----------------------------------------------------------------------------------------------------


def test_kept_ids_are_the_ids_below_n_then_the_specials_above_it():
    ids = kept_ids(100, 10, [0, 3, 97, 99, 150])
    assert ids.tolist() == [*range(10), 97, 99]  # 150 is outside the vocabulary: ignored
    with pytest.raises(SpecquantError, match="--prune-vocab 100 .* use 1..99"):
        kept_ids(100, 100, [])
    with pytest.raises(SpecquantError, match="--prune-vocab 0"):
        kept_ids(100, 0, [])


def test_quantize_writes_the_map_and_a_consistent_checkpoint(pruned):
    hf = read_hf_config(pruned["pruned"])
    entry = hf[CONFIG_KEY]
    assert hf["vocab_size"] == 4096 and entry["full_vocab_size"] == 8192 and entry["keep_below"] == 4096
    assert entry["token_ids"] == list(range(4096))  # the bundled specials are ids 0..3: nothing moves
    assert hf["eos_token_id"] == 0 and hf["quantization_config"]["specquant"]["prune_vocab"] == 4096
    model = load_model(pruned["pruned"])
    assert model.model.embed_tokens.weight.shape == (4096, model.config.hidden_size)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the bundled head is tied: still tied
    assert torch.equal(vocab_map_of(model), torch.arange(4096))
    assert getattr(load_model(pruned["w4"]), ATTRIBUTE, None) is None


def test_pruned_logits_are_the_full_models_logits_at_the_kept_ids(pruned):
    """The reference path: the unpruned W4 model's logits, then the kept columns (same tokens, all kept)."""
    full, cut = load_model(pruned["w4"]), load_model(pruned["pruned"])
    kept = vocab_map_of(cut)
    tokens = torch.randint(0, 4096, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(cut(tokens), full(kept[tokens])[..., kept], rtol=0, atol=1e-5)


def test_the_cut_tokenizer_spells_any_text_with_kept_ids(pruned):
    full, cut = load_tokenizer("tiny-target"), load_tokenizer(pruned["pruned"])
    text = TEXT + HELDOUT.read_text()[:4000]
    ids = cut.encode(text)
    assert len(cut) == 4096 and max(ids) < 4096 and cut.decode(ids) == text
    assert max(full.encode(text)) >= 4096  # the text needs cut tokens in the full vocabulary
    assert len(ids) > len(full.encode(text))  # ... which the cut tokenizer spells with more, kept, pieces
    assert not (pruned["pruned"] / "vocab.json").exists()  # no stale slow-tokenizer files


def _bpe_with_specials_at_the_end():
    """A byte-level BPE tokenizer.json whose special tokens sit above the regular ids (as Qwen's do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([HELDOUT.read_text()[:20000]], trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>"])
    return tok


def test_specials_above_n_move_to_n_and_text_round_trips():
    from tokenizers import Tokenizer

    tok = _bpe_with_specials_at_the_end()
    vocab = tok.get_vocab_size()
    specials = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_start|>")]
    assert min(specials) >= 400
    ids = kept_ids(vocab, 400, specials)
    cut = Tokenizer.from_str(json.dumps(prune_tokenizer(json.loads(tok.to_str()), ids)))
    assert cut.get_vocab_size() == 402
    assert cut.token_to_id("<|endoftext|>") == 400 and cut.token_to_id("<|im_start|>") == 401
    text = HELDOUT.read_text()[:3000]
    enc = cut.encode(text + "<|endoftext|>").ids
    assert max(enc) == 400 and cut.decode(enc[:-1]) == text
    assert all(ids[i] == tok.token_to_id(cut.id_to_token(i)) for i in range(402))  # the map is the tokenizer's
    with pytest.raises(SpecquantError, match="byte tokens .* keep at least the ids below"):
        prune_tokenizer(json.loads(tok.to_str()), kept_ids(vocab, 100, specials))


def test_refusals_name_the_value(tmp_path, pruned, capsys):
    assert main(["quantize", "--model", "tiny-target", "--out", str(tmp_path / "x"), "--method", "rtn",
                 "--prune-vocab", "8192"]) != 0
    assert "--prune-vocab 8192" in capsys.readouterr().err and not (tmp_path / "x").exists()
    with pytest.raises(SpecquantError, match="already vocabulary-pruned|already quantized"):
        prune_checkpoint(pruned["pruned"], tmp_path / "y", 1024)
    hf = read_hf_config(pruned["pruned"])
    with pytest.raises(SpecquantError, match="keeps 4096 ids but vocab_size is 4095"):
        read_vocab_map({**hf, "vocab_size": 4095})


# --- dense, other heads, the hybrid --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-target", "tiny-hybrid"])
def test_dense_pruning_keeps_the_full_logits_at_the_kept_ids(tmp_path, name):
    out = prune_checkpoint(name, tmp_path / "p", 6144)
    full, cut = load_model(name), load_model(out)
    kept = vocab_map_of(cut)
    assert cut.config.vocab_size == kept.numel() == 6144
    tokens = torch.randint(0, 6144, (1, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(cut(tokens), full(tokens)[..., kept], rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", ["w8", "bf16"])
def test_a_quantized_or_bf16_head_is_cut_in_its_own_precision(tmp_path, head):
    base = tmp_path / "full"
    assert main(["quantize", "--model", "tiny-target", "--out", str(base), "--method", "rtn", "--lm-head", head,
                 "--json"]) == 0
    out = _quantize(tmp_path / "cut", "tiny-target", 4096, "--lm-head", head)
    full, cut = load_model(base), load_model(out)
    assert type(cut.lm_head) is type(full.lm_head) and cut.lm_head.out_features == 4096
    tokens = torch.randint(0, 4096, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(cut(tokens), full(tokens)[..., :4096], rtol=0, atol=1e-5)


def test_pruning_a_w4_checkpoint_equals_quantize_with_prune_vocab(tmp_path, pruned):
    """prune_checkpoint on the W4 checkpoint (e.g. a QAD target) writes what quantize --prune-vocab writes."""
    out = prune_checkpoint(pruned["w4"], tmp_path / "w4-cut", 4096)
    a, b = load_model(out), load_model(pruned["pruned"])
    assert read_hf_config(out)["quantization_config"]["config_groups"] == \
        read_hf_config(pruned["pruned"])["quantization_config"]["config_groups"]
    tokens = torch.randint(0, 4096, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(a(tokens), b(tokens))


def test_hybrid_w4_prunes_and_generates(tmp_path):
    from specquant.spec_decode.engine import generate

    out = _quantize(tmp_path / "h", "tiny-hybrid", 4096)
    model = load_model(out)
    ids = torch.tensor([load_tokenizer(out).encode(TEXT)])
    res = generate(model, ids, 12, stop_on_eos=False)
    assert len(res.token_ids[0]) == 12 and max(res.token_ids[0]) < 4096


# --- drafters over the full vocabulary ----------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["tiny-draft", "tiny-block-draft"])
def test_full_vocabulary_drafters_are_lossless_against_the_pruned_target(pruned, draft):
    from specquant.spec_decode.build import build_engine
    from specquant.spec_decode.drafters import KINDS, parse_draft
    from specquant.spec_decode.runtime import RuntimeConfig

    ids = torch.tensor([load_tokenizer(pruned["pruned"]).encode(TEXT)])
    alone = build_engine(pruned["pruned"]).generate(ids, 32, stop_on_eos=False)
    kind, source = parse_draft(draft)
    model = kind.load(source, RuntimeConfig())
    engine = build_engine(pruned["pruned"], model)
    spec = engine.generate(ids, 32, stop_on_eos=False)
    assert spec.token_ids == alone.token_ids
    assert spec.spec.num_accepted_tokens > 0  # the cut drafter still drafts what the target says
    assert model.config.vocab_size == 8192  # the caller's draft model is left whole (a copy was cut)
    assert KINDS


def test_a_differently_pruned_draft_is_refused(pruned, tmp_path):
    from specquant.spec_decode.build import build_engine

    other = prune_checkpoint("tiny-draft", tmp_path / "d", 2048)
    with pytest.raises(SpecquantError, match="pruned differently"):
        build_engine(pruned["pruned"], other)


# --- the kl gate ---------------------------------------------------------------------------------------------------


def test_compare_over_every_id_equals_the_plain_compare():
    """With every id kept the pruned path is the plain one: the same KL, perplexities and top-1, no lost mass."""
    from conftest import random_model
    from specquant.quant.quality import compare

    ref, model = random_model(seed=0, vocab_size=512), random_model(seed=1, vocab_size=512)
    tokens = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(3))
    plain = compare(ref, model, tokens, 2)
    cut = compare(ref, model, tokens, 2, kept=torch.arange(512))
    assert cut.pop("lost_mass") == pytest.approx(0.0, abs=1e-6)
    for key in ("kl", "ppl", "ppl_ref", "top1_agree", "samples"):
        assert cut[key] == pytest.approx(plain[key], rel=1e-5), key
    torch.testing.assert_close(cut["nll_tokens"], plain["nll_tokens"])


def test_kl_gate_shows_the_loss_of_a_pruned_target(pruned):
    import dataclasses

    from specquant.gate.config import GateConfig
    from specquant.gate.kl import kl_gate

    cfg = dataclasses.replace(GateConfig(), kl_samples=4, kl_seq_len=64)
    stats, rows = kl_gate(str(pruned["pruned"]), "tiny-target", cfg)
    assert stats["lost_mass"] > 0.01  # half the vocabulary cut: the baseline's mass on it is counted as lost
    lost = next(r for r in rows if r.metric == "lost_mass")
    assert not lost.passed and stats["kl"] >= 0
    w4_stats, w4_rows = kl_gate(str(pruned["w4"]), "tiny-target", cfg)
    assert "lost_mass" not in w4_stats and all(r.metric != "lost_mass" for r in w4_rows)  # unpruned: as before
    with pytest.raises(SpecquantError, match="baseline .* is vocabulary-pruned too; compare with the unpruned"):
        kl_gate(str(pruned["pruned"]), str(pruned["pruned"]), cfg)


# --- refusals of lossless claims, exports ---------------------------------------------------------------------


def test_bench_refuses_a_pruned_target_among_the_rows_compared_with_the_unpruned(pruned):
    from specquant.bench.prepare import check_inputs

    with pytest.raises(SpecquantError, match="pruned vocabulary .* compared with the unpruned target"):
        check_inputs("tiny-target", "tiny-draft", quantized_target=str(pruned["pruned"]))
    check_inputs("tiny-target", "tiny-draft", quantized_target=str(pruned["w4"]))


def test_vllm_export_of_a_pruned_target_loads_and_refuses_an_unpruned_lm_draft(tmp_path, pruned):
    from specquant.export.config import ExportConfig
    from specquant.export.vllm import export_vllm

    out = tmp_path / "vllm"
    export_vllm(str(pruned["pruned"]), None, out, ExportConfig(engine="vllm"))
    hf = read_hf_config(out / "target")
    assert hf["vocab_size"] == 4096 and CONFIG_KEY in hf and len(load_tokenizer(out / "target")) == 4096
    model = load_model(out / "target")
    assert model.model.embed_tokens.weight.shape[0] == 4096 and vocab_map_of(model) is not None
    with pytest.raises(SpecquantError, match="prune the draft the same way .*--prune-vocab 4096"):
        export_vllm(str(pruned["pruned"]), "tiny-draft", tmp_path / "v2", ExportConfig(engine="vllm"))


def test_transformers_reads_a_pruned_dense_checkpoint_as_ours(tmp_path):
    """vLLM's and transformers' own loader see a plain model of vocab_size N' (the map is a key they ignore)."""
    from transformers import AutoModelForCausalLM

    out = prune_checkpoint("tiny-target", tmp_path / "p", 4096)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()
    ours = load_model(out)
    tokens = torch.tensor([load_tokenizer(out).encode(TEXT)])
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["tiny-target", "tiny-hybrid"])
def test_gguf_token_list_matches_the_cut_embedding(tmp_path, pruned, name):
    gguf = pytest.importorskip("gguf")
    from specquant.export.gguf import source_from_checkpoint, write_gguf

    ckpt = pruned["pruned"] if name == "tiny-target" else _quantize(tmp_path / "h", name, 4096)
    report = write_gguf(source_from_checkpoint(ckpt), tmp_path / "p.gguf")
    assert report["max_abs_error_quantized"] == 0.0
    reader = gguf.GGUFReader(tmp_path / "p.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert len(tokens) == 4096 == int(embd.shape[-1])
    cut = load_tokenizer(ckpt)
    assert tokens[:8] == [cut.convert_ids_to_tokens(i) for i in range(8)]


def test_specquant_gate_kl_fails_a_pruned_target_on_its_lost_mass_unless_allowed(tmp_path, pruned, capsys):
    small = ["--kl-samples", "4", "--kl-seq-len", "64", "--json"]
    argv = ["gate", "--model", str(pruned["pruned"]), "--baseline", "tiny-target", "--tasks", "kl"]
    assert main([*argv, "--out", str(tmp_path / "a"), *small]) == 1
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [g["metric"] for g in res["gates"]] == ["kl", "ppl_ratio", "top1_agree", "lost_mass"]
    assert [g["passed"] for g in res["gates"]][-1] is False and res["kl"]["lost_mass"] > 0.05
    allowed = tmp_path / "thr.json"
    allowed.write_text(json.dumps({"kl": {"max_kl": 0.05, "min_top1": 0.9, "max_lost_mass": 0.5}}))
    assert main([*argv, "--out", str(tmp_path / "b"), "--thresholds", str(allowed), *small]) == 0
