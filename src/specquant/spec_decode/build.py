"""build_engine: the one place an engine is assembled from checkpoints (directories or bundled names) or loaded
models. `specquant generate`, the gates and bench call it; a server will too."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from specquant.model.decoder import Transformer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.spec_decode.drafter import Drafter
from specquant.spec_decode.drafters import drafter_options, kind_of_model, parse_draft
from specquant.spec_decode.engine import SpecEngine


def build_engine(target: str | os.PathLike | Transformer, draft=None, runtime: RuntimeConfig | None = None,
                 spec: SpecConfig | None = None, target_tokenizer=None, draft_tokenizer=None,
                 profile: bool = False, graphs: bool = False,
                 draft_options: Mapping | None = None) -> SpecEngine:
    """A SpecEngine for target and draft.

    target: a checkpoint (loaded with runtime's dtype, device and W4 activations, projections fused) or a loaded
    Transformer. draft: None or "none" (target only), another drafter kind name that needs no checkpoint, a draft
    checkpoint (its kind from config.json: spec_decode/drafters/), a loaded draft model, or a Drafter.
    Tokenizers are loaded from the checkpoints when not given and the draft's kind checks vocabularies
    (standalone kinds: the LM drafter). draft_options: the drafter kinds' settings by kind name (a
    drafters.DrafterOptions, as generate and serve build it from their flags, or a mapping of some kinds' names to
    their options, e.g. {"suffix": SuffixConfig(...)}; the defaults of the rest), checked before anything loads;
    the draft's kind reads its own (drafters/__init__.py).

    A drafter with `own_draft_len` (suffix, hybrid) sets the loop's k itself: the engine runs
    draft_len = own_draft_len without the adaptive controller, which it replaces with its own rule
    (suffix_drafter.py, drafters/hybrid.py say why); spec as given still reaches the kind's build."""
    from specquant.loader import load_model
    from specquant.model.checkpoint import load_tokenizer, resolve

    runtime = (runtime or RuntimeConfig()).validate()
    spec = (spec or SpecConfig()).validate()
    options = drafter_options(draft_options)
    target_path = resolve(target) if not isinstance(target, Transformer) else None
    source, kind = None, None
    if draft is None or isinstance(draft, (str, os.PathLike)):
        kind, source = parse_draft(None if draft is None else str(draft))  # every input is checked before loading
        draft = None  # loaded below when the kind has a checkpoint
    elif not isinstance(draft, Drafter):  # a loaded draft model (a Drafter is used as it is)
        kind = kind_of_model(draft)
    if target_path is not None:
        target = load_model(target_path, runtime.dtype, runtime.device, fuse=True,
                            w4_activations=runtime.w4_activations)
    if source is not None:
        draft = kind.load(source, runtime)
    engine_options = dict(compile=runtime.compile, graphs=graphs, aot=runtime.step_aot)
    if kind is not None:
        brought = getattr(draft, "draft_tokenizer", None)  # a hybrid's LM drafter came with its tokenizer
        if (kind.standalone and source is not None) or brought is not None:
            draft_tokenizer = draft_tokenizer or brought or load_tokenizer(source)
            target_tokenizer = target_tokenizer or (load_tokenizer(target_path) if target_path else None)
        draft = kind.build(draft, target, spec, target_tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer,
                           options=options, **engine_options)
    own = getattr(draft, "own_draft_len", None)
    if own:
        spec = dataclasses.replace(spec, draft_len=own, adaptive=False).validate()
    return SpecEngine(target, draft, spec, profile=profile, **engine_options)
