"""Ahead-of-time compiled decode steps: an AOTInductor package per step shape, built once, loaded by any later process.

torch.compile (decode.compiled) re-traces the model with dynamo in every process (1.5-3 s on the bundled target,
more than a short request's decode), so it cannot pay in a fresh process. An AOTInductor package is the same
inductor code compiled into a shared library ahead of time (`torch.export` + `aoti_compile_and_package`): a later
process only dlopens it (milliseconds), no tracing, no Python wrapper code.

What a package holds: the graph of one step shape (T tokens, last_only) over the model's static caches of one
capacity, for this process's thread count (inductor bakes the OpenMP thread count into its kernels). The weights
and the cache buffers are NOT in it (`aot_inductor.package_constants_in_so=False`): at load the step is bound to the
model's own tensors (`load_constants(user_managed=True)`: the library reads and writes them in place, no copy), so
one package serves every checkpoint with the same layout, and the eager prefill and the compiled steps share one
cache. Capacities are rounded up to a power of two (`capacity_for`) so few packages cover all request lengths.
This file knows nothing of what a cache holds: it goes through the Transformer's cache methods only.

Staleness: the package file name is a hash of everything the compiled code depends on (`package_key`): the model
config, every parameter / buffer name, shape and dtype (fused or not, quantized layouts), every module's settings
(extra_repr: a W4 layer's backend and activations), the source of every module class in the model, of its caches,
of the functions their modules import from specquant (the gated delta rule) and of this file, torch's version, the
step shape, the caches' own layouts (`Transformer.cache_layout`: every layer's cache kind, buffers and settings),
and the thread count. Before keying, `settle` runs one eager step so
that lazily prepared state (a W4 layer's kernel layout) exists in every process. Changing any of them looks up
another file; nothing is ever invalidated in place. Files are written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from specquant.decode.compile_cache import compile_cache_dir, use_compile_cache
from specquant.errors import SpecquantError
from specquant.model.decoder import Transformer
from specquant.model.rope import apply_rope

log = logging.getLogger(__name__)

MIN_CAPACITY = 256  # smallest cache capacity a package is built for (requests of up to this many positions share it)
AOT_MODES = ("off", "cached", "build")  # Stepper(aot=...): never / when a package is on disk / build missing ones


@dataclasses.dataclass
class AotConfig:
    """How `specquant generate` runs its decode steps. Default "cached": a packaged step beats the eager one in a
    fresh process whenever the package exists (benchmarks/compile_start.py at dfedb37, docs/SHAPES.md "Compiled steps"),
    but a build costs more than any single request saves, so it is never built unasked."""

    aot: str = dataclasses.field(default="cached", metadata={
        "choices": AOT_MODES,
        "help": "AOTInductor-packaged steps (the decode step; speculative: the full-length verify step and the "
                "LM draft's steps). 'cached' uses them when on disk (under $SPECQUANT_CACHE/compile/aot) and runs "
                "eagerly otherwise; 'build' builds missing ones first (~25 s each on one core, once per machine, "
                "thread count and request-length bucket); 'off': always eager"})


def capacity_for(need: int, max_positions: int) -> int:
    """Cache capacity of a request needing `need` positions: the next power of two >= MIN_CAPACITY, at most the
    model's context (and never less than need), so requests of similar length share one package."""
    cap = MIN_CAPACITY
    while cap < need:
        cap *= 2
    return max(need, min(cap, max_positions))


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied ones under each of their names (what a package's constants are)."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None)
    return out


def _imported_sources(cls: type) -> set[str]:
    """Source files of the specquant functions and classes imported into cls's module (one level: what its code
    can call by name without being a module class itself)."""
    module = inspect.getmodule(cls)
    out = set()
    for value in vars(module).values() if module is not None else ():
        if ((inspect.isfunction(value) or inspect.isclass(value))
                and (getattr(value, "__module__", None) or "").startswith("specquant.")):
            try:
                out.add(inspect.getsourcefile(value))
            except TypeError:  # pragma: no cover - a builtin re-exported under our name
                pass
    return {f for f in out if f}


def _source_digest(model: Transformer) -> str:
    """Hash of the source files of every module class in the model (decoder, rope via decoder's import, ...)."""
    # the caches' classes whether or not caches are set up yet (made on the meta device: no memory), so the key
    # computed before setup_cache equals the one computed after it
    caches = model.make_caches(1, 1, device="meta")
    modules = [*model.modules(), *(c for c in caches if c is not None)]
    files = {inspect.getsourcefile(type(m)) for m in modules} | {__file__, inspect.getsourcefile(apply_rope)}
    # and the files of our functions those classes' modules call (gated_delta.py's rule for deltanet.py's mixer)
    files |= {f for m in modules for f in _imported_sources(type(m))}
    h = hashlib.sha256()
    for f in sorted(p for p in files if p):
        h.update(f.encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()


def package_key(model: Transformer, t: int, last_only: bool, cache: dict) -> str:
    """Hash of everything a compiled step depends on (see the module docstring). cache: the static caches' layout
    (Transformer.cache_layout), so the key is known before the caches exist; the installed caches' buffers and
    modules are left out of the model's own layout and settings for the same reason."""
    installed = [c for c in model.caches() if c is not None]
    cache_tensors = {id(b) for c in installed for b in c.buffers()}
    cache_modules = {id(m) for c in installed for m in c.modules()}
    layout = sorted((n, tuple(x.shape), str(x.dtype), x.device.type) for n, x in _tensors(model).items()
                    if id(x) not in cache_tensors)
    # module settings that change the traced graph without changing any tensor (a W4 layer's activations and
    # backend are in its extra_repr)
    settings = [f"{n}: {m.extra_repr()}" for n, m in model.named_modules()
                if id(m) not in cache_modules and m.extra_repr()]
    spec = {"config": dataclasses.asdict(model.config), "layout": layout, "modules": settings,
            "source": _source_digest(model),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "t": t, "last_only": last_only,
            "cache": cache}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:32]


def package_path(key: str) -> Path:
    return compile_cache_dir() / "aot" / f"step-{key}.pt2"


class _Step(nn.Module):
    """The exported function: tokens [batch, T] at positions input_pos [T] -> logits, on the static cache."""

    def __init__(self, model: Transformer, last_only: bool):
        super().__init__()
        self.model, self.last_only = model, last_only

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, 0, self.last_only, input_pos)


PREFIX = "model."  # _Step holds the model under this name: package constant fqn = PREFIX + model tensor name


def _refused(what: str, t: int, e: Exception) -> SpecquantError:
    """One line for a model inductor cannot take (e.g. a layer that calls a ctypes kernel)."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return SpecquantError(f"cannot {what} this model's {t}-token step for an AOT package ({type(e).__name__}: "
                          f"{first}); decode without it (--aot off)")


def build_package(model: Transformer, t: int, last_only: bool, path: Path) -> Path:
    """Export one step shape of `model` (settled and its static cache set up, as `prepare` leaves it) and compile
    it into a package at path."""
    import torch._inductor  # noqa: F401 (heavy: only the process that builds imports it)

    use_compile_cache()  # inductor's own caches (precompiled headers, FX graphs) beside the packages

    batch = model.cache_batch()
    device = model.model.embed_tokens.weight.device
    example = (torch.zeros(batch, t, dtype=torch.long, device=device), torch.arange(t, device=device))
    try:
        with torch.no_grad():
            exported = torch.export.export(_Step(model, last_only), example, strict=False)
    except Exception as e:  # noqa: BLE001 (any tracing failure means: no package for this model, keep eager)
        raise _refused("export", t, e) from e
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt2")  # inductor wants .pt2
    os.close(fd)
    try:
        # always_keep_tensor_constants: inductor otherwise inlines every 1-D constant of <= 8 elements as literals
        # (GraphLowering.can_inline_constant), which would bake a build-time value of a small weight (DeltaNet's
        # A_log, dt_bias) or a cache's read-only offset into the package instead of binding the model's tensor
        torch._inductor.aoti_compile_and_package(
            exported, package_path=tmp, inductor_configs={"aot_inductor.package_constants_in_so": False,
                                                          "always_keep_tensor_constants": True})
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole package or none
    except Exception as e:  # noqa: BLE001
        raise _refused("compile", t, e) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class AotStep:
    """A loaded package bound to a model's tensors: `step(tokens [batch, T], input_pos [T]) -> logits`."""

    def __init__(self, path: Path, model: Transformer):
        # torch._C._aoti's loader is what torch._inductor.aoti_load_package wraps; called directly because the
        # public function imports inductor and parses the archive's metadata in Python, 2.5 s per process here
        # against milliseconds for the loader (measured in docs/SHAPES.md, "Compiled steps")
        loader_cls = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
        if loader_cls is not None:
            self.loader = loader_cls(str(path), "model", False, 1, -1)
        else:  # pragma: no cover - other torch builds
            self.loader = torch._inductor.aoti_load_package(str(path)).loader
        self.bound = None
        self.bind(model)

    def bind(self, model: Transformer):
        """Point the package's constants at the model's current tensors (again after its cache is reallocated)."""
        tensors = _tensors(model)
        key = tuple(t.data_ptr() for t in tensors.values())
        if key == self.bound:
            return
        names = self.loader.get_constant_fqns()
        missing = [n for n in names if n[len(PREFIX):] not in tensors]
        if missing:
            raise SpecquantError(f"AOT package does not match the model (no tensor {missing[0]!r}); delete "
                                 f"{compile_cache_dir() / 'aot'} and build again")
        # args: constants, use_inactive, check_full_update, user_managed (the library uses our tensors in place)
        self.loader.load_constants({n: tensors[n[len(PREFIX):]] for n in names}, False, True, True)
        self.model_tensors = tensors  # held: the library keeps raw pointers into them
        self.bound = key

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.loader.boxed_run([tokens, input_pos])[0]


def settle(model: Transformer, batch: int) -> None:
    """One eager one-token forward, so that modules which prepare state lazily on their first call have done it
    before a package is keyed, built or bound: a W4 layer permutes its codes into its native kernel's layout and
    packs its scales (QuantLinear.native_scales), and a package reads those buffers as they are. Without it a fresh
    process would bind a package to codes still in the checkpoint's layout. What it writes to a cache is reset by
    setup_cache."""
    device = model.model.embed_tokens.weight.device
    with torch.no_grad():
        model(torch.zeros(batch, 1, dtype=torch.long, device=device), 0, True)


def package_paths(model: Transformer, shapes: tuple[tuple[int, bool], ...], batch: int,
                  layout: dict) -> dict[tuple[int, bool], Path]:
    """The package file of each (T, last_only) step for caches of `layout` (Transformer.cache_layout), the model
    settled first so that its key is the one any process computes."""
    settle(model, batch)
    return {shape: package_path(package_key(model, *shape, layout)) for shape in shapes}


def prepare(model: Transformer, shapes: tuple[tuple[int, bool], ...], batch: int, max_seq_len: int, cache_kw: dict,
            build: bool, loaded: dict[str, AotStep],
            keys: dict | None = None) -> dict[tuple[int, bool], AotStep]:
    """Packaged steps for one request, by (T, last_only), with the model's static cache set up for them; {} when
    a package is missing (and build is False) or cannot be loaded, and the caller decodes eagerly.

    loaded: the caller's packages already loaded in this process, by file name (filled here). keys: the caller's
    package paths already worked out for this model in this process, by cache layout and thread count (filled
    here), or None to work them out every time. A server asks for the same layouts request after request, and
    settling and keying (an eager forward, hashing every tensor's name and the model's source files) cost it a
    few percent of a short request each time for the same answer; `package_paths` is the uncached reference."""
    capacity = capacity_for(max_seq_len, model.config.max_position_embeddings)
    # keyed on the buffers setup_cache will make, so equal layouts asked for differently share a package
    layout = model.cache_layout(batch, capacity, static=True, **cache_kw)
    memo = (json.dumps(layout, sort_keys=True, default=str), torch.get_num_threads(), tuple(shapes))
    paths = None if keys is None else keys.get(memo)
    if paths is None:
        # a layout's first request settles and keys as without a memo: the model's lazily prepared state, made
        # by the first settle, never changes after, so neither does the key
        paths = package_paths(model, shapes, batch, layout)
        if keys is not None:
            keys[memo] = paths
    if not build and not all(p.exists() for p in paths.values()):
        return {}
    model.setup_cache(batch, capacity, static=True, **cache_kw)
    if [None if c is None else c.layout() for c in model.caches()] != layout["layers"]:
        model.clear_cache()  # a larger cache kept from an earlier request: the package's is exactly `layout`
        model.setup_cache(batch, capacity, static=True, **cache_kw)
    steps = {}
    for shape, path in paths.items():
        if path.name not in loaded:
            if not path.exists():
                build_package(model, *shape, path)
            try:
                loaded[path.name] = AotStep(path, model)
            except (RuntimeError, SpecquantError) as e:  # e.g. a library this machine cannot load
                if build:
                    raise SpecquantError(f"cannot load AOT package {path} ({str(e).splitlines()[0][:200]}); "
                                         "delete it and build again") from e
                log.warning("AOT package %s could not be loaded (%s); decoding eagerly", path,
                            str(e).splitlines()[0][:200])
                return {}
        steps[shape] = loaded[path.name]
        steps[shape].bind(model)
    model.reset_cache()  # a new request: no slot holds a position yet
    return steps
