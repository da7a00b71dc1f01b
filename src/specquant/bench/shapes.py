"""Model shapes for the speed benchmarks at real sizes, and the random-init models built from them.

The Qwen3 (0.6B, 1.7B, 4B) and Qwen3.5 hybrid (0.8B, 2B, 4B) configs, the bundled target's, and how a row of
benchmarks/shapes.py builds its model (random_model: N(0, 0.02) matrices, seed 0; build: the mode's dtype, W4 = RTN
g32 of the bf16 weights, fused projections). benchmarks/shapes.py, shapes_gguf.py, qad_lean.py and tree.py import
them from here, so the same shape means the same weights in each (speed does not depend on the values). Also the
reading of a GGUF's tensor table (gguf_weights) that shapes.py prints beside our own weight bytes, a random block
drafter for a shape (block_drafter: benchmarks/block_drafter.py, tests/test_native_layer.py), and what the speed
benchmarks divide by: the streamed read bandwidth and a module's weight bytes.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import torch

from specquant.model.checkpoint import read_config
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.fuse import for_decoding
from specquant.model.norms import ZeroCentredRMSNorm
from specquant.quant.head import set_lm_head
from specquant.quant.linear import DERIVED_BUFFERS, QuantLinear

QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
             max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True)
# Qwen3.5 text configs. 4B: ../shared/HYBRID.md (third-party copies of the config); 0.8B: two third-party copies of
# its config.json agree; 2B: hidden 2048 from a third-party copy, the other fields as the family's (24 layers,
# 8 query / 2 KV heads of 256, DeltaNet 16 + 16 heads of 128) and FFN 3 x hidden, not checked against the hub file
QWEN35 = dict(model_type="qwen3_5_text", vocab_size=248320, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7,
              max_position_embeddings=262144, tie_word_embeddings=True, qk_norm=True, partial_rotary_factor=0.25,
              attn_output_gate=True, zero_centred_norms=True, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4)


def hybrid(layers: int, **kw) -> ModelConfig:
    """A Qwen3.5 shape: every fourth layer gated full attention, the rest Gated DeltaNet."""
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))
    return ModelConfig(num_hidden_layers=layers, layer_types=types, **{**QWEN35, **kw})


SHAPES = {
    "tiny-target": lambda: read_config("tiny-target"),
    "qwen3-0.6b": lambda: ModelConfig(hidden_size=1024, intermediate_size=3072, **QWEN3),
    "qwen3-1.7b": lambda: ModelConfig(hidden_size=2048, intermediate_size=6144, **QWEN3),
    "qwen3-4b": lambda: ModelConfig(**{**QWEN3, "num_hidden_layers": 36, "num_attention_heads": 32},
                                    hidden_size=2560, intermediate_size=9728),
    "qwen3.5-0.8b": lambda: hybrid(24, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                                    num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16),
    "qwen3.5-2b": lambda: hybrid(24, hidden_size=2048, intermediate_size=6144, num_attention_heads=8,
                                  num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16),
    "qwen3.5-4b": lambda: hybrid(32, hidden_size=2560, intermediate_size=9216, num_attention_heads=16,
                                  num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32),
}
# each hybrid beside the pure-attention Qwen3 of about its parameter count; `--shapes hybrid` runs these pairs
BESIDE = {"qwen3.5-0.8b": "qwen3-0.6b", "qwen3.5-2b": "qwen3-1.7b", "qwen3.5-4b": "qwen3-4b"}
PRESETS = {"hybrid": [s for pair in BESIDE.items() for s in pair]}
MODES = {"fp32": torch.float32, "bf16": torch.bfloat16, "w4": torch.float32, "w4a8": torch.float32}
# the GGUF of each mode's llama.cpp column in benchmarks/shapes.py: DIR/shapes/<shape>-<kind>.gguf
# (benchmarks/shapes_gguf.py writes them)
GGUF_KINDS = {"fp32": "f32", "bf16": "bf16", "w4": "q4_0", "w4a8": "q4_0"}


def random_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> Transformer:
    """Random-init model of the shape in `dtype` (N(0, 0.02) matrices, unit norms, seed 0; speed does not depend
    on the values), allocated once in that dtype. benchmarks/shapes.py's rows, benchmarks/shapes_gguf.py (f32 and
    bf16 files), qad_lean.py and tree.py build the same models."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device="cpu")  # the dtype set on the meta tensors: one allocation, in it
    if cfg.tie_word_embeddings:  # to_empty gave the head its own storage; tied before the fill, it is never touched
        model.lm_head.weight = model.model.embed_tokens.weight  # (the head is the last parameter: values unchanged)
    gen = torch.Generator().manual_seed(0)
    zero_centred = {id(m.weight) for m in model.modules() if isinstance(m, ZeroCentredRMSNorm)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            # unit scale: y = w·x̂, or (1 + w)·x̂ for Qwen3.5's zero-centred norms
            if "norm" in name.split(".")[-2]:
                p.fill_(0.0 if id(p) in zero_centred else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model._set_rope(cfg.max_position_embeddings)
    return model


def widen_dense(model: Transformer, dtype: torch.dtype = torch.float32):
    """Every floating tensor outside the QuantLinears in `dtype`, in place (QuantLinear._apply would widen its bf16
    scales too); parameters keep their identity, so a tied head stays tied."""
    for m in model.modules():
        if not isinstance(m, QuantLinear):
            m._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)


def build(cfg: ModelConfig, mode: str, lm_head: str) -> Transformer:
    """Random-init model in the mode's dtype (W4: RTN g32 of the bf16 weights, the rest widened to float32), fused
    and with dense weights of bf16 values stored bf16, like the engine's loads (a W4 row's dense head: fp32 holds
    random bf16 values, fp32 rows' random fp32 weights stay fp32)."""
    w4 = mode in ("w4", "w4a8")
    model = random_model(cfg, torch.bfloat16 if w4 else MODES[mode]).eval()
    if w4:
        from specquant.quant.config import QuantConfig
        from specquant.quant.linear import set_w4_activations
        from specquant.quant.pipeline import quantize

        # bf16 scales: what `specquant quantize` writes for a bf16 checkpoint; its module choice (target_linears:
        # QuantConfig's default --ignore and DENSE_BY_KIND), not a list of our own
        quantize(model, QuantConfig(method="rtn", bits=4, group_size=32, symmetric=True), scale_dtype=torch.bfloat16)
        widen_dense(model, MODES[mode])
        set_lm_head(model, lm_head, torch.bfloat16)
        set_w4_activations(model, "int8" if mode == "w4a8" else "float")
    return for_decoding(model)


def gguf_path(root: Path, shape: str, mode: str) -> Path:
    return root / "shapes" / f"{shape}-{GGUF_KINDS[mode]}.gguf"


def gguf_weights(path: Path) -> dict:
    """From a GGUF's tensor table: the weight bytes one llama.cpp step reads (the same rule as weight_bytes: the
    embedding counts only when no separate output.weight exists, since it is then the head), bytes and tensor counts
    per GGML type, every matrix name pattern (blk.N -> blk.*) whose type is not the file's main type, and the
    types of the 1-D tensors (norms, biases, DeltaNet A and dt: F32 in every file)."""
    from gguf import GGUFReader  # the optional export extra; only read when a GGUF file is there

    from specquant.export.gguf import main_kind

    read = GGUFReader(path).tensors
    tensors = [(t.name, t.tensor_type.name, int(t.n_bytes)) for t in read]
    names = {name for name, _, _ in tensors}
    types: dict[str, dict] = {}
    for _, kind, n in tensors:
        row = types.setdefault(kind, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += n
    main = main_kind([t.tensor_type.name for t in read if len(t.shape) == 2])  # the rule the file type follows
    step = sum(n for name, _, n in tensors if name != "token_embd.weight" or "output.weight" not in names)
    other, vectors = {}, set()
    for t in read:
        if len(t.shape) < 2:
            vectors.add(t.tensor_type.name)
        elif t.tensor_type.name != main:
            other[re.sub(r"^blk\.\d+\.", "blk.*.", t.name)] = t.tensor_type.name
    return {"file": path.name, "bytes": path.stat().st_size, "weight_bytes": step, "main_type": main, "types": types,
            "other_types": dict(sorted(other.items())), "vector_types": sorted(vectors)}


def block_drafter(cfg: ModelConfig, mode: str, layers: int, block_size: int = 16, seed: int = 0):
    """A random-init block drafter (model/block_draft.py) for a target of shape cfg, laid out as the block kind loads
    one for an engine (fused, dense bf16 values stored bf16): its Linears dense fp32 ("fp32"), bf16-valued ("bf16"),
    or W4 RTN g32 with bf16 scales on float ("w4") or int8 ("w4a8") activations. Norm weights are away from one
    (seeded), so a wrong weight row shows where tests compare paths. Not attached to a target."""
    from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel, default_target_layer_ids
    from specquant.model.modules import Linear
    from specquant.quant.config import QuantConfig
    from specquant.quant.linear import set_w4_activations
    from specquant.quant.pipeline import _swap
    from specquant.quant.rtn import quantize_linear

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        draft = BlockDraftModel(BlockDraftConfig.for_target(cfg, num_hidden_layers=layers, block_size=block_size,
                                                            target_layer_ids=default_target_layer_ids(cfg)))
    draft = draft.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.normal_(0.0, 0.02, generator=gen)
                if mode != "fp32":
                    p.copy_(p.bfloat16().float())
    draft._set_rope(cfg.max_position_embeddings)
    if mode in ("w4", "w4a8"):  # every layer Linear, as quant.pipeline quantizes a model's (its RTN and swap)
        qcfg = QuantConfig(method="rtn", bits=4, group_size=32, symmetric=True).validate()
        for name, lin in [(n, m) for n, m in draft.layers.named_modules() if type(m) is Linear]:
            _swap(draft.layers, name, quantize_linear(name, lin, qcfg, torch.bfloat16), lin, qcfg.bits)
        set_w4_activations(draft, "int8" if mode == "w4a8" else "float")
    return for_decoding(draft, draft.layers).eval()


def streamed_bandwidth(reps: int = 5, mb: int = 1024) -> float:
    """Read bandwidth in GB/s: median of torch.sum over `mb` MB (past any LLC), all threads."""
    buf = torch.ones(mb * (1 << 20) // 4)
    buf.sum()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        samples.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(samples) / 1e9


def module_bytes(mod: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, without the tensors a QuantLinear backend derives from them
    (linear.DERIVED_BUFFERS, e.g. the native kernels' packed scales: a step reads one instead of weight_scale,
    which has as many or more bytes)."""
    seen = {id(t): t for t in list(mod.parameters()) + [b for n, b in mod.named_buffers() if
                                                         n.rsplit(".", 1)[-1] not in DERIVED_BUFFERS]}
    return sum(t.numel() * t.element_size() for t in seen.values())
