"""HF checkpoint directories: config.json + model.safetensors (or a sharded index) + tokenizer files.

Only safetensors is read (never pickle) and no remote code runs. Bundled models are addressed by name.
This file knows dense tensors only; `specquant.loader.load_model`, above model/ and quant/, is the one entry point
that reads a checkpoint's `quantization_config` and composes the two. Block drafters (DFlashDraftModel) are saved
and loaded dense here as well; specquant.drafter_loader composes their quantized loading.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specquant.errors import SpecquantError
from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.layers import layer_kinds
from specquant.util.dtypes import parse_dtype
from specquant.util.files import atomic_dir

log = logging.getLogger(__name__)

# Tensor names of checkpoints that wrap the text model (Qwen3_5ForConditionalGeneration): its prefix is renamed to
# the decoder's, the vision tower is ignored (specquant runs the text model), and the multi-token-prediction head
# (mtp.*, which transformers drops on load) is kept beside the decoder for an MTP drafter and saved back with it.
TEXT_PREFIXES = {"model.language_model.": "model."}
IGNORED_PREFIXES = ("model.visual.",)
KEPT_PREFIXES = ("mtp.",)

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "models"
BUNDLED = ("tiny-target", "tiny-draft", "tiny-block-draft", "tiny-hybrid", "tiny-hybrid-block-draft")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja")


def resolve(name_or_dir: str | os.PathLike) -> Path:
    """A bundled model name (BUNDLED: tiny-target, tiny-hybrid, ...) or a local directory -> an existing directory."""
    s = str(name_or_dir)
    if s in BUNDLED:
        path = BUNDLED_DIR / s
        if not (path / "config.json").exists():
            raise SpecquantError(f"bundled model {s!r} is missing its files at {path}; reinstall specquant")
        return path
    path = Path(s).expanduser()
    if not path.exists():
        raise SpecquantError(
            f"model directory {s!r} does not exist; pass a local HF checkpoint directory or one of: {', '.join(BUNDLED)}"
        )
    if not path.is_dir():
        raise SpecquantError(f"model path {s!r} is a file; pass the checkpoint directory that holds config.json")
    if not (path / "config.json").exists():
        raise SpecquantError(f"no config.json in {s!r}; an HF checkpoint directory needs config.json + *.safetensors")
    return path


def read_hf_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise SpecquantError(f"{path / 'config.json'} is not valid JSON ({e}); restore the file") from None


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig.from_hf, with the layer kinds checked against the table too: every config error, before any
    tensor is read."""
    cfg = ModelConfig.from_hf(hf)
    layer_kinds(cfg)
    return cfg


def read_config(name_or_dir) -> ModelConfig:
    return config_from_hf(read_hf_config(resolve(name_or_dir)))


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise SpecquantError(f"{index} is not a valid safetensors index ({e}); restore the file") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise SpecquantError(f"shard {f.name} listed in {index.name} is missing from {path}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise SpecquantError(
            f"{path} holds only pickle weights (*.bin/*.pt); specquant loads safetensors only — convert with "
            "transformers' save_pretrained(safe_serialization=True) in a trusted environment"
        )
    raise SpecquantError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise SpecquantError(f"corrupt safetensors file {f}: {e}; re-download or re-save the checkpoint") from None
    return tensors


class TensorReader:
    """A checkpoint's tensors read one at a time, under the decoder's names (text_name): for work that holds one
    layer of a model at a time. Each read opens the file and closes it again, so no mapping of the whole file stays
    in the process (its resident size counts mapped pages: a 17 GB teacher read over a run would show up there)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._where: dict[str, tuple[Path, str]] = {}
        for f in _safetensors_files(path):
            try:
                with safe_open(str(f), framework="pt") as handle:
                    names = list(handle.keys())
            except (SafetensorError, OSError) as e:
                raise SpecquantError(f"corrupt safetensors file {f}: {e}; re-download or re-save the checkpoint") \
                    from None
            for name in names:
                if not name.startswith(IGNORED_PREFIXES):
                    self._where[text_name(name)] = (f, name)

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise SpecquantError(f"tensor {name!r} is missing from the checkpoint")
        return self._read([name])[name]

    def under(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with prefix, the prefix removed."""
        found = self._read([n for n in self._where if n.startswith(prefix)])
        return {n[len(prefix):]: t for n, t in found.items()}

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._where[n][0], []).append(n)
        out = {}
        for f, ns in by_file.items():
            with safe_open(str(f), framework="pt") as handle:
                for n in ns:
                    out[n] = handle.get_tensor(self._where[n][1])
        return out


def load_submodule(module: torch.nn.Module, tensors: dict[str, torch.Tensor], device, dtype: torch.dtype):
    """Materialize a meta-device submodule on device in dtype (floating tensors; integer buffers keep theirs) and
    fill every parameter and persistent buffer from tensors ({name relative to module: tensor}), with
    load_dense_into's name, shape and integer-dtype checks."""
    module.to_empty(device=device)
    module.to(dtype)
    expected = module.state_dict(keep_vars=True)
    for name, p in expected.items():
        _copy_checked(name, p, tensors)
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise SpecquantError(f"checkpoint has {len(unexpected)} tensors this module does not use, e.g. "
                             f"{unexpected[0]!r}")
    return module


def text_name(name: str) -> str:
    """A wrapped checkpoint's tensor or module name (model.language_model.*) -> the decoder's (model.*)."""
    prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
    return name if prefix is None else TEXT_PREFIXES[prefix] + name[len(prefix):]


def wrapped_names(name: str) -> list[str]:
    """The decoder's module name and what each wrapping checkpoint layout calls it (text_name's inverse)."""
    return [name, *(wrap + name[len(short):] for wrap, short in TEXT_PREFIXES.items() if name.startswith(short))]


def split_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's tensors -> (the decoder's, under its names; the kept extras: mtp.*), vision tower dropped."""
    decoder, kept, ignored = {}, {}, 0
    for name, t in tensors.items():
        if name.startswith(IGNORED_PREFIXES):
            ignored += 1
        elif name.startswith(KEPT_PREFIXES):
            kept[name] = t
        else:
            decoder[text_name(name)] = t
    if ignored:
        log.info("checkpoint: ignoring %d vision-tower tensors (%s); specquant runs the text model", ignored,
                 ", ".join(f"{p}*" for p in IGNORED_PREFIXES))
    return decoder, kept


def load_dense(name_or_dir, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu") -> Transformer:
    """A dense (unquantized) checkpoint as a Transformer: the half of specquant.loader.load_model that model/ owns,
    for callers below the loader (e.g. the quantizer's CLI, which only ever reads dense checkpoints)."""
    path = resolve(name_or_dir)
    hf = read_hf_config(path)
    if hf.get("quantization_config"):
        raise SpecquantError(f"{path} is quantized (config.json has quantization_config); load it with "
                             "specquant.loader.load_model")
    cfg = config_from_hf(hf)  # before reading tensors: a config error is the one to report
    tensors, kept = split_tensors(load_tensors(path))
    log.info("loading %s from %s", cfg.describe(), path)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device).to(parse_dtype(dtype))
    load_dense_into(model, tensors)
    model.init_non_persistent(device)
    model.extra_tensors = kept
    return model.eval()


def load_dense_into(model: Transformer, tensors: dict[str, torch.Tensor]):
    """Copy tensors into the model's parameters and persistent buffers (e.g. QuantLinear's packed codes), checking
    names, shapes and integer dtypes; a tied lm_head may be absent."""
    expected = model.state_dict(keep_vars=True)
    tied = model.config.tie_word_embeddings
    for name, p in expected.items():
        if name == "lm_head.weight" and tied:
            continue
        _copy_checked(name, p, tensors)
    unexpected = set(tensors) - set(expected) - {"lm_head.weight"}
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if unexpected:
        raise SpecquantError(
            f"checkpoint has {len(unexpected)} tensors this architecture does not use, e.g. {sorted(unexpected)[0]!r}"
        )


def state_dict_for_save(model: Transformer) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def copy_tokenizer(src: Path, dst: Path):
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def save_model(model: Transformer, out, tokenizer_from=None, extra_config: dict | None = None,
               tensors: dict[str, torch.Tensor] | None = None, overwrite: bool = False):
    """Write an HF-layout checkpoint atomically: config.json (with the model's `quantization` as its
    quantization_config, if any), model.safetensors, and the tokenizer files of `tokenizer_from`. A non-empty `out`
    specquant did not create is replaced only with overwrite=True (util.files.atomic_dir)."""
    from specquant.model.fuse import check_unfused

    check_unfused(model, "save")
    out = Path(out)
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    if model.quantization:
        hf["quantization_config"] = model.quantization
    if extra_config:
        hf.update(extra_config)
    tensors = dict(tensors if tensors is not None else state_dict_for_save(model))
    for name, t in model.extra_tensors.items():  # mtp.*: not the decoder's, but part of the checkpoint
        tensors.setdefault(name, t)
    with atomic_dir(out, overwrite) as tmp:
        save_file({k: v.cpu() for k, v in tensors.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if tokenizer_from is not None:
            copy_tokenizer(Path(tokenizer_from) if Path(tokenizer_from).is_dir() else resolve(tokenizer_from), tmp)
    return out


def save_block_drafter(model: BlockDraftModel, out, extra_config: dict | None = None,
                       tensors: dict[str, torch.Tensor] | None = None, tokenizer_from=None):
    """Write a block drafter's config.json + model.safetensors atomically in the DFlashDraftModel layout: tensor
    names are the reference's (fc, hidden_norm, layers.N.*, norm), without embed_tokens / lm_head (the target's)."""
    hf = model.config.to_hf()
    tensors = tensors if tensors is not None else {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    hf["torch_dtype"] = str(tensors["fc.weight"].dtype).removeprefix("torch.") if "fc.weight" in tensors else None
    if extra_config:
        hf.update(extra_config)
    with atomic_dir(Path(out)) as tmp:
        save_file({k: v.cpu() for k, v in tensors.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if tokenizer_from is not None:
            copy_tokenizer(resolve(tokenizer_from), tmp)
    return Path(out)


def load_block_draft_dense(path, hf: dict, dtype=torch.float32, device="cpu") -> BlockDraftModel:
    """A dense block drafter from the checkpoint directory `path` whose config.json dict is `hf` (quantized ones:
    specquant.drafter_loader.load_block_draft, above model/ and quant/)."""
    cfg = BlockDraftConfig.from_hf(hf)
    tensors = load_tensors(path)
    with torch.device("meta"):
        model = BlockDraftModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model._set_rope(cfg.max_position_embeddings)
    load_dense_into(model, tensors)
    model.source_path = path
    return model.eval()


def load_tokenizer(name_or_dir):
    """transformers' AutoTokenizer from a local directory only; never remote code."""
    from transformers import AutoTokenizer

    path = resolve(name_or_dir)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise SpecquantError(f"no tokenizer files (tokenizer.json) in {path}; copy them from the base model")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def _copy_checked(name: str, p: torch.Tensor, tensors: dict) -> None:
    """Copy tensors[name] into p after the name, shape and integer-dtype checks; the copy converts the dtype in the
    same pass (no temporary copy of a bf16 checkpoint)."""
    if name not in tensors:
        raise SpecquantError(f"tensor {name!r} is missing from the checkpoint (shape {list(p.shape)} expected)")
    t = tensors[name]
    if tuple(t.shape) != tuple(p.shape):
        raise SpecquantError(f"tensor {name!r} has shape {list(t.shape)}; the config implies {list(p.shape)}")
    if not p.is_floating_point() and t.dtype != p.dtype:
        raise SpecquantError(f"tensor {name!r} has dtype {t.dtype}; this layer needs {p.dtype}")
    with torch.no_grad():
        p.data.copy_(t)
