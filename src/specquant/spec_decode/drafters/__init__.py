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
  cost                        what those forwards are, for the bench's cost model (drafter.COST_MODELS; None: the
                              bench predicts none of its rows)
  model_class                 loaded models of this class are wrapped by this kind (SpecEngine(target, model))
  options, serve_options      its settings' config dataclass (suffix: SuffixConfig, hybrid: HybridConfig) and
                              their defaults under `specquant serve`
  standalone, vllm_method, fixed_draft_len, missing   what export needs (drafter.py)

Settings by kind: DrafterOptions, made from the rows, holds one options instance per kind that has options, keyed
by kind name (a Mapping, and a config dataclass whose flags are every kind's: --suffix-*, --hybrid-*, dests
"suffix.*", "hybrid.*"). generate, serve and bench build it from their flags (util.flags) and hand it to
build_engine as draft_options, which gives it to every kind's build as the engine option `options`; no caller
names a kind's settings. hybrid.py combines suffix.py with any kind that drafts from a model (`--draft
suffix+DRAFT`) and reads its own and the suffix kind's settings there. pruned_head.py is no kind: the
vocabulary-pruned draft head that the block and LM kinds (and any other drafting through a head) share.

A new kind (an n-gram drafter; suffix.py and mtp.py, Qwen3.5's MTP head, are two) is one file with its Drafter
class, its options dataclass if it has settings, and KIND, plus one row below. A model-free drafter proposes
point-mass drafts (Draft.probs None), which the sampling verifier accepts exactly (verify.rejection_sample).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from specquant.errors import SpecquantError
from specquant.spec_decode.drafter import DrafterKind
from specquant.spec_decode.drafters import block, hybrid, lm, mtp, none, suffix

# detect is tried in this order: block and MTP drafters' config.json also name a causal LM model_type
KINDS: dict[str, DrafterKind] = {k.name: k for k in (block.KIND, mtp.KIND, lm.KIND, none.KIND, suffix.KIND,
                                                     hybrid.KIND)}


class _ByKind(Mapping):
    """DrafterOptions as a Mapping: kind name -> that kind's settings."""

    def __getitem__(self, name: str):
        if name not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return iter([f.name for f in dataclasses.fields(self)])

    def __len__(self) -> int:
        return len(dataclasses.fields(self))

    def validate(self):
        for options in self.values():
            options.validate()
        return self


# one field per kind with options, named as the kind, in table order (the flags' order in --help)
DrafterOptions = dataclasses.make_dataclass(
    "DrafterOptions", [(k.name, k.options, dataclasses.field(default_factory=k.options))
                       for k in KINDS.values() if k.options is not None],
    bases=(_ByKind,), namespace={"__doc__": "Every drafter kind's settings, keyed by kind name (module docstring).",
                                 "__module__": __name__})


def drafter_options(given: Mapping | None = None) -> DrafterOptions:
    """Every kind's settings, checked: given's (a DrafterOptions, or a mapping of some kinds' names to their options
    instances, e.g. {"suffix": SuffixConfig(max_draft_len=8)}) and the defaults of the rest."""
    if isinstance(given, DrafterOptions):
        return given.validate()
    given = dict(given or {})
    names = list(DrafterOptions.__dataclass_fields__)
    for name, value in given.items():
        if name not in names:
            raise SpecquantError(f"draft options for {name!r}: no drafter kind with settings is called that; use "
                                 f"{', '.join(names)}")
        cls = KINDS[name].options
        if not isinstance(value, cls):
            raise SpecquantError(f"draft options for {name!r} are a {type(value).__name__}; pass a {cls.__name__}")
    return DrafterOptions(**given).validate()


def serving_options() -> DrafterOptions:
    """Every kind's settings as `specquant serve` defaults them (each row's serve_options, else its defaults)."""
    return DrafterOptions(**{k.name: k.serve_options for k in KINDS.values() if k.serve_options is not None})


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


__all__ = ["KINDS", "DrafterOptions", "drafter_options", "kind_named", "kind_of", "kind_of_checkpoint",
           "kind_of_model", "parse_draft", "serving_options"]
