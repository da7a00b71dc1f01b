"""The prefix cache (opt-in, `specquant serve --prefix-cache`): a request whose prompt starts like an earlier one
continues from the cache state that one left instead of prefilling the shared tokens again.

It stands in for loop.prefill (SpecEngine.stream's `prefill`) and drives the caches only through the model's cache
protocol (model/cache.py snapshot / restore). Each entry is one earlier prompt with, per model that prefills it
(a "track": the target, and an LM drafter):
- `final`: every cache's snapshot at the end of that model's prefill. A full K/V cache's snapshot can be cut to any
  shorter length, so for a dense model this one snapshot serves every shared prefix;
- `points`: snapshots of the caches that cannot be cut (a Qwen3.5 DeltaNet state, a ring) at every multiple of
  `block` tokens: such a model prefills in `block`-token pieces while the prefix cache is on, and a prompt that
  diverges from an earlier one resumes at the last block boundary they share;
- the target's last logits (an identical prompt skips the target's forward entirely) and, for a drafter that reads
  the target's hidden states (the block drafter), those states: its context is rebuilt from them, which costs a
  drafter forward but no target forward. Drafters without a cache (suffix, none) prefill as usual.

Exact: what is restored is the state a prefill of the same tokens left; the remaining tokens run through the same
steps. The entries are an LRU bounded in count and bytes (snapshots live where the caches do, on the device)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specquant.decode.sampling import SamplingConfig, next_token
from specquant.model.cache import Cache, Snapshot
from specquant.spec_decode.drafters.lm import LMDrafter

log = logging.getLogger("specquant.serve")


@dataclass
class TrackState:
    """One model's snapshots in an entry: `final` at `end` positions, `points[p]` (the uncuttable caches') at
    block boundaries p < end; None where a cache has no state (a layer kind without one)."""

    end: int
    final: list[Snapshot | None]
    points: dict[int, list[Snapshot | None]] = field(default_factory=dict)

    def restore_point(self, limit: int) -> int:
        """The longest length <= limit this track's caches can all be restored to (0: none)."""
        if all(s is None or s.cuttable for s in self.final):
            return max(0, min(limit, self.end))
        reachable = [p for p in self.points if p <= limit] + ([self.end] if self.end <= limit else [])
        return max(reachable, default=0)

    def restore(self, caches: list[Cache | None], length: int) -> None:
        for i, cache in enumerate(caches):
            if cache is None:
                continue
            snap = self.final[i]
            if length != self.end and not snap.cuttable:
                snap = self.points[length][i]
            cache.restore(snap, length)

    def nbytes(self) -> int:
        snaps = self.final + [s for p in self.points.values() for s in p]
        return sum(s.nbytes for s in snaps if s is not None)


@dataclass
class Entry:
    tokens: torch.Tensor  # [prompt_len] long, on the CPU
    tracks: dict[str, TrackState]
    logits: torch.Tensor  # [1, vocab]: the target's at the prompt's last position
    hidden: torch.Tensor | None  # [1, prompt_len, layers, hidden] the drafter's taps of the target, or None
    nbytes: int = 0

    def __post_init__(self):
        tensors = [self.logits] + ([self.hidden] if self.hidden is not None else [])
        self.nbytes = (sum(t.nbytes() for t in self.tracks.values())
                       + sum(t.numel() * t.element_size() for t in tensors))

    def common(self, ids: torch.Tensor) -> int:
        """Length of the prefix ids [prompt_len] share with this entry's prompt."""
        n = min(len(ids), len(self.tokens))
        differ = (ids[:n] != self.tokens[:n]).nonzero()
        return int(differ[0]) if len(differ) else n


class Track:
    """A model the prefill drives: its caches, a forward (ids [1, T], start) -> (logits, hidden), and how many
    prompt positions its prefill processes."""

    def __init__(self, name: str, caches: list[Cache | None], forward, end: int):
        self.name, self.caches, self.forward, self.end = name, caches, forward, end
        self.chunked = any(c is not None and not c.snapshot_cuttable for c in caches)

    def run(self, ids: torch.Tensor, start: int, block: int, points: dict) -> tuple:
        """Forward ids [1, prompt_len] positions start..end-1; with uncuttable caches in `block`-token pieces,
        snapshotting them at each boundary into points. -> (last logits or None, hidden pieces)."""
        cuts = [b for b in range(block * (start // block + 1), self.end, block)] if self.chunked else []
        logits, hidden = None, []
        for a, b in zip([start] + cuts, cuts + [self.end]):
            logits, h = self.forward(ids[:, a:b], a)
            if h is not None:
                hidden.append(h)
            if b != self.end:
                points[b] = [None if c is None or c.snapshot_cuttable else c.snapshot(b) for c in self.caches]
        return logits, hidden


class PrefixCache:
    """An LRU of prompt-prefix cache states for one engine (its target model and drafter). `prefill` has
    loop.prefill's signature; `last` holds the last request's lookup (prompt tokens, target tokens restored)."""

    def __init__(self, target_model, max_entries: int, max_bytes: int, block: int, metrics=None):
        self.model, self.max_entries, self.max_bytes, self.block = target_model, max_entries, max_bytes, block
        self.metrics = metrics
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.serial = 0
        self.bytes = 0
        self.last = (0, 0)  # (prompt tokens, target tokens restored) of the last request
        self.last_restored: dict[str, int] = {}  # positions restored per track (target, draft) of the last request
        self.warned = False

    def _supported(self, caches) -> str | None:
        # compiled, AOT-packaged and CUDA-graph steps run over the model's own static buffers (bound by address),
        # which restore writes in place: they need no exception here
        bad = {type(c).__name__ for c in caches if c is not None and type(c).snapshot is Cache.snapshot}
        return f"{', '.join(sorted(bad))} cannot snapshot" if bad else None

    def _tracks(self, target, drafter, plen: int) -> list[Track]:
        layers = drafter.target_layers

        def target_forward(ids, start):
            return target.step(ids, start, last_only=True, hidden_layers=layers)

        tracks = [Track("target", self.model.caches(), target_forward, plen)]
        # an LM drafter prefills all prompt tokens but the last; a window-only prefill shifts its positions, so
        # that one prefills as usual
        if isinstance(drafter, LMDrafter) and not (drafter.window and drafter.window_prefill):
            tracks.append(Track("draft", drafter.model.caches(), lambda ids, start: (
                drafter.step(ids, start, last_only=True), None), plen - 1))
        return tracks

    @torch.no_grad()
    def prefill(self, target, drafter, prompt_ids: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None) -> torch.Tensor:
        """loop.prefill, resuming from the longest stored prefix: prompt_ids [1, L] -> the first new token [1]."""
        from specquant.spec_decode.loop import prefill as plain

        self.last, self.last_restored = (prompt_ids.shape[1], 0), {}
        if prompt_ids.shape[0] != 1:
            return plain(target, drafter, prompt_ids, sampling, generator)
        refusal = self._supported(self.model.caches())
        if refusal:
            if not self.warned:
                log.warning("prefix cache off for this engine: %s", refusal)
                self.warned = True
            return plain(target, drafter, prompt_ids, sampling, generator)
        ids = prompt_ids[0].cpu()
        plen = len(ids)
        tracks = self._tracks(target, drafter, plen)
        entry, lcp = self._lookup(ids)
        full = entry is not None and lcp == plen == len(entry.tokens)  # the same prompt again
        states, starts = {}, {}
        for track in tracks:
            old = entry.tracks.get(track.name) if entry is not None else None
            limit = plen if full and track.name == "target" else min(lcp, plen - 1)
            start = old.restore_point(limit) if old is not None else 0
            if start:
                old.restore(track.caches, start)
            starts[track.name] = start
            # boundaries before the restore point are the same tokens' states: share the old entry's snapshots
            states[track.name] = TrackState(track.end, [], {p: s for p, s in old.points.items() if p <= start}
                                            if old is not None and start else {})
        hidden = []  # the target's hidden states of the prompt, for a drafter that reads them
        if drafter.target_layers and entry is not None and starts["target"]:
            hidden.append(entry.hidden[:, : starts["target"]])
        logits = entry.logits if full else None
        for track in tracks:
            if starts[track.name] < track.end:
                out, pieces = track.run(prompt_ids, starts[track.name], self.block, states[track.name].points)
                if track.name == "target":
                    logits, hidden = out[:, -1], hidden + pieces
            if not full:  # the same prompt again keeps its entry: nothing new to snapshot
                states[track.name].final = [None if c is None else c.snapshot(track.end) for c in track.caches]
        first = next_token(logits, sampling, generator)  # [1]
        hidden = torch.cat(hidden, 1) if drafter.target_layers else None
        if len(tracks) > 1:  # the LM drafter is where its own prefill leaves it
            drafter.offset, drafter.valid = 0, plen - 1
        else:
            drafter.prefill(prompt_ids, hidden)
        self._record(plen, starts["target"])
        self.last_restored = starts
        if full:
            self.entries.move_to_end(next(k for k, e in self.entries.items() if e is entry))
        else:
            self._store(Entry(ids, states, logits.clone(), None if hidden is None else hidden.clone()))
        return first

    def _lookup(self, ids: torch.Tensor) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ids, and that length."""
        best, best_len = None, 0
        for entry in self.entries.values():
            n = entry.common(ids)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def _store(self, entry: Entry) -> None:
        if entry.nbytes > self.max_bytes:
            return  # it alone would exceed the budget
        self.serial += 1
        self.entries[self.serial] = entry
        self.bytes += entry.nbytes
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        if self.metrics is not None:
            self.metrics.prefix_entries.set(len(self.entries))
            self.metrics.prefix_bytes.set(self.bytes)

    def _record(self, prompt_tokens: int, restored: int) -> None:
        self.last = (prompt_tokens, restored)
        if self.metrics is not None:
            self.metrics.prefix_queries.inc(prompt_tokens)
            self.metrics.prefix_hits.inc(restored)
            self.metrics.prefix_requests.labels("hit" if restored else "miss").inc()
