"""Make `lm_eval --model specquant` work from the shell.

lm-eval's plugin mechanism is the `lm_eval.models` entry-point group (pyproject.toml declares
`specquant = "specquant.gate.backend:SpecquantLM"`): releases with entry-point discovery find the backend with no
further step. lm-eval 0.4.13, the newest release on PyPI, predates that discovery and offers no other way for a
shell `lm_eval` to import an out-of-tree model (its docs say to edit lm_eval/models/__init__.py). This module is the
bridge: `python -m specquant.gate.plugin` (run by scripts/setup.sh) writes a one-line `.pth` file into
site-packages that installs an import hook; when lm-eval's registry module is imported, the hook registers this
environment's `lm_eval.models` entry points as lazy placeholders, exactly as newer lm-eval does itself. Nothing is
imported until lm-eval is, and the backend module (torch, the engine) only when `--model specquant` is asked for.
Importing this module has no side effect; only `install_hook()` (what the .pth calls) does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import sysconfig
from pathlib import Path

REGISTRY_MODULE = "lm_eval.api.registry"
ENTRY_POINT_GROUP = "lm_eval.models"
PTH_NAME = "specquant-lm-eval-plugin.pth"
PTH_LINE = "import specquant.gate.plugin as _p; _p.install_hook()\n"


def register_entry_points(registry) -> list[str]:
    """Register every `lm_eval.models` entry point lm-eval does not already know; returns the names added."""
    import lm_eval.models  # noqa: F401  (its built-in placeholders first: get_model skips them once non-empty)

    added = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in registry.model_registry:
            # the "module:attr" string, not the EntryPoint: 0.4.13 upgrades only string placeholders in place when
            # the module's own @register_model runs
            registry.model_registry.register(ep.name, target=ep.value)
            added.append(ep.name)
    return added


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        register_entry_points(module)


class _RegistryHook(importlib.abc.MetaPathFinder):
    """Finds lm-eval's registry module with the normal path finder and registers entry points once it has run."""

    def find_spec(self, name, path, target=None):
        if name != REGISTRY_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install_hook():
    if REGISTRY_MODULE in sys.modules:  # already imported: register now
        register_entry_points(sys.modules[REGISTRY_MODULE])
    elif not any(isinstance(f, _RegistryHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryHook())


def install(site_packages: str | None = None) -> Path:
    """Write the .pth file into site-packages (the running interpreter's by default); idempotent."""
    target = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    if not (target.exists() and target.read_text() == PTH_LINE):
        target.write_text(PTH_LINE)
    return target


if __name__ == "__main__":
    print(f"wrote {install()}")
