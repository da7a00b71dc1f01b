"""GPTQ (Frantar et al. 2022): quantize columns one at a time, pushing each column's rounding error onto the
not-yet-quantized columns through the inverse Hessian of the layer's squared output error.

Per Linear with calibration inputs x [n, in]:
  H = 2/n Σ xᵀx (float32); dead inputs (H_jj = 0) get H_jj = 1 and zero weight; H += damp·mean(diag H)·I;
  U = chol(H⁻¹)ᵀ (upper). Columns are processed in blocks of `GPTQConfig.block`; inside a block the error
  e_j = (w_j − q_j)/U_jj updates the block's later columns at once, and at block end the whole block's errors
  update every later column (the "lazy batch" form; same result as column by column).
Group scales: without act-order, a group's scale/zero is computed (min/max, absmax/qmax when symmetric) from
the *error-updated* weights when the sweep reaches the group's first column — what the reference GPTQ run did.
Act-order (GPTQConfig.act_order): columns are visited by descending diag(H) and un-permuted at the end. Groups stay
in the original column order (so the checkpoint needs no g_idx and vLLM/compressed-tensors read it as a plain
grouped layer); because a group's columns are then visited out of order, all group scales are computed up
front from the original weights (what compressed-tensors calls actorder "static").
Memory: H is in×in float32 per Linear (256 MB for in = 8192).
"""

from __future__ import annotations

import torch
from torch import nn

from specquant.errors import SpecquantError
from specquant.quant.calib import gram
from specquant.quant.grid import QuantizedWeight, compute_qparams, qrange

NEEDS_CALIBRATION = True


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2/n Σ xᵀx over rows of x [n, in], float32."""
    return gram(x).mul_(2.0)


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, h: torch.Tensor, cfg, group: int, scale_dtype, name: str = "") -> QuantizedWeight:
    """w [out, in] float32, h [in, in] -> QuantizedWeight (codes in the original column order)."""
    w = w.float().clone()
    out, inp = w.shape
    reference = w.clone()
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = None
    if cfg.method.act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    h.diagonal().add_(cfg.method.damp * torch.diag(h).mean())
    try:
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError:
        raise SpecquantError(
            f"GPTQ: the Hessian of {name or 'a layer'} is not positive definite even after dampening "
            f"{cfg.method.damp}; raise --gptq-damp (e.g. 0.1) or use more calibration samples"
        ) from None

    qmin, qmax = qrange(cfg.bits)
    n_groups = inp // group
    codes = torch.zeros(out, inp, dtype=torch.int8, device=w.device)
    scale = torch.zeros(out, n_groups, dtype=scale_dtype, device=w.device)
    zero = None if cfg.symmetric else torch.zeros(out, n_groups, dtype=torch.int8, device=w.device)
    if perm is not None:  # static groups in original order, from the un-updated weights
        scale, zero = compute_qparams(w[:, torch.argsort(perm)], cfg.bits, group, cfg.symmetric, scale_dtype)
    scale_f = scale.float()
    zero_f = None if zero is None else zero.float()

    for i1 in range(0, inp, cfg.method.block):
        i2 = min(i1 + cfg.method.block, inp)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = (int(perm[col]) if perm is not None else col) // group
            if perm is None and col % group == 0:
                current = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :group]
                s, z = compute_qparams(current, cfg.bits, group, cfg.symmetric, scale_dtype)
                scale[:, g], scale_f[:, g] = s[:, 0], s[:, 0].float()
                if z is not None:
                    zero[:, g], zero_f[:, g] = z[:, 0], z[:, 0].float()
            wc = w1[:, i]
            s_g = scale_f[:, g]
            z_g = 0.0 if zero_f is None else zero_f[:, g]
            q = torch.clamp(torch.round(wc / s_g) + z_g, qmin, qmax)
            codes[:, col] = q.to(torch.int8)
            e = (wc - (q - z_g) * s_g) / u1[i, i]
            w1[:, i:].sub_(e.unsqueeze(1) * u1[i, i:].unsqueeze(0))
            err1[:, i] = e
        w[:, i2:].sub_(err1 @ u[i1:i2, i2:])

    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return QuantizedWeight(codes, scale, zero, reference)


def quantize_layer(layer: nn.Module, targets: dict[str, nn.Linear], inputs: dict[str, torch.Tensor], cfg,
                   scale_dtype, **_):
    results = {}
    hessians: dict[int, torch.Tensor] = {}  # Linears sharing one captured input share one H
    for name, lin in targets.items():
        x = inputs[name]
        if id(x) not in hessians:
            hessians[id(x)] = hessian(x)
        group = cfg.group_for(name, lin.in_features)
        results[name] = gptq_quantize(lin.weight, hessians[id(x)], cfg, group, scale_dtype, name)
    return results
