"""quantize(model, config): pick the target Linears, calibrate layer by layer, swap in QuantLinear, report."""

from __future__ import annotations

import fnmatch
import logging
import re
import time
from types import ModuleType

import torch
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.fuse import check_unfused
from specquant.quant import awq, gptq, rtn
from specquant.quant.calib import calibration_tokens, run_sequential, subsample
from specquant.quant.checkpoint import quantization_config
from specquant.quant.config import AWQConfig, GPTQConfig, QuantConfig, RTNConfig
from specquant.quant.grid import QuantizedWeight, dequantize, sqnr_db
from specquant.quant.linear import QuantLinear

log = logging.getLogger(__name__)
# the algorithm module for each settings type (QuantConfig.method)
ALGORITHMS: dict[type, ModuleType] = {RTNConfig: rtn, AWQConfig: awq, GPTQConfig: gptq}
REPORT_TOKENS = 2048  # calibration tokens per Linear for the output-error report


def is_ignored(name: str, patterns: list[str]) -> bool:
    """fnmatch on the full name or on its trailing components ("lm_head", "mlp.*"); 're:' = regex (re.match)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p):
            return True
    return False


# The Linears of each layer kind (model/layers.py's LAYER_KINDS keys) that stay dense whatever --ignore says, as the
# reference recipe keeps them (../shared/REFERENCE.md §2): Gated DeltaNet's in_proj_a / in_proj_b are value_heads
# rows each (32 at Qwen3.5-4B, under 0.1% of the layer's weights, so W4 would save almost nothing), and their
# outputs set the state's decay (exp of a softplus) and write strength (sigmoid), whose errors persist in the
# recurrent state over every later token. Every other Linear of a layer is quantized.
DENSE_BY_KIND: dict[str, tuple[str, ...]] = {
    "full_attention": (),
    "gated_attention": (),
    "linear_attention": ("linear_attn.in_proj_a", "linear_attn.in_proj_b"),
}


def kept_dense(model: nn.Module) -> set[str]:
    """Full names of the layer Linears DENSE_BY_KIND keeps dense in this model."""
    return {f"model.layers.{i}.{name}" for i, layer in enumerate(model.model.layers)
            for name in DENSE_BY_KIND[layer.layer_type]}


def target_linears(model: nn.Module, cfg: QuantConfig) -> dict[str, nn.Linear]:
    """{full name: nn.Linear} to quantize; checks every group size before any work is done."""
    targets = {}
    dense = kept_dense(model)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name not in dense and not is_ignored(name, cfg.ignore):
            cfg.group_for(name, m.in_features)
            targets[name] = m
    if not targets and any(isinstance(m, QuantLinear) for m in model.modules()):
        raise SpecquantError("model is already quantized; start from the unquantized checkpoint")
    if not targets:
        raise SpecquantError(f"--ignore patterns {cfg.ignore} leave no Linear to quantize; ignore fewer modules")
    return targets


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (what a checkpoint holds), tied tensors counted once."""
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _set(root: nn.Module, name: str, module: nn.Module):
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _swap(root: nn.Module, name: str, res: QuantizedWeight, linear: nn.Linear, bits: int):
    _set(root, name, QuantLinear.from_codes(res.codes, res.scale, res.zero, bits, linear.bias))


def _stand_in(linear: nn.Linear, res: QuantizedWeight, deq: torch.Tensor) -> nn.Module:
    """What the calibration stream goes through until QuantLinear replaces linear: a plain Linear holding res's
    weight dequantized once (deq, float32, rounded here to the scale dtype as QuantLinear does) and linear's bias.
    QuantLinear's reference path computes the same product but dequantizes on every batch (tested equal)."""
    with torch.device("meta"):
        stand_in = nn.Linear(linear.in_features, linear.out_features, bias=False)
    weight = deq.to(res.scale.dtype).to(linear.weight.dtype)
    stand_in.weight = nn.Parameter(weight, requires_grad=False)
    stand_in.bias = linear.bias
    return stand_in


def _error_row(name: str, res: QuantizedWeight, deq: torch.Tensor, x: torch.Tensor | None, seed: int) -> dict:
    """Weight SQNR, and with captured inputs x the output SQNR / relative MSE on REPORT_TOKENS of them; deq: the
    dequantized weight in float32."""
    row = {"name": name, "shape": list(res.codes.shape), "weight_sqnr_db": round(sqnr_db(res.reference, deq), 2)}
    if x is not None:
        xs = subsample(x, REPORT_TOKENS, seed)
        y = xs @ res.reference.t()
        row["output_sqnr_db"] = round(sqnr_db(y, xs @ deq.t()), 2)
        row["output_rel_mse"] = float((xs @ deq.t() - y).pow(2).mean() / y.pow(2).mean().clamp_min(1e-30))
    return row


def _warn_rank_deficient(tokens: int, targets: dict[str, nn.Linear], cfg: QuantConfig) -> None:
    """GPTQ's Hessian of a Linear is XᵀX over the calibration tokens: with fewer tokens than input features it is
    rank-deficient, only the dampening regularizes it, and the column updates fit the calibration text's subspace
    (at the random Qwen3.5-4B shape, 8 x 256 tokens gave GPTQ a higher KL than RTN, likely for this reason:
    docs/BENCH.md)."""
    name, widest = max(((n, lin.in_features) for n, lin in targets.items()), key=lambda t: t[1], default=("", 0))
    if tokens < widest:
        need = -(-widest // cfg.seq_len)
        log.warning("GPTQ calibrates on %d tokens, fewer than the %d input features of %s: its Hessians are "
                    "rank-deficient; use --calib-samples %d or more (at --seq-len %d)", tokens, widest, name,
                    need, cfg.seq_len)


@torch.no_grad()
def quantize(model, config: QuantConfig, tokenizer=None, *, calib_tokens: torch.Tensor | None = None,
             scale_dtype: torch.dtype | None = None, progress: bool | str = False) -> dict:
    """Quantize model's Linears in place with config.method; returns a report (per-layer error, bytes).

    calib_tokens [samples, seq_len] overrides reading config.calib with tokenizer. scale_dtype defaults to the
    model's dtype (pass bfloat16 to calibrate an fp32 model but store bf16 scales). RTN needs no calibration;
    given a tokenizer or tokens it still captures inputs to report output errors.
    Linears outside the decoder layers (lm_head when not ignored) are quantized with RTN.
    progress: a bar per layer (util/progress.py: True, BAR_ONLY or False).
    """
    cfg = config.validate()
    check_unfused(model, "quantize")
    started = time.perf_counter()
    method = ALGORITHMS[type(cfg.method)]
    model.eval()
    targets = target_linears(model, cfg)
    if cfg.lm_head != "dense":  # the head gets its own precision (quant.head), not the layers' scheme
        targets.pop("lm_head", None)
    dtype = model.model.embed_tokens.weight.dtype
    scale_dtype = scale_dtype or dtype
    bytes_before = tensor_bytes(model)
    if calib_tokens is None and method.NEEDS_CALIBRATION and tokenizer is None:
        raise SpecquantError(f"calibration needs a tokenizer: {cfg.method_name} calibrates on text; pass tokenizer= "
                             "(model.checkpoint.load_tokenizer) or calib_tokens=")
    # RTN runs calibration forwards only for the output-error report: report_samples sequences (0: none).
    samples = cfg.calib_samples if method.NEEDS_CALIBRATION else cfg.report_samples
    if calib_tokens is None and tokenizer is not None and samples:
        calib_tokens = calibration_tokens(tokenizer, cfg.calib_path(), samples, cfg.seq_len)
    if calib_tokens is not None and int(calib_tokens.max()) >= model.config.vocab_size:
        raise SpecquantError(f"calibration token id {int(calib_tokens.max())} >= vocab_size "
                             f"{model.config.vocab_size}; the tokenizer does not match the model")
    if calib_tokens is not None and cfg.method_name == "gptq":
        _warn_rank_deficient(calib_tokens.numel(), targets, cfg)
    # Every input is checked; from here on the model is modified.
    untied = "lm_head" in targets and model.config.tie_word_embeddings
    if untied:
        # A quantized lm_head cannot share storage with the (dense) embedding: the model unties itself (its config
        # then says tie_word_embeddings=False, as the saved checkpoint must), and the report says so.
        log.warning("quantizing lm_head: untying it from embed_tokens (tie_word_embeddings becomes false)")
        model.untie_lm_head()
        targets["lm_head"] = model.lm_head
    rows, stats = [], {}
    n_layers = len(model.model.layers)

    def per_layer(i, layer, capture, call=None):
        prefix = f"model.layers.{i}."
        local = {n[len(prefix):]: m for n, m in targets.items() if n.startswith(prefix)}
        if not local:
            return
        inputs = capture(local) if capture is not None else {}
        results = method.quantize_layer(layer, local, inputs, cfg, scale_dtype,
                                        stats=stats.setdefault(prefix[:-1], {}), call=call,
                                        seq_len=None if calib_tokens is None else calib_tokens.shape[1])
        for name, res in results.items():
            # float32 and exact; rounded to scale_dtype it is bit-identical to QuantLinear.dequantized_weight()
            deq = dequantize(res.codes, res.scale.float(), res.zero)
            rows.append(_error_row(prefix + name, res, deq, inputs.get(name), cfg.seed))
            if capture is not None:
                _set(layer, name, _stand_in(local[name], res, deq))

        def swap():
            for name, res in results.items():
                _swap(layer, name, res, local[name], cfg.bits)
                # the float Linear is out of the model now; dropped here too, its weight is freed with this layer
                # (else every layer's float weight stays alive beside the packed codes until quantize returns:
                # at the 4B shape that pushed AWQ's peak past 21 GB)
                del targets[prefix + name]

        if capture is None:  # no stream to push through the layer: swap now
            swap()
            return None
        return swap  # run_sequential calls it once the stream has gone through the stand-ins

    from specquant.util.progress import progress_for

    with progress_for(progress, n_layers, f"{cfg.method_name} {cfg.bits}-bit", "layer") as bar:
        if calib_tokens is not None:
            run_sequential(model, calib_tokens, per_layer, progress=bar)
        else:
            for i, layer in enumerate(model.model.layers):
                per_layer(i, layer, None)
                bar.update(1)
    for name, lin in targets.items():
        if not name.startswith("model.layers."):
            res = rtn.quantize_linear(name, lin, cfg, scale_dtype)
            rows.append(_error_row(name, res, dequantize(res.codes, res.scale.float(), res.zero), None, cfg.seed))
            _swap(model, name, res, lin, cfg.bits)
    if cfg.lm_head != "dense":
        from specquant.quant.head import set_lm_head

        untied = untied or model.config.tie_word_embeddings
        set_lm_head(model, cfg.lm_head, scale_dtype)
    model.quantization = quantization_config(model, cfg)
    return {
        "method": cfg.method_name,
        "untied_lm_head": untied,
        "config": cfg.to_json(),
        "layers": rows,
        "search": {k: v for k, v in stats.items() if v},  # AWQ: per layer, per group: chosen vs RTN loss
        "quantized_linears": len(rows),
        "kept_dense": sorted(kept_dense(model)),  # layer Linears the recipe keeps dense (DENSE_BY_KIND)
        "bytes_before": bytes_before,
        "bytes_after": tensor_bytes(model),
        "seconds": round(time.perf_counter() - started, 2),
    }
