"""HF checkpoint directories: config.json + model.safetensors (or a sharded index) + tokenizer files.

Only safetensors is read (never pickle) and no remote code runs. Bundled models are addressed by name.
Quantized checkpoints (config.json `quantization_config`) are handed to `specquant.quant.checkpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "models"
BUNDLED = ("tiny-target", "tiny-draft")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve(name_or_dir: str | os.PathLike) -> Path:
    """A bundled model name (tiny-target, tiny-draft) or a local directory -> an existing directory."""
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


def read_config(name_or_dir) -> ModelConfig:
    return ModelConfig.from_hf(read_hf_config(resolve(name_or_dir)))


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


def load_model(name_or_dir, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
               fuse: bool = False) -> Transformer:
    """Build the decoder for a checkpoint and load its weights (dense or compressed-tensors INT4/INT8).

    fuse: fuse q/k/v and gate/up projections for decoding (model.fuse; the model can then not be saved or
    quantized)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise SpecquantError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    path = resolve(name_or_dir)
    hf = read_hf_config(path)
    cfg = ModelConfig.from_hf(hf)
    tensors = load_tensors(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    if hf.get("quantization_config"):
        from specquant.quant.checkpoint import load_quantized_into

        load_quantized_into(model, tensors, hf["quantization_config"], dtype, device)
    else:
        model = model.to_empty(device=device).to(dtype)
        load_dense_into(model, tensors)
    if cfg.tie_word_embeddings:  # to_empty gave lm_head its own uninitialized tensor (never loaded): tie it again
        model.lm_head.weight = model.model.embed_tokens.weight
    model._set_rope(cfg.max_position_embeddings)
    model.rope_cos, model.rope_sin = model.rope_cos.to(device), model.rope_sin.to(device)
    model.source_path = path
    if fuse:
        from specquant.model.fuse import fuse_projections

        fuse_projections(model)
    return model.eval()


def load_dense_into(model: Transformer, tensors: dict[str, torch.Tensor]):
    """Copy tensors into the model's parameters and persistent buffers (e.g. QuantLinear's packed codes), checking
    names, shapes and integer dtypes; a tied lm_head may be absent."""
    expected = model.state_dict(keep_vars=True)
    tied = model.config.tie_word_embeddings
    for name, p in expected.items():
        if name == "lm_head.weight" and tied:
            continue
        if name not in tensors:
            raise SpecquantError(f"tensor {name!r} is missing from the checkpoint (shape {list(p.shape)} expected)")
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise SpecquantError(f"tensor {name!r} has shape {list(t.shape)}; the config implies {list(p.shape)}")
        if not p.is_floating_point() and t.dtype != p.dtype:
            raise SpecquantError(f"tensor {name!r} has dtype {t.dtype}; this layer needs {p.dtype}")
        with torch.no_grad():
            p.data.copy_(t.to(p.dtype))
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


def atomic_dir(out: Path):
    """Context: yields a temp dir beside `out`; on success it replaces `out`, on error it is removed."""
    return _AtomicDir(Path(out))


class _AtomicDir:
    def __init__(self, out: Path):
        self.out = out

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        # mkdtemp and some writers create owner-only files; a checkpoint is ordinary readable data
        os.chmod(self.tmp, 0o755)
        for f in self.tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            self.out.rename(old)
            self.tmp.rename(self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.tmp.rename(self.out)
        return False


def copy_tokenizer(src: Path, dst: Path):
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def save_model(model: Transformer, out, tokenizer_from=None, extra_config: dict | None = None,
               tensors: dict[str, torch.Tensor] | None = None):
    """Write an HF-layout checkpoint atomically: config.json, model.safetensors, tokenizer files."""
    from specquant.model.fuse import check_unfused

    check_unfused(model, "save")
    out = Path(out)
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    if extra_config:
        hf.update(extra_config)
    tensors = tensors if tensors is not None else state_dict_for_save(model)
    with atomic_dir(out) as tmp:
        save_file({k: v.cpu() for k, v in tensors.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        src = tokenizer_from or getattr(model, "source_path", None)
        if src is not None:
            copy_tokenizer(Path(src) if Path(src).is_dir() else resolve(src), tmp)
    return out


def load_tokenizer(name_or_dir):
    """transformers' AutoTokenizer from a local directory only; never remote code."""
    from transformers import AutoTokenizer

    path = resolve(name_or_dir)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise SpecquantError(f"no tokenizer files (tokenizer.json) in {path}; copy them from the base model")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
