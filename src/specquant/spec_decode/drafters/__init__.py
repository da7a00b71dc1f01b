"""Drafter kinds: one file per kind, one row per kind in KINDS. The engine, the CLI, bench and export read a
kind from here; nothing else matches kind names.

A kind is a `DrafterKind` (spec_decode/drafter.py) named KIND in its file:
  name / title                what `--draft NAME` and reports call it
  detect(hf_config) -> bool   its checkpoints, recognised from config.json (checked in table order)
  load(name_or_dir, runtime)  the draft model from a checkpoint (RuntimeConfig: dtype, device, W4 activations);
                              None for a kind without one (needs_checkpoint=False: `--draft NAME` builds it)
  build(model, target, spec, **engine_options) -> Drafter   the object the loop calls (drafter.py's protocol:
                              target_layers, max_draft_len, check_request, setup, prefill, propose, accept,
                              rollback); engine_options are compile, graphs, aot, target_tokenizer,
                              draft_tokenizer; take what you need, accept the rest as **kwargs
  forwards_per_step(k)        drafter forwards in a step that drafts k tokens (lm: k, block: 1, none: 0)
  model_class                 loaded models of this class are wrapped by this kind (SpecEngine(target, model))
  standalone, vllm_method, fixed_draft_len, missing   what export needs (drafter.py)

Engine options a kind may read besides SpecEngine's: suffix_config (SuffixConfig) and hybrid_config (HybridConfig),
from build_engine. hybrid.py combines suffix.py with any kind that drafts from a model (`--draft suffix+DRAFT`).
pruned_head.py is no kind: the vocabulary-pruned draft head that the block and LM kinds (and any other drafting
through a head) share.

A new kind (an n-gram drafter; suffix.py and mtp.py, Qwen3.5's MTP head, are two) is one file with its Drafter
class and KIND, plus one row below. A model-free drafter proposes point-mass drafts (Draft.probs None), which the
sampling verifier accepts exactly (verify.rejection_sample).
"""

from __future__ import annotations

import os

from specquant.errors import SpecquantError
from specquant.spec_decode.drafter import DrafterKind
from specquant.spec_decode.drafters import block, hybrid, lm, mtp, none, suffix

# detect is tried in this order: block and MTP drafters' config.json also name a causal LM model_type
KINDS: dict[str, DrafterKind] = {k.name: k for k in (block.KIND, mtp.KIND, lm.KIND, none.KIND, suffix.KIND,
                                                     hybrid.KIND)}


def kind_named(name: str) -> DrafterKind:
    kind = KINDS.get(name.lower())
    if kind is None:
        raise SpecquantError(f"drafter kind {name!r} is unknown; use one of {', '.join(KINDS)}")
    return kind


def kind_of(hf: dict) -> DrafterKind:
    """The kind of a draft checkpoint, from its config.json."""
    for kind in KINDS.values():
        if kind.detect(hf):
            return kind
    raise SpecquantError(f"draft model_type {hf.get('model_type')!r} (architectures {hf.get('architectures')}) is "
                         f"none of the drafter kinds {', '.join(k.name for k in KINDS.values() if k.needs_checkpoint)}"
                         "; pass a causal LM of a supported model_type or a DFlashDraftModel checkpoint")


def kind_of_checkpoint(name_or_dir: str | os.PathLike) -> DrafterKind:
    from specquant.model.checkpoint import read_hf_config, resolve

    return kind_of(read_hf_config(resolve(name_or_dir)))


def kind_of_model(model) -> DrafterKind:
    """The kind that wraps an already loaded draft model."""
    for kind in KINDS.values():
        if kind.model_class is not None and isinstance(model, kind.model_class):
            return kind
    raise SpecquantError(f"a {type(model).__name__} is not a draft model of any drafter kind "
                         f"({', '.join(KINDS)}); pass a Drafter, a Transformer or a BlockDraftModel")


def parse_draft(value: str | None) -> tuple[DrafterKind, str | None]:
    """`--draft` -> (kind, checkpoint or None): a kind name without a checkpoint (none), a bundled name or a
    directory (its kind from config.json), or `suffix+DRAFT` (the hybrid kind; "checkpoint" is then DRAFT, which
    its load parses as --draft). None means none."""
    from specquant.model.checkpoint import BUNDLED, resolve

    if value is None:
        return KINDS["none"], None
    inner = hybrid.split(value)
    if inner is not None:
        kind, _ = parse_draft(inner)  # checked before anything loads
        if kind.forwards_per_step(1) == 0 or kind is KINDS["hybrid"]:
            raise SpecquantError(f"the hybrid drafter's second drafter {inner!r} is a {kind.title}, which drafts "
                                 "from no model; pass a block or LM draft checkpoint (e.g. suffix+tiny-block-draft)")
        return KINDS["hybrid"], inner
    kind = KINDS.get(value.lower())
    if kind is not None:
        if kind.needs_checkpoint:
            raise SpecquantError(f"drafter kind {value!r} needs a checkpoint; pass its directory or a bundled name "
                                 f"({', '.join(BUNDLED)})")
        return kind, None
    if value not in BUNDLED and not os.path.exists(os.path.expanduser(value)):
        raise SpecquantError(f"draft {value!r} is not a checkpoint directory, a bundled model ({', '.join(BUNDLED)}) "
                             f"or a drafter kind ({', '.join(k.name for k in KINDS.values() if not k.needs_checkpoint)})")
    return kind_of_checkpoint(resolve(value)), value


__all__ = ["KINDS", "kind_named", "kind_of", "kind_of_checkpoint", "kind_of_model", "parse_draft"]
