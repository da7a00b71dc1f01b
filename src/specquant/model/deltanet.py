"""Gated DeltaNet: Qwen3.5's linear-attention mixer, and its cache (recurrent + conv state, exact rollback).

Module names mirror transformers' Qwen3_5GatedDeltaNet (`linear_attn.{in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a, conv1d, A_log, dt_bias, norm, out_proj}`), so HF state dicts load as they are. Per token, x after
input_layernorm:
    qkv = causal depthwise conv (kernel linear_conv_kernel_dim) of in_proj_qkv(x), SiLU; channels q | k | v
    q, k L2-normalised per key head; beta = sigmoid(in_proj_b x); g = -e^{A_log} softplus(in_proj_a x + dt_bias)
    o = gated delta rule (model/gated_delta.py), fp32 state [value_heads, K, V]
    y = out_proj(GatedRMSNorm(o, gate=in_proj_z x)), per value head

Cache contract (the decoder's, for a state that cannot be rolled back by moving a length): a forward at start_pos
continues from the state after start_pos positions. rollback(L) makes the state the one after L positions, exactly
(up to float rounding), with no second forward, for any L back to the cache's anchor: the state it holds at some
earlier position `start`, with the rank-1 factors (gated_delta's docstring) and pre-conv inputs of every token
since. Forwards append to that record while it holds at most max_block tokens; the cache re-anchors at the current
state (dropping what is older) when a forward would overflow it, and at the first forward after a rollback (a
caller never goes back past a position it rolled back to and then wrote from). So a target's verify (one forward,
one rollback) and an LM drafter's catch-up plus k-1 one-token drafts (several forwards, one rollback) both roll
back exactly. A forward longer than max_block (a prefill) keeps no factors: it rolls back to its start or to 0
only. A forward at start_pos < length rolls back to start_pos first, so callers that rewrite K/V caches by
position work unchanged.

Each forward is two halves: `DeltaNetCache.begin(start, T)` does the Python bookkeeping (implicit rollback,
re-anchoring, where in the record this forward's tokens go) and `write(...)` stores its tensors. On a static cache
the write is tensor operations only, at an offset held in a device buffer, so the forward is shape- and
position-static and can be traced (torch.compile, AOTInductor) or captured (CUDA graphs): the mixer runs `begin`
itself when called with a start_pos alone, and a compiled / packaged / captured step's caller runs it eagerly
before the step (`Transformer.begin_step`), as it runs `rollback` eagerly after.

Fast and reference forms (GatedDeltaNet.fast, default True): the fast forward keeps fp32 from the causal conv
(fp32 multiply-adds, not oneDNN's depthwise conv) through the rule to the gated norm and rounds once, to x's dtype,
at the norm's output; the reference (fast=False) rounds where transformers does (the conv and the rule's output in
x's dtype) and runs gated_delta.recurrent_rule for one token instead of step_rule. Why: a bf16 model otherwise pays
casts and bf16 elementwise ops (CPUs have no bf16 elementwise arithmetic: each op converts to fp32 and back) on
every small tensor of a decode step, and the state and the rule are fp32 anyway. Tests compare the two forms in
fp32 and bf16.

Memory of the rollback record per token and layer at the Qwen3.5-4B shape: 24.1 KiB of fp32 factors (see
gated_delta.py) plus conv_dim = 8192 pre-conv inputs in the activation dtype (16 KiB bf16, 32 KiB fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specquant.kernels import ops
from specquant.model.cache import Cache, Snapshot
from specquant.model.modules import Linear
from specquant.model.gated_delta import (DEFAULT_CHUNK, L2_EPS, gated_delta_rule, l2_normalize, native_rule,
                                         state_after, zero_state)
from specquant.model.norms import GatedRMSNorm
from specquant.model.tree import TreeLayout

DEFAULT_MAX_BLOCK = 64  # longest forward a cache can roll back into (Transformer.setup_cache's max_block default)


def replay(state0: torch.Tensor, keys: torch.Tensor, delta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The state after the tokens whose factors are given (keys [batch, j, key_heads, K], delta [batch, j,
    value_heads, V], g [batch, j, value_heads]), from state0: on the native path the stepped state bit for bit
    (the factors came from ops.delta_step: gated_delta_rule's same test), else gated_delta.state_after."""
    if keys.shape[1] == 0:
        return state0
    if native_rule(delta.shape[-1], state0, keys, delta, g):
        return ops.delta_replay(state0, keys, delta, g)
    return state_after(state0, keys, delta, g, keys.shape[1])


class DeltaNetCache(Cache):
    """Recurrent state [batch, value_heads, K, V] fp32 and conv state [batch, kernel-1, conv_dim], plus the rollback
    record since the anchor, as non-persistent buffers (a module, as KVCache is, so .to() moves them). The record's
    buffers hold max_block tokens and are written in place. static: the state and conv state are fixed buffers too,
    updated in place (for compiled / graph-captured steps); otherwise they are rebound, never copied (the anchor
    state is simply kept)."""

    kind = "deltanet"
    PLAIN = frozenset({"length", "start", "block", "has_factors", "rolled_back", "at", "tree_record"})

    def __init__(self, batch: int, capacity: int, dtype, device, window: int | None, static: bool, *,
                 key_heads: int, key_dim: int, value_heads: int, value_dim: int, kernel: int,
                 max_block: int = DEFAULT_MAX_BLOCK):
        super().__init__(batch, capacity)
        self.dtype, self._device = dtype, torch.device(device)
        self.window, self.static, self.max_block = window, static, max_block  # window: unused (no positions held)
        self.key_heads, self.key_dim, self.value_heads, self.value_dim = key_heads, key_dim, value_heads, value_dim
        self.kernel = kernel
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        f32 = dict(dtype=torch.float32, device=device)
        buffers = dict(  # the record: conv state at the anchor then the pre-conv inputs, and per-token factors
            hist=torch.zeros(batch, kernel - 1 + max_block, self.conv_dim, dtype=dtype, device=device),
            keys=torch.zeros(batch, max_block, key_heads, key_dim, **f32),
            delta=torch.zeros(batch, max_block, value_heads, value_dim, **f32),
            g=torch.zeros(batch, max_block, value_heads, **f32),
            state=None, state0=None, conv=None,
            offset=torch.zeros(1, dtype=torch.long, device=device))  # the record slot of the next write (static)
        if static:
            buffers.update(state=self._zeros_state(), state0=self._zeros_state(),
                           conv=torch.zeros(batch, kernel - 1, self.conv_dim, dtype=dtype, device=device))
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=False)
        self.reset()

    @property
    def device(self) -> torch.device:  # where the buffers are now (.to() may have moved them)
        return self.hist.device

    def _zeros_state(self) -> torch.Tensor:
        return zero_state(self.batch, self.key_dim, self.value_heads, self.value_dim, self._device)

    def reset(self):
        """Start a new sequence: zero state, anchored at position 0."""
        self.length = 0  # positions processed and not rolled back
        self.start = 0  # the anchor: the position state0 is the state before
        self.block = 0  # tokens recorded since the anchor (positions start .. start + block - 1)
        self.has_factors = True  # the record holds every token's factors (False after a forward > max_block)
        self.rolled_back = False  # a rollback since the last forward: the next forward re-anchors
        self.at = 0  # record slot of the forward begin() announced last
        self.tree_record = None  # the last tree forward's inputs and factors, until commit_tree (keep_tree)
        if self.static:
            for t in (self.state, self.state0, self.conv):
                t.zero_()
        else:
            self.state = self.state0 = zero_state(self.batch, self.key_dim, self.value_heads, self.value_dim,
                                                  self.device)
            self.conv = torch.zeros(self.batch, self.kernel - 1, self.conv_dim, dtype=self.dtype, device=self.device)
        self.hist[:, : self.kernel - 1].zero_()

    def fits(self, batch: int, capacity: int, dtype, device, window: int | None, static: bool,
             max_block: int | None = None) -> bool:
        """Whether a request with this layout can reuse this cache. Capacity and window do not matter: the state
        has the same size at every position."""
        return (self.batch == batch and self.dtype == dtype and self._same_device(torch.device(device))
                and self.static == static and (max_block is None or self.max_block >= max_block))

    def layout(self) -> dict:
        record = self.max_block
        return {
            "kind": self.kind, "static": self.static, "max_block": self.max_block,
            "state": [self.batch, self.value_heads, self.key_dim, self.value_dim], "state_dtype": "float32",
            "conv": [self.batch, self.kernel - 1, self.conv_dim], "conv_dtype": str(self.dtype).removeprefix("torch."),
            "record": {"keys": [self.batch, record, self.key_heads, self.key_dim],
                       "delta": [self.batch, record, self.value_heads, self.value_dim],
                       "g": [self.batch, record, self.value_heads], "dtype": "float32",
                       "pre_conv": [self.batch, self.kernel - 1 + record, self.conv_dim]},
            "offset": [1],
        }

    def _set(self, name: str, value: torch.Tensor):
        if self.static:
            getattr(self, name).copy_(value)
        else:  # rebind the registered buffer, as nn.Module.__setattr__ would after its checks (Cache.PLAIN says why)
            self._buffers[name] = value

    def begin(self, start: int | None, t: int):
        """Announce a forward of t tokens at position start (None: where the cache is), before it runs: a start
        before the current length rolls back there first; the record re-anchors at the current state when the
        forward is the first after a rollback, follows one that kept no factors, keeps none itself (t > max_block)
        or would overflow it. Eager Python, also between compiled / captured steps (which cannot run it)."""
        start = self.length if start is None else start
        if start < self.length:
            self.rollback(start)
        assert start == self.length, f"forward at {start} leaves a gap after {self.length} positions"
        record = t <= self.max_block
        if self.rolled_back or not self.has_factors or not record or self.block + t > self.max_block:
            self._set("state0", self.state)  # re-anchor at the state before this forward
            self.hist[:, : self.kernel - 1].copy_(self.conv)
            self.start, self.block, self.has_factors = self.length, 0, record
        self.at = self.block
        if self.static:
            self.offset.fill_(self.block)
        self.block += t
        self.length += t
        self.rolled_back = False

    def write(self, hist: torch.Tensor, state: torch.Tensor, keys=None, delta=None, g=None):
        """Store the forward begin() announced: hist [batch, kernel-1+T, conv_dim] (conv state before, then the T
        pre-conv inputs), the state after it; keys [batch, T, key_heads, K], delta, g: its factors (None: T >
        max_block). Static: tensor operations only, at the offset buffer (traceable, capturable)."""
        k1 = self.kernel - 1
        t = hist.shape[1] - k1
        if delta is not None:  # append this forward's inputs and factors to the record
            if self.static:  # the slot is a device tensor: one graph serves every offset
                slots = self.offset + torch.arange(t, device=hist.device)
                self.hist.index_copy_(1, slots + k1, hist[:, k1:])
                self.keys.index_copy_(1, slots, keys)
                self.delta.index_copy_(1, slots, delta)
                self.g.index_copy_(1, slots, g)
            else:
                b0 = self.at
                self.hist[:, k1 + b0 : k1 + b0 + t].copy_(hist[:, k1:])
                self.keys[:, b0 : b0 + t].copy_(keys)
                self.delta[:, b0 : b0 + t].copy_(delta)
                self.g[:, b0 : b0 + t].copy_(g)
        self._set("state", state)
        self._set("conv", hist[:, t:] if self.static else hist[:, t:].clone())  # no view of a prefill's inputs

    def record_at(self) -> tuple[int, ...]:
        """Where the record's slot begin() announced starts, for a native layer step that writes the block's record
        in place (model/native_layer.py; it then calls `finish`): (address, sequence stride in elements) of the
        pre-conv inputs, keys, deltas and g, flattened. Addresses, not views: four slices cost more than the rest
        of this bookkeeping."""
        at, buffers = self.at, self._buffers  # not self.hist etc.: nn.Module.__getattr__, each step
        out = []
        for name, row in (("hist", self.kernel - 1 + at), ("keys", at), ("delta", at), ("g", at)):
            t = buffers[name]
            out += (t.data_ptr() + row * t.stride(1) * t.element_size(), t.stride(0))
        return tuple(out)

    def finish(self, state: torch.Tensor, conv: torch.Tensor):
        """The state and conv state after a block whose record a native layer step wrote (write's other half)."""
        self._set("state", state)
        self._set("conv", conv)

    def rollback(self, length: int):
        """Keep positions < length: the state and conv state become those after position length-1.

        length may go back to the anchor (any position after it while the record has factors; otherwise only the
        anchor), or to 0; earlier positions are gone (ValueError).
        """
        if length >= self.length:
            return
        if length == 0:
            self.reset()
            return
        j = length - self.start
        if j < 0 or (0 < j and not self.has_factors):
            raise ValueError(
                f"DeltaNet state cannot roll back to length {length}: it holds positions {self.start}..{self.length} "
                f"since its anchor ({'any' if self.has_factors else 'its start or end'}), or 0; a rollback may reach "
                f"only back to the last forward, or to the start of several forwards of at most "
                f"max_block={self.max_block} tokens in all since the last rollback")
        state = replay(self.state0, self.keys[:, :j], self.delta[:, :j], self.g[:, :j])
        self._set("state", state)
        self._set("conv", self.hist[:, j : j + self.kernel - 1].clone())
        self.length, self.block, self.rolled_back = length, j, True

    def begin_tree(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree forward at start (model/tree.py): rolls back there if needed and returns (conv state, state)
        the root continues from. The cache itself changes only in commit_tree."""
        if start < self.length:
            self.rollback(start)
        assert start == self.length, f"tree at {start} leaves a gap after {self.length} positions"
        return self.conv, self.state

    def keep_tree(self, inputs: torch.Tensor, keys: torch.Tensor, delta: torch.Tensor, g: torch.Tensor) -> None:
        """What commit_tree needs of the tree forward: inputs [batch, kernel-1+N, conv_dim] (the conv state, then
        every node's pre-conv inputs) and every node's factors keys [batch, N, key_heads, K], delta, g."""
        self.tree_record = (inputs, keys, delta, g)

    def commit_tree(self, start: int, path: list[int]) -> None:
        """The state after the chain `path` from the state before the tree (the path's factors replayed, as a
        rollback replays a chain's), the conv state its last kernel-1 inputs; anchored there."""
        inputs, keys, delta, g = self.tree_record
        idx = torch.tensor(path, device=keys.device)
        k1 = self.kernel - 1
        state = replay(self.state, keys.index_select(1, idx), delta.index_select(1, idx), g.index_select(1, idx))
        rows = torch.cat([torch.arange(k1, device=keys.device), idx + k1])[-k1:]
        conv = inputs.index_select(1, rows)
        self._set("state", state)
        self._set("state0", self.state)
        self._set("conv", conv)
        self.hist[:, :k1].copy_(conv)
        self.length = self.start = start + len(path)
        self.block, self.has_factors, self.rolled_back, self.tree_record = 0, True, False, None

    def snapshot(self, length: int | None = None) -> Snapshot:
        """The state and conv state after `length` positions (not the rollback record: a restore re-anchors)."""
        if length is not None and length != self.length:
            raise ValueError(f"DeltaNet state is at length {self.length}; it cannot snapshot length {length}")
        return Snapshot(self.kind, self.length, False, {"state": self.state.clone(), "conv": self.conv.clone()})

    def restore(self, snapshot: Snapshot, length: int | None = None) -> None:
        """Continue from the snapshot's state: the record re-anchors there, so later rollbacks reach back to it."""
        snapshot.check(self.kind, snapshot.length if length is None else length)
        state, conv = snapshot.tensors["state"], snapshot.tensors["conv"]
        if state.shape != self.state.shape or conv.shape != self.conv.shape:
            raise ValueError(f"DeltaNet snapshot {list(state.shape)} does not fit this cache {list(self.state.shape)}")
        self._set("state", state.clone())  # clones: the snapshot outlives this sequence
        self._set("state0", self.state)  # the anchor, as advance() sets it
        self._set("conv", conv.to(self.dtype).clone())
        self.hist[:, : self.kernel - 1].copy_(conv)
        self.length = self.start = snapshot.length
        self.block, self.has_factors, self.rolled_back = 0, True, False


class GatedDeltaNet(nn.Module):
    """Mixer: forward(x [batch, T, hidden] after input_layernorm, cos, sin, start_pos) -> [batch, T, hidden].
    cos / sin / input_pos / plan are the decoder's per-step arguments; DeltaNet reads none of them."""

    kind = "linear_attention"  # its layer_types entry
    attr = "linear_attn"  # its module name inside a decoder layer, as transformers names it

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.key_heads, self.key_dim = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.value_heads, self.value_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        assert self.value_heads % self.key_heads == 0, "ModelConfig refuses this"
        self.kernel = cfg.linear_conv_kernel_dim
        key_total, value_total = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_dim = 2 * key_total + value_total
        self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = Linear(h, value_total, bias=False)
        self.in_proj_b = Linear(h, self.value_heads, bias=False)
        self.in_proj_a = Linear(h, self.value_heads, bias=False)
        # nn.Conv1d for its weight's name and shape [conv_dim, 1, kernel]; forward runs F.conv1d on it unpadded
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.empty(self.value_heads).uniform_(0.01, 16).log())  # A in transformers' range
        self.norm = GatedRMSNorm(self.value_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(value_total, h, bias=False)
        self.cache: DeltaNetCache | None = None
        self.chunk_size = DEFAULT_CHUNK
        self.allow_fla = True  # False: the plain forms even where flash-linear-attention is usable
        # False: the reference forms (transformers' casts, F.conv1d, gated_delta.recurrent_rule for one token);
        # True: the fast ones (fp32 from the conv to the gated norm, fewer passes over the state); tests compare them
        self.fast = True

    def make_cache(self, batch: int, capacity: int, dtype, device, window: int | None = None, static: bool = False,
                   max_block: int | None = DEFAULT_MAX_BLOCK) -> DeltaNetCache:
        return DeltaNetCache(batch, capacity, dtype, device, window, static, key_heads=self.key_heads,
                             key_dim=self.key_dim, value_heads=self.value_heads, value_dim=self.value_dim,
                             kernel=self.kernel, max_block=max_block or DEFAULT_MAX_BLOCK)

    def forward(self, x, cos=None, sin=None, start_pos: int = 0, input_pos=None, plan=None,
                tree: TreeLayout | None = None):
        if tree is not None:
            return self.forward_tree(x, start_pos, tree)
        b, t, _ = x.shape
        cache = self.cache
        if cache is not None:
            if input_pos is None or not cache.static:  # else the step's caller ran it (Transformer.begin_step)
                cache.begin(start_pos, t)
            prev_conv, state = cache.conv, cache.state
        else:
            prev_conv = torch.zeros(b, self.kernel - 1, self.conv_dim, dtype=x.dtype, device=x.device)
            state = zero_state(b, self.key_dim, self.value_heads, self.value_dim, x.device)
        # time-major [b, k-1+t, conv_dim]: a token's inputs are one contiguous row, so the cache appends, slices
        # and rolls back whole rows (channel-major, each of these was a strided copy: ~45 us per layer and step)
        hist = torch.cat([prev_conv.to(x.dtype), self.in_proj_qkv(x)], 1)
        q, k, v = self._mix(hist, t)
        g, beta = self._gates(x)
        need_delta = cache is not None and t <= cache.max_block  # one-token steps too: an LM drafter rolls back
        # over several of them
        out, new_state, delta = gated_delta_rule(q, k, v, g, beta, state, self.key_dim ** -0.5, self.chunk_size,
                                                 need_delta=need_delta, allow_fla=self.allow_fla, fast=self.fast)
        if cache is not None:
            cache.write(hist, new_state, *((k, delta, g) if need_delta else (None, None, None)))
        return self._output(x, out)

    def forward_tree(self, x, start_pos: int, tree: TreeLayout):
        """A tree forward (model/tree.py): x [b, N, hidden] of the nodes -> [b, N, hidden], each node computed
        from its parent's state and its root path's conv window, as the chain along that path computes it. The
        rule runs segment by segment (TreeLayout.segments), each from its parent's state, replayed from the start
        state of the parent's segment with its factors (`replay`: bit-equal to the stepped state on the native
        path). The cache keeps the inputs and factors for commit_tree."""
        b, n, _ = x.shape
        cache = self.cache
        if cache is None:
            raise ValueError("a tree forward needs a cache (Transformer.setup_cache)")
        prev_conv, state = cache.begin_tree(start_pos)
        inputs = torch.cat([prev_conv.to(x.dtype), self.in_proj_qkv(x)], 1)  # [b, kernel-1+N, conv_dim]
        q, k, v = self._mix(inputs, n, tree.conv_windows(self.kernel).to(x.device))
        g, beta = self._gates(x)
        # segment order (TreeLayout.order): each segment a contiguous run, each start state replayed from its
        # parent segment's start state over the parent's offset + 1 tokens (no gathers per segment)
        order = torch.tensor(tree.order, device=x.device)
        q, k, v, g, beta = (t.index_select(1, order) for t in (q, k, v, g, beta))
        outs, deltas, starts = [], [], []
        for seg, lo in zip(tree.segments, tree.segment_starts):
            if seg[0] == 0:
                start_state = state
            else:
                s, j = tree.place[tree.parents[seg[0]]]
                at = tree.segment_starts[s]
                start_state = replay(starts[s], k[:, at : at + j + 1], deltas[s][:, : j + 1], g[:, at : at + j + 1])
            hi = lo + len(seg)
            seg_out, _, seg_delta = gated_delta_rule(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], start_state,
                self.key_dim ** -0.5, self.chunk_size, need_delta=True, allow_fla=False, fast=self.fast)
            outs.append(seg_out.float())
            deltas.append(seg_delta)
            starts.append(start_state)
        back = torch.tensor(sorted(range(n), key=lambda i: tree.order[i]), device=x.device)  # inverse of order
        out, delta = torch.cat(outs, 1).index_select(1, back), torch.cat(deltas, 1).index_select(1, back)
        k, g = k.index_select(1, back), g.index_select(1, back)
        cache.keep_tree(inputs, k, delta, g)
        return self._output(x, out)

    def _mix(self, hist: torch.Tensor, t: int, windows: torch.Tensor | None = None):
        """(q, k, v) of the rule from the pre-conv inputs hist [b, kernel-1+T, conv_dim] (the conv state, then the
        block's rows): the causal depthwise conv of each of the t outputs, SiLU, q and k L2-normalised per key head.
        Output n's taps are rows n .. n+kernel-1, or windows[n] ([t, kernel]: a tree's root paths). The fast path
        keeps fp32 from the conv on (kernels.ops.delta_conv in one call on fp32 CPU eager steps: the call the native
        layer step makes, so both agree bit for bit); the reference rounds where transformers does."""
        b = hist.shape[0]
        kt = self.key_heads * self.key_dim
        w = self.conv1d.weight
        if self.fast:  # natively where it runs, else the same arithmetic in torch
            native = ops.usable(hist, w) and ops.delta_conv_fits(self.kernel, self.conv_dim)
            q, k, v = (ops.delta_conv if native else ops.delta_conv_reference)(
                hist, w, self.key_heads, self.key_dim, t, windows, L2_EPS)
            return q, k, v.reshape(b, t, self.value_heads, self.value_dim)
        # the reference: transformers' casts (conv and SiLU in x's dtype), on its channel-major layout
        if windows is None:
            conv = F.conv1d(hist.transpose(1, 2).to(w.dtype), w, groups=self.conv_dim).transpose(1, 2)
        else:  # each node's window as its own sequence of kernel inputs: one output each
            cols = hist[:, windows].reshape(b * t, self.kernel, self.conv_dim).transpose(1, 2).to(w.dtype)
            conv = F.conv1d(cols, w, groups=self.conv_dim).reshape(b, t, self.conv_dim)
        mixed = F.silu(conv).to(hist.dtype)
        q = l2_normalize(mixed[..., :kt].reshape(b, t, self.key_heads, self.key_dim))
        k = l2_normalize(mixed[..., kt : 2 * kt].reshape(b, t, self.key_heads, self.key_dim))
        return q, k, mixed[..., 2 * kt :].reshape(b, t, self.value_heads, self.value_dim)

    def _gates(self, x):
        """(g, beta) [b, T, value_heads] of the rule from x [b, T, hidden]."""
        a_in, b_in = self.in_proj_a(x), self.in_proj_b(x)
        if self.fast and ops.usable(a_in, b_in, self.A_log, self.dt_bias):  # a row's gates whatever the rows
            return ops.delta_gates(a_in, b_in, self.A_log, self.dt_bias)
        return ops.delta_gates_reference(a_in, b_in, self.A_log, self.dt_bias)  # sigmoid in x's dtype, as transformers

    def _output(self, x, out):
        """out_proj of the gated norm of the rule's output out [b, T, value_heads, V] (fp32, or x's dtype)."""
        b, t, _ = x.shape
        z = self.in_proj_z(x).view(b, t, self.value_heads, self.value_dim)
        y = self.norm.fp32(out, z, x.dtype) if self.fast else self.norm(out.to(x.dtype), z)
        return self.out_proj(y.reshape(b, t, self.value_heads * self.value_dim))
