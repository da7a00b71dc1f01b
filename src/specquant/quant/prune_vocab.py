"""Target-side vocabulary pruning (`specquant quantize --prune-vocab N`): lossy, opt-in, gated.

The target keeps the token ids < N plus every special / added token of its tokenizer (as the 2nd leaderboard entry
did, ../shared/PEERS.md): its embedding and lm_head keep those rows only, so its logits run over the kept ids. Why:
at 4B the BF16 head is the largest per-token cost left after W4. Unlike a pruned draft head
(spec_decode/drafters/pruned_head.py, lossless) this changes the target's outputs: the kl gate measures it.

Index spaces. The pruned checkpoint is a self-consistent model of vocab_size N' = len(token_ids): index i is the
token `token_ids[i]` of the full vocabulary. With the ids < N kept first and in order, i == token_ids[i] for every
i < N; only the special tokens above N move (to N, N+1, ...). Its tokenizer is rewritten into the same space (the
BPE vocabulary cut to the kept tokens, merges whose parts or result were cut dropped, added tokens renumbered), so
text that needed a cut token is spelled with kept pieces, and vLLM, llama.cpp and our loader read the checkpoint
as any other: nothing there needs the map.

The map. config.json's CONFIG_KEY: {"token_ids": [N'] the full-vocabulary id of each index, ascending,
"full_vocab_size": V, "keep_below": N}. It lives in config.json because it is a property of these weights
(metadata in the checkpoint, never a file name) and every engine ignores keys it does not know. It is read where the
full vocabulary matters: the kl gate against the unpruned baseline (gate/kl.py), a drafter trained on the full
vocabulary (its embedding and head cut to the same rows: `prune_draft_vocab`), and the checks that refuse to
compare a pruned target's tokens with the unpruned one's (`refuse_pruned`).

The row cutting (quant/head.py's `cut_rows`) and the id checks below are shared with the drafter side
(spec_decode/drafters/pruned_head.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specquant.errors import SpecquantError
from specquant.quant.head import cut_rows
from specquant.util.dtypes import parse_dtype

CONFIG_KEY = "pruned_vocab"
ATTRIBUTE = "vocab_map"  # a loaded pruned target's token_ids [N'] (specquant.loader sets it)
# config.json / generation_config.json fields that hold token ids (renumbered into the pruned space)
ID_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


# --- which ids: ids < N plus the specials ------------------------------------------------------------------------



def check_token_ids(token_ids, vocab_size: int) -> torch.Tensor:
    """token_ids as an ascending, duplicate-free int64 tensor of ids < vocab_size, or a SpecquantError."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise SpecquantError("a pruned draft head keeps no token ids; keep at least one (e.g. --keep 4096)")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise SpecquantError(f"pruned draft head ids run {int(ids.min())}..{int(ids.max())}, outside the vocabulary "
                             f"0..{vocab_size - 1}; rebuild the map for this model (specquant distill prune-head)")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise SpecquantError("pruned draft head ids must be ascending and unique; rebuild the map "
                             "(specquant distill prune-head)")
    return ids


def most_frequent(counts: torch.Tensor, n: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The n ids to keep [n] ascending: `always` (e.g. EOS and other special tokens) first, then by count (ties:
    the lower id), from counts [vocab]."""
    vocab = counts.numel()
    if not 1 <= n <= vocab:
        raise SpecquantError(f"keep {n} token ids is out of range; use 1..{vocab} (the vocabulary size)")
    always = sorted({int(t) for t in always if 0 <= int(t) < vocab})
    if len(always) > n:
        raise SpecquantError(f"keep {n} is fewer than the {len(always)} special tokens that are always kept; use a "
                             "larger --keep")
    score = counts.to(torch.float64).clone()
    score[always] = float("inf")
    # stable sort on -score: among equal counts the lower id comes first
    order = torch.sort(-score, stable=True).indices
    return torch.sort(order[:n]).values

def special_ids(tokenizer_dir: Path, hf: dict) -> list[int]:
    """Every added token of tokenizer.json (special or not) and the token ids config.json names."""
    ids = [t["id"] for t in _tokenizer_json(tokenizer_dir).get("added_tokens", [])]
    for key in ID_FIELDS:
        v = hf.get(key)
        ids.extend(v if isinstance(v, list) else [] if v is None else [v])
    return sorted({int(i) for i in ids})


def kept_ids(vocab_size: int, keep_below: int, specials) -> torch.Tensor:
    """The ids [N'] ascending: every id < keep_below, then the specials at or above it."""
    if not 1 <= keep_below < vocab_size:
        raise SpecquantError(f"--prune-vocab {keep_below} keeps nothing out or everything in; use 1..{vocab_size - 1} "
                             f"(the vocabulary has {vocab_size} ids)")
    above = sorted({int(s) for s in specials if keep_below <= int(s) < vocab_size})
    counts = (torch.arange(vocab_size) < keep_below).long()  # most_frequent then keeps them, ties by the lower id
    return most_frequent(counts, keep_below + len(above), always=tuple(above))


# --- the model ------------------------------------------------------------------------------------------------------


@torch.no_grad()
def prune_model(model, token_ids: torch.Tensor, keep_below: int | None = None):
    """A Transformer (dense or with QuantLinear modules, unfused) cut to token_ids [N']: embedding rows, lm_head rows
    (a tied head stays tied), vocab_size and token ids in its config; the map recorded (ATTRIBUTE). Returns model."""
    from specquant.model.modules import Linear

    cfg = model.config
    if getattr(model, ATTRIBUTE, None) is not None:
        raise SpecquantError("this model's vocabulary is already pruned; prune the unpruned checkpoint")
    ids = check_token_ids(token_ids, cfg.vocab_size)
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight if isinstance(model.lm_head, nn.Linear) else False
    new_embed = nn.Embedding(ids.numel(), cfg.hidden_size, device=embed.weight.device, dtype=embed.weight.dtype)
    new_embed.weight.copy_(embed.weight[ids.to(embed.weight.device)])
    new_embed.requires_grad_(embed.weight.requires_grad)
    model.model.embed_tokens = new_embed
    if tied:
        head = Linear(cfg.hidden_size, ids.numel(), bias=False, device=new_embed.weight.device,
                      dtype=new_embed.weight.dtype)
        head.weight = new_embed.weight
        model.lm_head = head
    else:
        model.lm_head = cut_rows(model.lm_head, ids)
    full = cfg.vocab_size
    cfg.vocab_size = ids.numel()
    for key in ("eos_token_id", "bos_token_id"):
        setattr(cfg, key, remap_ids(getattr(cfg, key), ids))
    for key in ID_FIELDS:  # e.g. pad_token_id, which ModelConfig keeps in `extra`
        if cfg.extra.get(key) is not None:
            cfg.extra[key] = remap_ids(cfg.extra[key], ids)
    setattr(model, ATTRIBUTE, ids)
    model.vocab_map_entry = map_entry(ids, full, keep_below)
    return model


def map_entry(token_ids: torch.Tensor, full_vocab_size: int, keep_below: int | None) -> dict:
    return {"token_ids": [int(t) for t in token_ids], "full_vocab_size": int(full_vocab_size),
            "keep_below": None if keep_below is None else int(keep_below)}


def remap_ids(value, token_ids: torch.Tensor):
    """A token id (or list of them, or None) of the full vocabulary -> its index among token_ids."""
    if value is None:
        return None
    index = {int(t): i for i, t in enumerate(token_ids.tolist())}
    if isinstance(value, (list, tuple)):
        return [remap_ids(v, token_ids) for v in value]
    if int(value) not in index:
        raise SpecquantError(f"token id {value} (a special token) is not among the kept ids; keep it (rebuild the "
                             "map with every special token)")
    return index[int(value)]


def prune_checkpoint(src, out, keep_below: int, overwrite: bool = False) -> Path:
    """A checkpoint pruned to the ids < keep_below plus its specials, written as it was: dense, or compressed-tensors
    with its own quantization_config (e.g. a W4 + QAD target, which `quantize` does not take). From an unquantized
    checkpoint, `specquant quantize --prune-vocab N` quantizes and prunes in one go. Returns out."""
    import tempfile

    from specquant.model.checkpoint import load_dense, read_hf_config, resolve, save_model

    src = resolve(src)
    hf = read_hf_config(src)
    ids = check_prunable(src, hf, keep_below)
    dtype = hf.get("torch_dtype") or "float32"
    if hf.get("quantization_config"):
        from specquant.quant.checkpoint import load_quantized_model, save_quantized

        model, save = load_quantized_model(src, hf, parse_dtype(dtype), "cpu"), save_quantized
    else:
        model, save = load_dense(src, dtype=dtype), save_model
    prune_model(model, ids, keep_below)
    with tempfile.TemporaryDirectory() as tmp:
        write_pruned_tokenizer(src, Path(tmp), ids)
        return save(model, out, tokenizer_from=tmp, extra_config={CONFIG_KEY: model.vocab_map_entry},
                    overwrite=overwrite)


def check_prunable(src: Path, hf: dict, keep_below: int) -> torch.Tensor:
    """The kept ids [N'] for checkpoint src (config.json dict hf), every refusal raised before any weight is read."""
    from specquant.model.checkpoint import config_from_hf

    if CONFIG_KEY in hf:
        raise SpecquantError(f"{src} is already vocabulary-pruned; prune the unpruned checkpoint")
    vocab = config_from_hf(hf).vocab_size
    ids = kept_ids(vocab, keep_below, special_ids(src, hf))
    prune_tokenizer(_tokenizer_json(src), ids)  # its refusals (a cut byte token) now, not after quantizing
    return ids


# --- the map in config.json ---------------------------------------------------------------------------------------


def read_vocab_map(hf: dict) -> torch.Tensor | None:
    """The kept ids [N'] of a pruned checkpoint's config.json dict (full-vocabulary ids), or None."""
    text = hf.get("text_config") or {}
    entry = _map_entry(hf)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("token_ids"), list) \
            or not isinstance(entry.get("full_vocab_size"), int):
        raise SpecquantError(f'config.json "{CONFIG_KEY}" must be an object with "token_ids" and '
                             '"full_vocab_size"; prune the unpruned checkpoint again (specquant quantize '
                             "--prune-vocab N)")
    ids = check_token_ids(entry["token_ids"], entry["full_vocab_size"])
    if ids.numel() != hf.get("vocab_size", text.get("vocab_size")):
        raise SpecquantError(f'config.json "{CONFIG_KEY}" keeps {ids.numel()} ids but vocab_size is '
                             f"{hf.get('vocab_size')}; prune the unpruned checkpoint again")
    return ids


def full_vocab_size(hf: dict) -> int | None:
    entry = _map_entry(hf)
    return None if entry is None else int(entry["full_vocab_size"])


def _map_entry(hf: dict):
    """config.json's CONFIG_KEY value, or None; vLLM's Qwen3.5 layout keeps the text model's keys in text_config."""
    return hf.get(CONFIG_KEY, (hf.get("text_config") or {}).get(CONFIG_KEY))


def vocab_map_of(model) -> torch.Tensor | None:
    """A loaded model's kept ids [N'] (set by the loader from config.json), or None when it is not pruned."""
    return getattr(model, ATTRIBUTE, None)


def to_full_vocab(ids: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Indices of a pruned model [...] -> ids of the full vocabulary [...]."""
    return token_ids.to(ids.device)[ids]


def is_pruned(name_or_dir) -> bool:
    from specquant.model.checkpoint import read_hf_config, resolve

    return full_vocab_size(read_hf_config(resolve(name_or_dir))) is not None


def refuse_pruned(name_or_dir, what: str, fix: str):
    """The one-line refusal of a pruned target where a mode claims greedy identity with the unpruned target."""
    if is_pruned(name_or_dir):
        raise SpecquantError(f"{name_or_dir} has a pruned vocabulary (config.json {CONFIG_KEY}), so its tokens differ "
                             f"from the unpruned target's: {what}; {fix}")


# --- a drafter trained on the full vocabulary, for a pruned target ------------------------------------------------


def prune_draft_vocab(draft, target_map: torch.Tensor, target_tokenizer=None, draft_tokenizer=None):
    """A standalone draft Transformer over the full vocabulary, for a pruned target (target_map [N']): a copy of it
    whose embedding and head keep the target's rows (its layers, caches included, are shared with draft, which is
    left as it was for other engines), so it reads and drafts the target's indices. The target still verifies every
    draft, so speculation stays lossless against the pruned target itself. Tokenizers, when given, must agree
    through the map. Returns the copy (or draft itself when it is pruned to this map already)."""
    own = vocab_map_of(draft)
    if own is not None:
        if torch.equal(own.cpu(), target_map.cpu()):
            return draft
        raise SpecquantError("the draft's vocabulary is pruned differently from the target's; use the unpruned "
                             "draft (it is cut to the target's ids when the engine is built)")
    if draft.config.vocab_size <= int(target_map.max()):
        raise SpecquantError(f"draft vocabulary has {draft.config.vocab_size} entries but the pruned target keeps "
                             f"id {int(target_map.max())}; use a draft with the unpruned target's tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None:
        full = draft_tokenizer.get_vocab()
        ids = target_map.tolist()
        for tok, i in sorted(target_tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
            if full.get(tok) != ids[i]:
                raise SpecquantError(f"draft and pruned target tokenizers differ through the map (token {tok!r}: "
                                     f"target index {i} = id {ids[i]}, draft id {full.get(tok)}); use a draft "
                                     "trained with the unpruned target's tokenizer")
    return prune_model(_shallow_copy(draft), target_map)


def retarget_block_draft(draft, target_map: torch.Tensor):
    """A block drafter trained on the unpruned target, for the pruned one (target_map [N']): it reads the target's
    embedding and head, already cut, so only its config moves to the pruned space (vocab_size, mask_token_id). A
    copy (the same layers) is returned; draft stays as it was for other engines."""
    import copy
    import dataclasses

    cfg = draft.config
    if cfg.vocab_size <= int(target_map.max()):
        raise SpecquantError(f"block drafter vocabulary has {cfg.vocab_size} entries but the pruned target keeps id "
                             f"{int(target_map.max())}; use a drafter trained for the unpruned target")
    mask = remap_ids(cfg.mask_token_id, target_map)
    out = copy.copy(draft)
    out._modules = dict(draft._modules)
    out.config = dataclasses.replace(cfg, vocab_size=int(target_map.numel()), mask_token_id=mask)
    return out


def _shallow_copy(model):
    """model and its body as new module objects over the same layers, with their own config: what prune_model
    replaces on the copy (embedding, head, vocab_size) then leaves the original untouched."""
    import copy
    import dataclasses

    out = copy.copy(model)
    out._modules = dict(model._modules)
    out.model = copy.copy(model.model)
    out.model._modules = dict(model.model._modules)
    out.config = dataclasses.replace(model.config, extra=dict(model.config.extra))
    return out


# --- the tokenizer ------------------------------------------------------------------------------------------------


def _tokenizer_json(tokenizer_dir: Path) -> dict:
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise SpecquantError(f"no tokenizer.json in {tokenizer_dir}; a pruned vocabulary needs the fast tokenizer's "
                             "file to cut it the same way")
    return json.loads(path.read_text(encoding="utf-8"))


def _byte_level(tok: dict) -> bool:
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") or [pre]
    return any((s or {}).get("type") == "ByteLevel" for s in steps)


def prune_tokenizer(tok: dict, token_ids: torch.Tensor) -> dict:
    """tokenizer.json (a BPE model) cut to token_ids: kept tokens renumbered to their index, merges dropped unless
    both parts and the result are kept (else BPE could build a cut token), added tokens renumbered."""
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise SpecquantError(f"tokenizer model {model.get('type')!r} cannot be pruned; --prune-vocab needs a BPE "
                             "tokenizer.json")
    index = {int(t): i for i, t in enumerate(token_ids.tolist())}
    vocab = {s: index[i] for s, i in model["vocab"].items() if i in index}
    if _byte_level(tok):  # every byte must stay spellable, or some text would not encode at all
        from tokenizers.pre_tokenizers import ByteLevel

        lost = [c for c in ByteLevel.alphabet() if c in model["vocab"] and c not in vocab]
        if lost:
            need = max(model["vocab"][c] for c in lost) + 1
            raise SpecquantError(f"--prune-vocab would cut {len(lost)} of the 256 byte tokens (e.g. {lost[0]!r} id "
                                 f"{model['vocab'][lost[0]]}); keep at least the ids below {need}")
    merges = []
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    added = []
    for t in tok.get("added_tokens", []):
        if t["id"] in index:
            added.append({**t, "id": index[t["id"]]})
    out = dict(tok, model=dict(model, vocab=vocab, merges=merges), added_tokens=added)
    if out.get("post_processor"):
        out["post_processor"] = _remap_post(out["post_processor"], index)
    return out


def _remap_post(node, index: dict):
    """A post-processor's special-token ids (TemplateProcessing's special_tokens.*.ids) renumbered."""
    if isinstance(node, list):
        return [_remap_post(n, index) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _remap_post(v, index) for k, v in node.items()}
    for spec in (out.get("special_tokens") or {}).values() if isinstance(out.get("special_tokens"), dict) else ():
        if isinstance(spec, dict) and isinstance(spec.get("ids"), list):
            spec["ids"] = [index[int(i)] for i in spec["ids"]]
    return out


def write_pruned_tokenizer(src: Path, dst: Path, token_ids: torch.Tensor):
    """The tokenizer files of src, cut to token_ids, into dst: tokenizer.json, tokenizer_config.json's
    added_tokens_decoder and generation_config.json's ids renumbered; the slow tokenizer's vocab.json / merges.txt
    are not written (they would describe the full vocabulary)."""
    from specquant.model.checkpoint import TOKENIZER_FILES

    src, dst = Path(src), Path(dst)
    index = {int(t): i for i, t in enumerate(token_ids.tolist())}
    (dst / "tokenizer.json").write_text(json.dumps(prune_tokenizer(_tokenizer_json(src), token_ids),
                                                   ensure_ascii=False), encoding="utf-8")
    for name in TOKENIZER_FILES:
        if name in ("tokenizer.json", "vocab.json", "merges.txt") or not (src / name).is_file():
            continue
        text = (src / name).read_text(encoding="utf-8")
        if name == "tokenizer_config.json":
            d = json.loads(text)
            if isinstance(d.get("added_tokens_decoder"), dict):
                d["added_tokens_decoder"] = {str(index[int(k)]): v for k, v in d["added_tokens_decoder"].items()
                                             if int(k) in index}
            text = json.dumps(d, indent=2, ensure_ascii=False) + "\n"
        elif name == "generation_config.json":
            d = json.loads(text)
            for key in ID_FIELDS:
                if key in d:
                    d[key] = remap_ids(d[key], token_ids)
            text = json.dumps(d, indent=2) + "\n"
        (dst / name).write_text(text, encoding="utf-8")
