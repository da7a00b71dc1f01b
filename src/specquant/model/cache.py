"""Per-layer decode state: the protocol every layer kind's cache implements, and attention's K/V cache.

The model owns its caches, as mlx-lm's do: each mixer (a layer kind's token-mixing module, model/layers.py) makes
its own (`mixer.make_cache(batch, capacity, dtype, device, window, static)`), `Transformer.setup_cache` installs
them as `mixer.cache`, and everything else drives them through the Transformer's methods (caches, setup_cache,
reset_cache, rollback, clear_cache, cache_layout, cache_batch, cache_capacity). Nothing outside model/ knows what a
cache holds.

The cache protocol (`Cache`):
- A cache is an nn.Module whose tensors are registered, non-persistent buffers: AOT packages bind them by name, CUDA
  graphs by address, so a cache keeps its buffers for its whole life and writes them in place.
- `batch`, `capacity`: the sequences and positions it was made for (a ring's capacity is its slot count; a state
  that does not grow with the sequence records the capacity it was asked for).
- `reset()`: a new sequence in the same buffers.
- `begin(start, t)`: optional (the default does nothing): the Python bookkeeping of a static-cache forward of t
  tokens at start (None: where the cache is), run eagerly before it, by the layer itself on an eager forward and
  by `Transformer.begin_step` before a compiled / packaged / captured step, so the step itself is tensor work
  only (a recurrent layer's record offsets, model/deltanet.py).
- `rollback(length)`: keep positions < length, the single entry point for going back. The caller only rolls back to
  a length it has seen the model reach (for a ring, at most max_block - 1 positions before the end of what it
  wrote). A K/V cache only records the length: entries past it are overwritten before they are read. A state that
  is not indexed by position (a recurrent layer's) must become the state after position length - 1 there: it may
  keep the per-position states of its last forward (which saw the positions: start_pos, or input_pos on the static
  path) and restore one in rollback, and raise when asked to go back further than it kept. A target's verify is one
  forward, then one rollback into it; an LM drafter rolls back over its last k one-token forwards. Rollback runs
  eagerly, between steps, also when the steps are AOT packages or CUDA graphs, so a restore writes the buffers in
  place.
- `fits(batch, capacity, dtype, device, window, static, max_block=None) -> bool`: whether a request asking for
  this layout (max_block: the longest forward it may roll back into) may reuse the buffers (`setup_cache` then calls `reset` instead of allocating; compiled steps stay bound to them).
- `layout() -> dict`: JSON-able description of the buffers (kind, batch, capacity, settings, every buffer's shape and
  dtype; not the device). A cache made on the meta device has the same layout, which is how an AOT key describes the
  caches before they exist (Transformer.cache_layout).
- `snapshot(length=None) -> Snapshot`: a copy of the state after the `length` positions processed (serve's prefix
  cache keeps it across requests). The caller passes the length it has reached (a static K/V cache keeps no
  count); a state that cannot be cut refuses any other. `restore(snapshot, length=None)` makes the cache hold the
  state after `length` positions of it (default: all), writing the buffers in place. A state indexed by position
  (a full K/V cache) can be cut: restore takes any length up to the snapshot's (`Snapshot.cuttable`;
  `snapshot_cuttable` says so before snapshotting). One that is not (a recurrent state, a ring) restores only the
  length it was taken at, so a caller that wants earlier restore points snapshots there.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class Snapshot:
    """One cache's state after `length` positions: tensors copied off its buffers (never views of them)."""

    kind: str
    length: int
    cuttable: bool  # restore may take any length <= length (the state is indexed by position)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def check(self, kind: str, length: int) -> None:
        """Refuse a snapshot of another cache kind, or a length it cannot be restored to."""
        if self.kind != kind:
            raise ValueError(f"a {self.kind} snapshot cannot restore a {kind} cache")
        if not (length == self.length or (self.cuttable and 0 <= length < self.length)):
            allowed = f"0..{self.length}" if self.cuttable else str(self.length)
            raise ValueError(f"{kind} snapshot of {self.length} positions restores length {allowed}, not {length}")


class Cache(nn.Module, abc.ABC):
    """Base of the layer kinds' caches (the protocol is in the module docstring)."""

    kind: str  # layout()'s name for this kind of cache
    snapshot_cuttable = False  # whether snapshot() gives a Snapshot restorable at any shorter length
    # Plain values a step sets (positions, flags; a kind adds its own), stored straight in the instance dict:
    # nn.Module.__setattr__ first checks whether each value is a Parameter, Buffer or Module (about 4 us a set with
    # torch 2.13), and a decode step sets several per layer (a sixth of a tiny hybrid's step, measured)
    PLAIN: frozenset = frozenset({"length"})

    def __init__(self, batch: int, capacity: int):
        super().__init__()
        self.batch, self.capacity = batch, capacity

    def __setattr__(self, name: str, value):
        if name in self.PLAIN:
            self.__dict__[name] = value  # where nn.Module.__setattr__ puts a plain value, after its checks
        else:
            super().__setattr__(name, value)

    @abc.abstractmethod
    def reset(self) -> None: ...

    def begin(self, start: int | None, t: int) -> None:
        """Before a forward of t tokens at start: nothing to do for a cache whose forward is all tensor work."""

    @abc.abstractmethod
    def rollback(self, length: int) -> None: ...

    @abc.abstractmethod
    def fits(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device, window: int | None,
             static: bool, max_block: int | None = None) -> bool: ...

    def commit_tree(self, start: int, path: list[int]) -> None:
        """After a tree forward of nodes at positions start + depth (model/tree.py): keep the nodes on `path` (the
        root and its accepted descendants, in order) as positions start .. start + len(path) - 1, and forget the
        rest of the tree."""
        raise NotImplementedError(f"{type(self).__name__} cannot verify a token tree")

    # not abstract: a cache kind without them still decodes; only serve's prefix cache needs them (and says so)
    def snapshot(self, length: int | None = None) -> Snapshot:
        raise NotImplementedError(f"{type(self).__name__} cannot snapshot its state")

    def restore(self, snapshot: Snapshot, length: int | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot restore a snapshot")

    def layout(self) -> dict:
        """Kind, batch, capacity and every buffer's [shape, dtype]; subclasses add the settings their code reads."""
        return {"kind": self.kind, "batch": self.batch, "capacity": self.capacity,
                "buffers": {n: [list(b.shape), str(b.dtype)] for n, b in self.named_buffers()}}

    def _same_device(self, device: torch.device) -> bool:
        """Whether the buffers live on `device` (an index-free device such as "cuda" matches any of its kind)."""
        here = next(self.buffers()).device
        return here.type == device.type and (device.index is None or here == device)


class KVCache(Cache):
    """Per-layer static K/V buffers [batch, kv_heads, capacity, head_dim]; full (slot = position) or ring.

    With window=W the cache is a ring: position p lives in slot p % capacity and a query sees only (p-W, p].
    """

    kind = "kv"

    def __init__(self, batch, kv_heads, capacity, head_dim, dtype, device, window: int | None, static: bool = False):
        super().__init__(batch, capacity)
        shape = (batch, kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.window = window
        self.static = static
        self.length = 0  # positions written and not rolled back (sliced path; the static path takes tensors)
        self.tree_kv = None  # (k, v) of the last tree forward's nodes, until commit_tree (begin_tree)
        if static:  # which position each slot holds (-1: empty); lets attention run over the whole buffer
            self.register_buffer("slot_pos", torch.full((capacity,), -1, dtype=torch.long, device=device),
                                 persistent=False)

    def fits(self, batch: int, capacity: int, dtype, device: torch.device, window: int | None, static: bool,
             max_block: int | None = None) -> bool:
        """Whether a request needing this layout can reuse these buffers (a full cache may be larger than needed;
        a ring's max_block is in its capacity)."""
        enough = self.capacity >= capacity if window is None else self.capacity == capacity
        return (self.batch == batch and self.k.dtype == dtype and self._same_device(device) and self.window == window
                and self.static == static and enough)

    def layout(self) -> dict:
        return {**super().layout(), "window": self.window, "static": self.static}

    def reset(self):
        """Start a new sequence in the same buffers (stale K/V are overwritten before they are read)."""
        self.length = 0
        if self.static:
            self.slot_pos.fill_(-1)

    def update_static(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Shape-static variant for compiled steps: input_pos [T] (tensor, so no recompiles per position).

        Writes slot = position % capacity and returns the whole buffer with a [T, capacity] mask built from
        slot_pos: causal, inside the window, and never an empty slot. Stale slots past a rollback hold later
        positions, which the causal test masks out.
        """
        slots = input_pos % self.capacity
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        self.slot_pos.index_copy_(0, slots, input_pos)
        kpos, qpos = self.slot_pos[None, :], input_pos[:, None]
        mask = (kpos >= 0) & (kpos <= qpos)
        if self.window is not None:
            mask &= kpos > qpos - self.window
        return self.k, self.v, mask

    def claim(self, start: int, t: int) -> None:
        """Record a write of t positions at start (the caller writes them: update, or a native layer step,
        model/native_layer.py), after checking that it leaves no gap and fits: a full cache's capacity, a ring's
        block limit."""
        end = start + t
        assert start <= self.length, f"write at position {start} leaves a gap after {self.length} cached positions"
        if self.window is None and end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; asked to write up to {end}")
        if self.window is not None and t > self.capacity - self.window + 1:
            raise ValueError(f"block of {t} tokens exceeds the ring cache's block limit")
        self.length = end

    def key_start(self, start: int) -> int:
        """Position of the first key `update(start, ...)` returns: 0, or the window's start for a ring."""
        return 0 if self.window is None else max(0, start - self.window + 1)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [batch, kv_heads, T, head_dim] at positions start..start+T-1.

        Returns (keys, values, first_key_position): the keys a query at start..start+T-1 may need, in position
        order, starting at first_key_position.
        """
        t = k.shape[2]
        end = start + t
        self.claim(start, t)
        if self.window is None:
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            return self.k[:, :, :end], self.v[:, :, :end], 0
        slots = torch.arange(start, end, device=k.device) % self.capacity
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        first = self.key_start(start)
        idx = torch.arange(first, end, device=k.device) % self.capacity
        return self.k.index_select(2, idx), self.v.index_select(2, idx), first

    def rollback(self, length: int):
        """Forget positions >= length: nothing to undo, later writes overwrite them."""
        self.length = min(self.length, length)

    def begin_tree(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A tree forward at start with every node's k, v [batch, kv_heads, N, head_dim]: kept until
        commit_tree picks the accepted path. Full sliced caches only (a ring's slots and a static cache's mask
        follow positions, which a tree's branches share)."""
        if self.window is not None or self.static:
            raise ValueError("a token tree is verified on a full, sliced K/V cache (no window, not static)")
        assert start <= self.length, f"tree at position {start} leaves a gap after {self.length} cached positions"
        if start + k.shape[2] > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; a tree of {k.shape[2]} nodes at {start} "
                             "does not fit")
        self.length = start
        self.tree_kv = (k, v)

    def commit_tree(self, start: int, path: list[int]) -> None:
        k, v = self.tree_kv
        idx = torch.tensor(path, device=k.device)
        end = start + len(path)
        self.k[:, :, start:end] = k.index_select(2, idx)
        self.v[:, :, start:end] = v.index_select(2, idx)
        self.length, self.tree_kv = end, None

    @property
    def snapshot_cuttable(self) -> bool:
        return self.window is None  # a ring's slots hold whichever positions last wrote them

    def snapshot(self, length: int | None = None) -> Snapshot:
        """The K/V of positions < length (default: those written; the static path keeps no count, so its caller
        says); a ring (and its slot map) whole, restorable only at that length."""
        n = self.length if length is None else length
        if self.window is None:
            if n > self.capacity:
                raise ValueError(f"K/V cache holds {self.capacity} positions; asked to snapshot {n}")
            return Snapshot(self.kind, n, True, {"k": self.k[:, :, :n].clone(), "v": self.v[:, :, :n].clone()})
        tensors = {"k": self.k.clone(), "v": self.v.clone()}
        if self.static:
            tensors["slot_pos"] = self.slot_pos.clone()
        return Snapshot(self.kind, n, False, tensors)

    def restore(self, snapshot: Snapshot, length: int | None = None) -> None:
        """Hold the snapshot's first `length` positions (default: all) in these buffers."""
        n = snapshot.length if length is None else length
        snapshot.check(self.kind, n)
        k, v = snapshot.tensors["k"], snapshot.tensors["v"]
        if self.window is None:
            if n > self.capacity or k.shape[:2] != self.k.shape[:2] or k.shape[3:] != self.k.shape[3:]:
                raise ValueError(f"K/V snapshot {list(k.shape)} does not fit this cache {list(self.k.shape)}")
            self.k[:, :, :n].copy_(k[:, :, :n])
            self.v[:, :, :n].copy_(v[:, :, :n])
            if self.static:  # slot = position in a full cache
                self.slot_pos.fill_(-1)
                self.slot_pos[:n].copy_(torch.arange(n, device=self.slot_pos.device))
        else:
            if k.shape != self.k.shape or self.static != ("slot_pos" in snapshot.tensors):
                raise ValueError(f"ring snapshot {list(k.shape)} does not fit this ring {list(self.k.shape)}")
            self.k.copy_(k)
            self.v.copy_(v)
            if self.static:
                self.slot_pos.copy_(snapshot.tensors["slot_pos"])
        self.length = n
