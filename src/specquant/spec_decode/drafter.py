"""The drafter interface: what the speculative loop (spec_decode/loop.py) asks of any draft source.

Positions and lengths. The committed sequence is the prompt plus every emitted token. Its last token was emitted
by the previous verify step and no model has processed it yet; the target's cache holds every earlier position.
A drafter sees the committed sequence, proposes k tokens to follow it, and after verification is told how many
positions are final (`accept`); it rolls its own state back to that length (`rollback`), whatever it is (a KV
cache, a ring buffer, a recurrent state).

One request, in the loop's order (shapes [batch, ...]; the loop runs batch 1 today, nothing here assumes it):
  1. `setup(batch, max_len)` before each request: allocate state for up to max_len positions (reuse it when it
     is big enough).
  2. `prefill(prompt_ids [B, L], target_hidden [B, L, len(target_layers), H] | None)`: the prompt, and the
     target's hidden states of every prompt position (taken from the target's prefill forward, no extra forward).
  3. Each step: `propose(tokens [B, n], k, sampling, generator) -> Draft` with up to k tokens following tokens
     (fewer is allowed, e.g. a confidence stop; 0 when k is 0). In sampling mode Draft.probs holds the
     distribution each token was drawn from (the verifier needs it); greedy drafters may leave it None.
  4. The target scores [tokens[n-1], draft...] in one forward; `verify` keeps `accepted` draft tokens and adds
     one recovered or bonus token.
  5. `accept(n + accepted, target_hidden [B, accepted + 1, len(target_layers), H] | None)`: positions
     0 .. n+accepted-1 are final and processed by the target (tokens[n-1] and the accepted drafts); target_hidden
     are the target's hidden states at exactly those accepted + 1 new positions, sliced from the verify forward.
     The drafter rolls its state back to n + accepted and appends what it keeps of target_hidden.

target_hidden (and the logits) may be views of buffers the next forward overwrites (CUDA-graph steps,
decode/graphs.py): a drafter copies what it keeps. A drafter's own fixed-shape forward (a block drafter's block)
can be captured the same way with decode.graphs.StepGraph.

`target_layers` declares which target decoder layers' outputs (0-based ids) the drafter reads; the target's
prefill and verify forwards return exactly those (`Transformer.forward(..., hidden_layers=ids)`), at no cost when
the tuple is empty. The LM drafter (drafters/lm.py) reads none: `target_layers = ()`, target_hidden is None.

How a DFlash-style block drafter (Chen et al. 2025) plugs in — no change to the loop, the verifier or the target:
  * `target_layers = (1, 4, 7)` (say): the layers whose hidden states condition it.
  * `prefill`: project the prompt's target_hidden [B, L, 3, H] (concatenated over layers, through its fc layer)
    into its own context K/V for positions 0..L-1.
  * `propose`: one forward over the block [tokens[n-1], mask, ..., mask] (block_size positions) attending to the
    context K/V, returning its argmax (or samples and probs) at the block_size - 1 mask positions: up to
    block_size - 1 draft tokens from ONE forward; it ignores k beyond block_size - 1. Its block positions are
    scratch and never enter the context.
  * `accept(length, target_hidden)`: its context holds only target-verified positions, so `rollback(length)`
    has nothing to undo; it projects target_hidden (T = accepted + 1 positions) into context positions
    length - T .. length - 1. Its context always equals the target's verified prefix.
The engine sizes the target cache with `SpecConfig.longest_draft`; a block drafter sets draft_len to
block_size - 1. Nothing in the loop refers to a particular drafter kind.

Three optional members besides the protocol's (the engine reads them when present): `max_draft_len` (the most tokens
one propose returns; absent or None: whatever k asks; 0 for the none drafter, whose steps are then plain one-token
decode steps), `check_request(prompt_len, max_new_tokens)`, which raises a SpecquantError when a request does
not fit the drafter (its own context), and `propose_tree(tokens [B, n], nodes, depth, sampling, generator) ->
Draft` with parents: a draft tree of at most `nodes` tokens, none deeper than `depth` (SpecConfig.tree_nodes;
spec_decode/tree.py says what its probs must be in sampling mode). A tree drafter's accept gets the target's hidden
states along the accepted path, as for a chain.

Later uses this interface already allows: `specquant serve` streams each step's tokens from `SpecEngine.stream`;
batch > 1 with drafts needs per-row accepted counts in `verify` and `accept(lengths [B])`, not a new protocol
(steps without drafts already run any batch).

Kinds of drafter (spec_decode/drafters/): a `DrafterKind` row per kind says how to recognise its checkpoint, load
it, build the Drafter, what its settings are and what one step costs; drafters/__init__.py holds the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError


@dataclass
class Draft:
    tokens: torch.Tensor  # [batch, k] int64, k >= 0
    probs: torch.Tensor | None = None  # [batch, k, vocab] float32: each token's draft distribution (sampling mode)
    # a draft tree (spec_decode/tree.py): token i's parent node, 0 the root (the last committed token), j + 1 token j
    # (parents[i] <= i); None: a chain
    parents: tuple[int, ...] | None = None

    @classmethod
    def empty(cls, batch: int, device) -> "Draft":
        return cls(torch.empty(batch, 0, dtype=torch.long, device=device))


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for the target to verify. See the module docstring for the call order."""

    target_layers: tuple[int, ...]  # target decoder layers whose hidden states it reads; () for none

    def setup(self, batch: int, max_len: int) -> None:
        """Make room for sequences of up to max_len positions (reusing state that is big enough)."""

    def prefill(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        """prompt_ids [B, L]; target_hidden [B, L, len(target_layers), H] of every prompt position, or None."""

    def propose(self, tokens: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        """Up to k tokens to follow tokens [B, n] (the committed sequence)."""

    def accept(self, length: int, target_hidden: torch.Tensor | None) -> None:
        """Positions < length are final; target_hidden [B, T, len(target_layers), H] belongs to the last T of them."""

    def rollback(self, length: int) -> None:
        """Forget every position >= length."""


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter: a row of the table in spec_decode/drafters/__init__.py (each kind is one file there).

    detect(hf_config) -> bool: whether a checkpoint's config.json is of this kind (never its name).
    load(name_or_dir, runtime: RuntimeConfig) -> the loaded draft model (None for a kind without a checkpoint).
    build(model, target, spec: SpecConfig, **engine options) -> Drafter; model is what load returned (or a
      model the caller loaded itself, an instance of model_class); the options are SpecEngine's: compile,
      graphs, aot, target_tokenizer, draft_tokenizer, and `options`, every kind's settings keyed by kind name
      (drafters.DrafterOptions; a kind reads its own with options_in, a kind built of others its parts' too); a
      kind uses the ones it needs and ignores the rest.
    forwards_per_step(k) -> drafter forwards in one step that drafts k tokens (the bench's cost model).
    options: the config dataclass of its settings (defaults, checks, help), or None for a kind without any. Its
      fields' flags (metadata "flag": --NAME-...) are the kind's command-line flags, their dests "NAME.field"
      (drafters.DrafterOptions holds one per kind); serve_options: an instance of it with what a server changes.
    cost: what a drafting step's cost is made of, for the bench's cost model (bench/ablation.py times each):
      COST_MODELS' keys, or None for a kind whose steps it does not predict (no model forward, or a mix).
    """

    name: str  # what --draft and reports call it
    title: str  # for prose: "LM drafter"
    detect: Callable[[dict], bool]
    load: Callable[..., Any]
    build: Callable[..., Drafter]
    forwards_per_step: Callable[[int], int]
    needs_checkpoint: bool = True  # False: `--draft NAME` alone builds it (no directory)
    model_class: type | None = None  # loaded models of this class are wrapped by this kind
    # a whole causal LM with its own embeddings and head: its vocabulary must equal the target's, and it runs its
    # own tensor-parallel layout in a serving engine
    standalone: bool = False
    vllm_method: str | None = None  # vLLM's --speculative-config method; None: vLLM cannot run this kind
    # (hf_config) -> vLLM's num_speculative_tokens when the checkpoint fixes it (a block's size - 1); None: the flag
    fixed_draft_len: Callable[[dict], int | None] = lambda hf: None
    # (hf_config) -> the config.json fields an export needs and this one lacks (none: [])
    missing: Callable[[dict], list[str]] = lambda hf: []
    options: type | None = None  # its settings' config dataclass (None: it has none)
    serve_options: Any = None  # an `options` instance: its settings' defaults under `specquant serve` (None: options')
    cost: str | None = None  # a key of COST_MODELS (None: not predicted)

    def __post_init__(self):
        if self.cost is not None and self.cost not in COST_MODELS:
            raise SpecquantError(f"drafter kind {self.name!r}: cost {self.cost!r} is unknown; use one of "
                                 f"{', '.join(COST_MODELS)} or None (not predicted)")
        if self.serve_options is not None and not isinstance(self.serve_options, self.options or ()):
            raise SpecquantError(f"drafter kind {self.name!r}: serve_options is a {type(self.serve_options).__name__}"
                                 f"; give an instance of its options class ({getattr(self.options, '__name__', None)})")

    def options_in(self, options: Mapping[str, Any] | None) -> Any:
        """This kind's settings in options (kind name -> settings, as build gets them), its options class's
        defaults when absent."""
        own = options.get(self.name) if options is not None else None
        return own if own is not None else self.options()


# What one drafting step of a kind costs, by the `cost` of its row; bench/ablation.py times the forwards each names
COST_MODELS = {
    "decoder": "forwards_per_step(k) one-token forwards of its own decoder, with its own KV cache (the LM drafter)",
    "block": "one forward for the whole draft whatever k, plus its accept projecting the accepted rows' target "
             "features (the block drafter)",
    "head": "forwards_per_step(k) forwards of one layer over the target's hidden state and embeddings, through a "
            "head (the MTP drafter)",
}


def check_vocab(target_vocab: int, draft_vocab: int, target_tokenizer=None, draft_tokenizer=None):
    """Draft and target must share one vocabulary: the same size and, when tokenizers are given, the same text
    for every id."""
    if target_vocab != draft_vocab:
        raise SpecquantError(
            f"draft vocabulary has {draft_vocab} entries, target has {target_vocab}; the draft must share the "
            "target's tokenizer"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if t_vocab != d_vocab:
            diff = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])
            tok, idx = diff[0]
            raise SpecquantError(
                f"draft and target tokenizers differ (e.g. token {tok!r} / id {idx}); use a draft trained with the "
                "target's tokenizer"
            )
