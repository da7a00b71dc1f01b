"""Save / load compressed-tensors `pack-quantized` checkpoints (the format vLLM and transformers read).

config.json gets `quantization_config` (quant_method compressed-tensors, format pack-quantized, status
compressed, one config group targeting "Linear", `ignore` = full names of the Linears left dense, lm_head
included) plus a `specquant` sub-dict holding the QuantConfig that produced it. Tensors per quantized Linear:
`weight_packed`, `weight_scale`, `weight_shape` and, when asymmetric, `weight_zero_point` (see pack.py).
The loader also accepts checkpoints written by compressed-tensors / llm-compressor with regex targets and
ignores, as long as the weights are integer 4/8-bit, group or channel strategy, and activations unquantized.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from specquant.errors import SpecquantError
from specquant.model.checkpoint import load_dense_into, save_model, wrapped_names
from specquant.quant.config import GPTQConfig, QuantConfig
from specquant.quant.linear import QuantLinear

SUPPORTED_FORMAT = "pack-quantized"
SUPPORTED_STRATEGIES = ("group", "channel")


def quantization_config(model: nn.Module, cfg: QuantConfig | None = None) -> dict:
    """The config.json `quantization_config` dict for a model holding QuantLinear modules."""
    from specquant.quant.head import CastLinear, head_scheme

    lm_head = getattr(model, "lm_head", None)
    if cfg is not None:
        head = head_scheme(lm_head) if cfg.lm_head != "dense" else None
    else:  # no config: a quantized head whose scheme differs from the layers' gets its own group
        others = {(m.bits, m.group_size == m.in_features or m.group_size) for n, m in model.named_modules()
                  if isinstance(m, QuantLinear) and n != "lm_head"}
        own = isinstance(lm_head, QuantLinear) and {(lm_head.bits, lm_head.group_size == lm_head.in_features
                                                     or lm_head.group_size)} != others
        head = head_scheme(lm_head) if own else None
    qlinears = {n: m for n, m in model.named_modules()
                if isinstance(m, QuantLinear) and not (head and n == "lm_head")}
    if not qlinears:
        raise SpecquantError("model has no quantized Linear; run specquant.quant.quantize(model, config) first")
    kinds = {(m.bits, m.symmetric) for m in qlinears.values()}
    if cfg is not None:
        per_channel, group = cfg.group_size == -1, cfg.group_size
    else:
        per_channel = all(m.group_size == m.in_features for m in qlinears.values())
        group = -1 if per_channel else {m.group_size for m in qlinears.values()}
        if not per_channel and len(group) == 1:
            group = group.pop()
    if len(kinds) > 1 or not isinstance(group, int):
        raise SpecquantError(f"mixed quantization schemes (bits, symmetric, group) {sorted(kinds)}, {group} cannot "
                             "be written as one compressed-tensors config group")
    bits, symmetric = kinds.pop()
    act_order = bool(cfg and isinstance(cfg.method, GPTQConfig) and cfg.method.act_order)
    dense = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, CastLinear))]
    weights = {
        "num_bits": bits, "type": "int", "symmetric": symmetric,
        "strategy": "channel" if per_channel else "group", "group_size": None if per_channel else group,
        "dynamic": False, "actorder": "static" if act_order and not per_channel else None, "observer": "minmax",
    }
    qc = {
        "quant_method": "compressed-tensors",
        "format": SUPPORTED_FORMAT,
        "quantization_status": "compressed",
        "ignore": dense,
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None}},
    }
    if head:  # QuantConfig.lm_head: its own scheme; a group naming a module wins over the "Linear" group
        qc["config_groups"] = {"lm_head": {"targets": ["lm_head"], "weights": head, "input_activations": None,
                                           "output_activations": None}, **qc["config_groups"]}
    if cfg is not None:
        qc["specquant"] = cfg.to_json()
    return qc


def save_quantized(model: nn.Module, out, tokenizer_from=None, cfg: QuantConfig | None = None,
                   overwrite: bool = False, extra_config: dict | None = None) -> Path:
    """Write a compressed-tensors checkpoint atomically (a failure leaves no `out`).

    Its quantization_config is built from `cfg` when given, else it is the model's own (`model.quantization`,
    set by quantize() or the loader), else it is read from the QuantLinear modules. extra_config: more config.json
    keys (e.g. a pruned vocabulary's map)."""
    qc = quantization_config(model, cfg)  # also checks that there is something quantized to save
    if cfg is None and model.quantization:
        qc = model.quantization
    return save_model(model, out, tokenizer_from=tokenizer_from,
                      extra_config={**(extra_config or {}), "quantization_config": qc}, overwrite=overwrite)


# --- loading --------------------------------------------------------------------------------------------------


def _matches(name: str, patterns, cls_name: str = "") -> bool:
    """compressed-tensors' matching: a class name, an exact module name, or 're:<regex>' (re.match). The names are
    the checkpoint's, so a wrapped layout's (model.language_model.*, as the vLLM export of a Qwen3.5 writes its
    `ignore`) match the decoder's module under either name."""
    names = wrapped_names(name)
    for p in patterns or ():
        if p.startswith("re:"):
            if any(re.match(p[3:], n) for n in names):
                return True
        elif p in names or p == cls_name:
            return True
    return False


def _check_weights_args(group_name: str, args: dict | None, scheme: dict):
    if not args:
        raise SpecquantError(f"quantization_config group {group_name!r} has no weights scheme; "
                             "only weight quantization (W4A16 / W8A16) is supported")
    bad = []
    if args.get("type", "int") != "int":
        bad.append(f"type={args.get('type')!r} (need int)")
    if args.get("num_bits") not in (4, 8):
        bad.append(f"num_bits={args.get('num_bits')} (need 4 or 8)")
    if args.get("strategy") not in SUPPORTED_STRATEGIES:
        bad.append(f"strategy={args.get('strategy')!r} (need group or channel)")
    if args.get("dynamic"):
        bad.append("dynamic=true (need static weights)")
    if args.get("actorder") == "group":
        bad.append("actorder='group' (g_idx reordering is not supported; re-export with actorder static or null)")
    if scheme.get("input_activations") or scheme.get("output_activations"):
        bad.append("activation quantization (only weight-only W4A16/W8A16 is supported)")
    if bad:
        raise SpecquantError(f"unsupported quantization scheme in group {group_name!r}: {'; '.join(bad)}")


def _plan(model: nn.Module, qc: dict) -> dict[str, dict]:
    """{Linear name: weights args} for every Linear the checkpoint stores quantized."""
    if qc.get("quant_method") != "compressed-tensors":
        raise SpecquantError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported; "
                             "specquant reads compressed-tensors checkpoints (pack-quantized)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise SpecquantError(f"quantization_status {status!r}: only 'compressed' checkpoints hold packed weights")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise SpecquantError("quantization_config has no config_groups; nothing says which Linears are quantized")
    for gname, scheme in groups.items():
        fmt = scheme.get("format") or qc.get("format")
        if fmt != SUPPORTED_FORMAT:
            raise SpecquantError(f"compressed-tensors format {fmt!r} (group {gname!r}) is not supported; "
                                 f"specquant reads {SUPPORTED_FORMAT!r}")
        _check_weights_args(gname, scheme.get("weights"), scheme)
    plan = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or _matches(name, qc.get("ignore"), type(m).__name__):
            continue
        # a group naming the module (exactly or by regex) wins over one targeting its class, as in
        # compressed-tensors: e.g. an "lm_head" group beside a "Linear" group (QuantConfig.lm_head)
        by_name = [sc for sc in groups.values() if _matches(name, sc.get("targets"))]
        by_class = [sc for sc in groups.values() if _matches(name, sc.get("targets"), "Linear")]
        if by_name or by_class:
            plan[name] = (by_name or by_class)[0]["weights"]
    return plan


def _swap_meta(model: nn.Module, plan: dict[str, dict], dtype) -> None:
    for name, args in plan.items():
        lin = model.get_submodule(name)
        in_f, out_f = lin.in_features, lin.out_features
        group = in_f if args["strategy"] == "channel" else args.get("group_size")
        if not group or in_f % group:
            raise SpecquantError(f"group_size={group} does not divide {name}.in_features={in_f}; the checkpoint "
                                 "does not match this architecture")
        if (in_f * args["num_bits"]) % 32:
            raise SpecquantError(f"{name}.in_features={in_f} is not a multiple of {32 // args['num_bits']}; "
                                 "cannot unpack")
        q = QuantLinear(in_f, out_f, args["num_bits"], group, bool(args.get("symmetric", True)),
                        lin.bias is not None, dtype=dtype, device="meta")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)


@torch.no_grad()
def load_quantized_into(model: nn.Module, tensors: dict[str, torch.Tensor], qc: dict, dtype: torch.dtype,
                        device) -> nn.Module:
    """Swap the planned Linears of a meta-device model for QuantLinear, materialize it on device in dtype, and
    fill every tensor from the checkpoint with name/shape checks."""
    plan = _plan(model, qc)
    if not plan:
        raise SpecquantError("quantization_config matches no Linear of this model; check its targets/ignore")
    tied = model.config.tie_word_embeddings
    if tied and "lm_head" in plan:
        raise SpecquantError("checkpoint quantizes lm_head but config.json ties it to embed_tokens; set "
                             "tie_word_embeddings to false or keep lm_head in the ignore list")
    _swap_meta(model, plan, dtype)
    model.to_empty(device=device)
    model.to(dtype)  # floating tensors only: packed codes stay int32
    load_dense_into(model, tensors)  # names, shapes, integer dtypes; tied lm_head may be absent
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            shape = [int(v) for v in m.weight_shape.tolist()]
            if shape != [m.out_features, m.in_features]:
                raise SpecquantError(f"{name}.weight_shape is {shape}; the config implies "
                                     f"{[m.out_features, m.in_features]}")
            m.invalidate()
    if (qc.get("specquant") or {}).get("lm_head") == "bf16":  # stored dense (bf16 values): run it as bf16 again
        from specquant.quant.head import set_lm_head

        set_lm_head(model, "bf16")
    return model


def quantized_skeleton(hf: dict, dtype: torch.dtype) -> nn.Module:
    """The decoder of a compressed-tensors config.json on the meta device (no memory), its planned Linears already
    QuantLinear: parts of it are materialized one at a time (model.checkpoint.load_submodule), e.g. by lean QAD."""
    from specquant.model.config import ModelConfig
    from specquant.model.decoder import Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(hf))
    plan = _plan(model, hf["quantization_config"])
    if not plan:
        raise SpecquantError("quantization_config matches no Linear of this model; check its targets/ignore")
    _swap_meta(model, plan, dtype)
    model.quantization = hf["quantization_config"]
    return model


def load_quantized_model(path: Path, hf: dict, dtype, device, w4_activations: str = "float"):
    """A compressed-tensors decoder checkpoint as a Transformer: the half of specquant.loader.load_model that quant/
    owns, as model/checkpoint.load_dense is the dense half."""
    from specquant.model.checkpoint import load_tensors, split_tensors
    from specquant.model.config import ModelConfig
    from specquant.model.decoder import Transformer
    from specquant.quant.linear import set_w4_activations

    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(hf))
    tensors, kept = split_tensors(load_tensors(path))
    load_quantized_into(model, tensors, hf["quantization_config"], dtype, device)
    model.quantization = hf["quantization_config"]
    model.extra_tensors = kept
    model.init_non_persistent(device)
    set_w4_activations(model, w4_activations)
    return model
