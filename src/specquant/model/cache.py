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
"""

from __future__ import annotations

import abc

import torch
from torch import nn


class Cache(nn.Module, abc.ABC):
    """Base of the layer kinds' caches (the protocol is in the module docstring)."""

    kind: str  # layout()'s name for this kind of cache

    def __init__(self, batch: int, capacity: int):
        super().__init__()
        self.batch, self.capacity = batch, capacity

    @abc.abstractmethod
    def reset(self) -> None: ...

    def begin(self, start: int | None, t: int) -> None:
        """Before a forward of t tokens at start: nothing to do for a cache whose forward is all tensor work."""

    @abc.abstractmethod
    def rollback(self, length: int) -> None: ...

    @abc.abstractmethod
    def fits(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device, window: int | None,
             static: bool, max_block: int | None = None) -> bool: ...

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
        assert start <= self.length, f"write at position {start} leaves a gap after {self.length} cached positions"
        self.length = end
        if self.window is None:
            if end > self.capacity:
                raise ValueError(f"KV cache holds {self.capacity} positions; asked to write up to {end}")
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            return self.k[:, :, :end], self.v[:, :, :end], 0
        if t > self.capacity - self.window + 1:
            raise ValueError(f"block of {t} tokens exceeds the ring cache's block limit")
        slots = torch.arange(start, end, device=k.device) % self.capacity
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        first = self.key_start(start)
        idx = torch.arange(first, end, device=k.device) % self.capacity
        return self.k.index_select(2, idx), self.v.index_select(2, idx), first

    def rollback(self, length: int):
        """Forget positions >= length: nothing to undo, later writes overwrite them."""
        self.length = min(self.length, length)
