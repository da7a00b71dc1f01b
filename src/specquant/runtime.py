"""Process-wide runtime defaults that must be in place before torch loads: how OpenMP's worker threads wait.

A decode step is a few hundred short parallel regions (each layer's linears, the head, the norms' and the delta
rule's kernels) with a few microseconds of Python between them. torch's CPU wheels run them on GNU OpenMP
(libgomp), whose idle workers spin only 100 iterations before sleeping on a futex whenever it counts more managed
threads than CPUs (its "throttled" case, which a 2-core machine with torch's pools is in), so each region pays a
wake-up: about a quarter of a one-token step at the Qwen3.5-4B shape on 2 threads (docs/BENCH.md, "OpenMP's
wait"). llama.cpp's own thread pool polls between its ops for the same reason.

So, unless the user set any of these, specquant sets OMP_WAIT_POLICY=ACTIVE with a bounded spin:
GOMP_SPINCOUNT (libgomp: ACTIVE alone spins 30 billion iterations, i.e. idle workers burn a core for minutes) and
KMP_BLOCKTIME in ms (the LLVM / Intel runtimes other torch builds use). About 20 ms of spinning after the last
region, then the workers sleep as before, so an idle server does not burn its cores.

OpenMP reads these once, when its library loads (`import torch`), so this module is imported by the package's
__init__ before anything imports torch. A program that imported torch before specquant keeps OpenMP's own
defaults: `openmp_wait()` says which is in effect, and the benchmarks print it. SPECQUANT_OMP_WAIT=off leaves the
environment alone (the A/B of the measurement above).
"""

from __future__ import annotations

import os
import sys

# the defaults, per runtime: libgomp's spin count is in iterations of a pause loop (1e6: ~20 ms on a Zen 5 core)
SPIN_ENV = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000000", "KMP_BLOCKTIME": "20"}
OFF_ENV = "SPECQUANT_OMP_WAIT"  # "off": do not touch the environment

_state = {"applied": None}  # set by apply_openmp_wait: "specquant", "user", "off" or "late"


def apply_openmp_wait(environ=os.environ, torch_loaded: bool | None = None) -> str:
    """Set SPIN_ENV in environ where the user set none of its keys and torch is not loaded yet. Returns why the
    environment is as it is: "specquant" (set here), "user" (the user set one of the keys: all left alone), "off"
    (SPECQUANT_OMP_WAIT=off) or "late" (torch was already loaded: too late for OpenMP to read them)."""
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    if environ.get(OFF_ENV, "").lower() in ("off", "0", "no", "false"):
        why = "off"
    elif any(k in environ for k in SPIN_ENV):
        why = "user"
    elif torch_loaded:
        why = "late"
    else:
        environ.update(SPIN_ENV)
        why = "specquant"
    _state["applied"] = why
    return why


def openmp_wait() -> str:
    """One line for logs and benchmark headers: how OpenMP's workers wait in this process, and who chose it."""
    keys = ", ".join(f"{k}={os.environ[k]}" for k in SPIN_ENV if k in os.environ) or "OpenMP's defaults"
    why = {"specquant": "specquant's defaults", "user": "set by the user", "off": f"{OFF_ENV}=off",
           "late": "torch was imported before specquant", None: "not applied"}[_state["applied"]]
    return f"{keys} ({why})"


def child_env(environ=os.environ) -> dict:
    """The environment for another program (llama.cpp's binaries, which run their own OpenMP): the caller's,
    less what apply_openmp_wait set, so a tool beside ours runs on its own defaults (a specquant child sets them
    again when it imports specquant)."""
    env = dict(environ)
    if _state["applied"] == "specquant":
        for k, v in SPIN_ENV.items():
            if env.get(k) == v:
                del env[k]
    return env
