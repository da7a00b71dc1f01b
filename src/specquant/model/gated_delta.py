"""The gated delta rule (Gated DeltaNet's recurrence), in plain PyTorch: one token at a time and chunked.

Forms: recurrent_rule (the plain reference, one token at a time), step_rule (the same recurrence with fewer passes
over the state: what a decode step runs), chunk_rule (a block of tokens off the native path: gated_delta_rule).
Tests compare each with the reference and with transformers' own torch forms.

Per value head h and token t, with the state S [K, V] in fp32 (Yang et al., "Gated Delta Networks", 2024):
    S' = e^{g_t} S                        decay (g_t <= 0)
    delta_t = beta_t (v_t - S'^T k_t)     the part of v_t the decayed state does not predict yet
    S = S' + k_t delta_t^T                write only that correction
    o_t = S^T q_t * scale
Unrolled over a block that starts from S_0, with G_j = g_1 + ... + g_j:
    S_j = e^{G_j} S_0 + sum_{i<=j} e^{G_j - G_i} k_i delta_i^T                                    (*)

Layouts follow transformers / flash-linear-attention: q, k [batch, T, key_heads, K]; v [batch, T, value_heads, V];
g, beta [batch, T, value_heads]; value head h reads key head h // (value_heads // key_heads) (grouped value heads,
as torch.repeat_interleave lays them out). q and k come in L2-normalised (l2_normalize); scale is applied here.

Rollback design (speculative verify of k+1 tokens, then accept j). Both forms return the per-token delta_i, so
the state after any j is (*) from (k_i, delta_i, g_i) and S_0: one [K, j] x [j, V] matmul per head (state_after).
Chosen over the known alternatives (vLLM's and SGLang's per-position state slots, llama.cpp's and mlx-lm's
snapshot and re-forward) because, at the Qwen3.5-4B shape (24 DeltaNet layers, 16 key heads and 32 value heads
of dim 128):
- per-position states cost a full state per token: 32 x 128 x 128 x 4 B = 2 MiB per layer, 48 MiB per token,
  768 MiB for a 16-token verify, and force a token-serial verify;
- the rank-1 factors cost per token and layer k (16 x 128) + delta (32 x 128) + g (32) floats = 24.1 KiB fp32,
  579 KiB over 24 layers (k is kept per key head: value heads that share a key head share it), plus one copy of
  S_0 (48 MiB, held, not copied, in eager mode), and the chunked verify stays chunked;
- snapshot + re-forward costs a second target forward of the accepted tokens.
The conv state's rollback (the pre-conv inputs, 8192 per token and layer at 4B) is the mixer's (model/deltanet.py).
state_after's rebuilt states equal the recurrent ones up to float rounding (a different summation order), not bit
for bit; on the native path the cache rebuilds them with kernels.ops.delta_replay instead, the step's own state
writes replayed, which equals the stepped state bit for bit at the same cost (one read and one write of it).

On CUDA with flash-linear-attention installed, forwards that need no per-token delta (cache-free ones, single
tokens, blocks too long to roll back into) run its Triton kernels instead (_fla_rule). It is an optional extra:
its kernels are Triton, GPU-only, and it returns only the final state, not the deltas rollback needs; the plain
forms here are the reference and the only path on CPU.
"""

from __future__ import annotations

import functools
import importlib

import torch

from specquant.kernels import ops

DEFAULT_CHUNK = 64  # tokens per chunk of the chunked form (flash-linear-attention's and transformers' choice)


L2_EPS = 1e-6  # l2_normalize's eps (the Qwen3.5 kernels'); kernels.ops.delta_conv takes it too


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32: eps inside the root, as the Qwen3.5 kernels have it
    (F.normalize clamps the norm instead, a different function near zero)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, T, h, D] -> [batch, T, heads, D], head i read from i // (heads // h): repeat_interleave's layout, as
    one copy of an expanded view (repeat_interleave builds an index tensor and gathers: more ops for a decode
    step's few rows)."""
    b, t, h, d = x.shape
    if h == heads:
        return x
    return x[:, :, :, None].expand(b, t, h, heads // h, d).reshape(b, t, heads, d)


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, T, h, D] -> [batch, heads, T, D] fp32, key heads repeated for grouped value heads."""
    return _repeat_heads(x, heads).transpose(1, 2).float()


def recurrent_rule(q, k, v, g, beta, state, scale: float):
    """One token at a time. state [batch, value_heads, K, V] fp32 (not modified).

    Returns (out [batch, T, value_heads, V] fp32, final state, delta [batch, T, value_heads, V] fp32).
    """
    heads = v.shape[2]
    q, k, v = _heads_first(q, heads), _heads_first(k, heads), v.transpose(1, 2).float()
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()  # [batch, heads, T]
    s = state.float()
    outs, deltas = [], []
    for t in range(q.shape[2]):
        s = s * g[:, :, t, None, None].exp()
        pred = (k[:, :, t, :, None] * s).sum(-2)  # S'^T k  [batch, heads, V]
        delta = beta[:, :, t, None] * (v[:, :, t] - pred)
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((q[:, :, t, :, None] * s).sum(-2) * scale)
        deltas.append(delta)
    return torch.stack(outs, 1), s, torch.stack(deltas, 1)


def step_rule(q, k, v, g, beta, state, scale: float):
    """recurrent_rule (its reference) with fewer passes over the state, for decode steps: the state is read once
    per token for both S^T q and S^T k (one [2, K] x [K, V] matmul per head, on the state before the decay), and
    decayed and corrected in place, with the output taken from those reads:
        S^T k after the decay = e^g (S^T k),   o = S_new^T q = e^g (S^T q) + (q.k) delta.
    Why: at the 4B shape the state (2 MiB fp32 per layer) outgrows L2, and the reference's per-op form passes over
    it about twelve times per token, this one five. Same arguments and returns as recurrent_rule.
    """
    heads = v.shape[2]
    q, k, v = _heads_first(q, heads) * scale, _heads_first(k, heads), v.transpose(1, 2).float()
    decay, beta = g.transpose(1, 2).float().exp(), beta.transpose(1, 2).float()  # [batch, heads, T]
    qk = torch.stack([q, k], 3)  # [batch, heads, T, 2, K]
    qdotk = (q * k).sum(-1)  # [batch, heads, T]
    s = state.float()
    outs, deltas = [], []
    for t in range(q.shape[2]):
        d = decay[:, :, t, None]  # [batch, heads, 1]
        read = qk[:, :, t] @ s  # [batch, heads, 2, V]: S^T q, S^T k
        delta = beta[:, :, t, None] * (v[:, :, t] - d * read[:, :, 1])
        outs.append(d * read[:, :, 0] + qdotk[:, :, t, None] * delta)
        s = (s * d[..., None]).addcmul_(k[:, :, t, :, None], delta[:, :, None, :])  # a new tensor: state kept
        deltas.append(delta)
    return torch.stack(outs, 1), s, torch.stack(deltas, 1)


def chunk_rule(q, k, v, g, beta, state, scale: float, chunk_size: int = DEFAULT_CHUNK):
    """Chunked (WY / UT transform): per chunk of C tokens, the C deltas solve one unit lower-triangular system
    (I + A) delta = beta v - diag(beta e^G) K S_prev,  A_ij = beta_i e^{G_i - G_j} k_i.k_j (j < i),
    then outputs and the next state are matmuls. Chunks run in sequence; the last one may be shorter (no padding).
    The state is read once per chunk (S_prev^T q and S_prev^T w in one matmul) and updated by one baddbmm, so a
    verify passes over it a few times, not once per matmul. Same arguments and returns as recurrent_rule.
    """
    heads = v.shape[2]
    b, _, _, dv = v.shape
    dk = q.shape[-1]
    q, k, v = _heads_first(q, heads), _heads_first(k, heads), v.transpose(1, 2).float()
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()
    s = state.float()
    outs, deltas = [], []
    for c0 in range(0, q.shape[2], chunk_size):
        c1 = min(c0 + chunk_size, q.shape[2])
        qc, kc, vc, bc = q[:, :, c0:c1] * scale, k[:, :, c0:c1], v[:, :, c0:c1], beta[:, :, c0:c1]
        cum = g[:, :, c0:c1].cumsum(-1)  # G within the chunk [batch, heads, C]
        n = c1 - c0
        upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        # e^{G_i - G_j} for j <= i; the upper triangle is masked before exp (its exponents are positive)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
        a = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        # u = (I + A)^-1 beta v and w = (I + A)^-1 diag(beta e^G) K: one solve of both right-hand sides
        uw = torch.linalg.solve_triangular(a, torch.cat([bc[..., None] * vc, (bc * cum.exp())[..., None] * kc], -1),
                                           upper=False, unitriangular=True)
        read = torch.cat([qc, uw[..., dv:]], 2) @ s  # [batch, heads, 2C, V]: Q S_prev, W S_prev
        delta = uw[..., :dv] - read[:, :, n:]  # [batch, heads, C, V]
        outs.append(cum.exp()[..., None] * read[:, :, :n] + ((qc @ kc.transpose(-1, -2)) * decay) @ delta)
        last = cum[..., -1:]  # [batch, heads, 1]
        decayed_keys = (kc * (last - cum).exp()[..., None]).transpose(-1, -2)  # [batch, heads, K, C]
        decayed_state = (last.exp()[..., None] * s).reshape(b * heads, dk, dv)
        s = torch.baddbmm(decayed_state, decayed_keys.reshape(b * heads, dk, n),
                          delta.reshape(b * heads, n, dv)).view(b, heads, dk, dv)
        deltas.append(delta)
    return torch.cat(outs, 2).transpose(1, 2), s, torch.cat(deltas, 2).transpose(1, 2)


def state_after(state0: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, g: torch.Tensor, j: int) -> torch.Tensor:
    """The state after the first j tokens of a block that started from state0, from its factors (*).

    state0 [batch, value_heads, K, V]; k [batch, T, key_heads, K]; delta [batch, T, value_heads, V];
    g [batch, T, value_heads]; 0 <= j <= T.
    """
    if j == 0:
        return state0
    heads = delta.shape[2]
    cum = g[:, :j].float().cumsum(1)  # [batch, j, heads]
    weighted = delta[:, :j].float() * (cum[:, -1:] - cum).exp()[..., None]  # e^{G_j - G_i} delta_i
    keys = _repeat_heads(k[:, :j].float(), heads)
    b, _, dk, dv = state0.shape
    # e^{G_j} S_0 + K^T W as one baddbmm on the decayed state: one pass fewer over it than a matmul and an add
    decayed = (cum[:, -1].exp()[..., None, None] * state0).reshape(b * heads, dk, dv)
    return torch.baddbmm(decayed, keys.permute(0, 2, 3, 1).reshape(b * heads, dk, j),
                         weighted.transpose(1, 2).reshape(b * heads, j, dv)).view(b, heads, dk, dv)


@functools.lru_cache(maxsize=1)
def _fla_ops():
    """flash-linear-attention's (chunk, fused_recurrent) gated delta rule kernels, or None when not installed."""
    try:
        ops = importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return None
    return ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule


def fla_available(device: torch.device) -> bool:
    return device.type == "cuda" and _fla_ops() is not None


def _fla_rule(q, k, v, g, beta, state, scale: float):
    """flash-linear-attention's kernels, same contract as the plain forms minus the deltas (None). Key heads are
    repeated to the value heads so that fla versions without grouped value heads compute the same thing. The
    kernels run only on CUDA with fla installed; on CPU the tests check this glue against a stand-in module."""
    chunk, recurrent = _fla_ops()
    heads = v.shape[2]
    if k.shape[2] != heads:
        q, k = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (q, k))
    fn = recurrent if q.shape[1] == 1 else chunk
    out, final = fn(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(), g.float().contiguous(),
                    beta.float().contiguous(), scale=scale, initial_state=state.float().contiguous(),
                    output_final_state=True)
    return out.float(), final.float(), None


def native_rule(value_dim: int, *tensors: torch.Tensor) -> bool:
    """Whether the rule runs natively (kernels.ops.delta_step, and the cache's rollback ops.delta_replay, which is
    bit-equal to it only on a record delta_step wrote): its value dim a multiple of 16 and ops.usable."""
    return value_dim % 16 == 0 and ops.usable(*tensors)


def gated_delta_rule(q, k, v, g, beta, state, scale: float, chunk_size: int = DEFAULT_CHUNK,
                     need_delta: bool = True, allow_fla: bool = True, fast: bool = True):
    """The rule with the form that fits: fla's kernels when usable and no delta is needed; on an fp32 CPU eager
    forward (V a multiple of 16, fast) of any length -> kernels.ops.delta_step, the step rule over the tokens in
    one native call: each token's arithmetic is the one-token step's, so a verify row and its rolled-back state
    (ops.delta_replay) equal a token-by-token decode bit for bit, and a prefill runs the decode's arithmetic; it beat
    chunk_rule at every verify width measured, 4-64, and shortened the hybrid's prefill (docs/BENCH.md, "Prefill").
    Otherwise one token -> step_rule (fast=False: recurrent_rule, the reference) and a block ->
    chunk_rule (a few matmuls per chunk, not a token loop; equal to the step rule up to rounding). Returns (out,
    state, delta); delta is None where need_delta is False and the form need not make it (fla's, the native one)."""
    if allow_fla and not need_delta and fla_available(q.device):
        return _fla_rule(q, k, v, g, beta, state, scale)
    if fast and native_rule(v.shape[-1], q, k, v, g, beta, state):
        return ops.delta_step(q, k, v, g, beta, state, scale, keep_delta=need_delta)
    if q.shape[1] == 1:
        return (step_rule if fast else recurrent_rule)(q, k, v, g, beta, state, scale)
    return chunk_rule(q, k, v, g, beta, state, scale, chunk_size)


def zero_state(batch: int, key_dim: int, value_heads: int, value_dim: int, device) -> torch.Tensor:
    return torch.zeros(batch, value_heads, key_dim, value_dim, dtype=torch.float32, device=device)

