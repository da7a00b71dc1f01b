"""specquant.runtime: the OpenMP wait defaults set before torch loads, and what other programs inherit."""

import os
import subprocess
import sys

import pytest

from specquant import runtime
from specquant.runtime import SPIN_ENV, apply_openmp_wait, child_env, openmp_wait


@pytest.fixture
def state(monkeypatch):
    monkeypatch.setitem(runtime._state, "applied", None)
    return runtime._state


def test_defaults_are_set_only_on_a_clean_environment_before_torch(state):
    env = {"PATH": "/bin"}
    assert apply_openmp_wait(env, torch_loaded=False) == "specquant"
    assert env == {"PATH": "/bin", **SPIN_ENV}
    assert int(env["GOMP_SPINCOUNT"]) < 30_000_000_000  # bounded: ACTIVE alone spins for minutes when idle


@pytest.mark.parametrize("env, why", [
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "user"),
    ({"GOMP_SPINCOUNT": "10"}, "user"),  # any one key the user set: all three are left alone
    ({"SPECQUANT_OMP_WAIT": "off"}, "off"),
    ({}, "late"),
])
def test_the_environment_is_left_alone_when_the_user_chose_or_torch_is_loaded(state, env, why):
    before = dict(env)
    assert apply_openmp_wait(env, torch_loaded=why == "late") == why
    assert env == before
    assert state["applied"] == why


def test_child_env_drops_only_what_specquant_set(state):
    env = {"PATH": "/bin", **SPIN_ENV}
    state["applied"] = "specquant"
    assert child_env(env) == {"PATH": "/bin"}
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # a value that is not ours stays
    assert child_env(env) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    state["applied"] = "user"  # the user's own settings reach the child whole
    assert child_env({"PATH": "/bin", **SPIN_ENV}) == {"PATH": "/bin", **SPIN_ENV}


def _child(env: dict) -> str:
    code = ("import specquant, os, torch; from specquant.runtime import openmp_wait; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), '|', openmp_wait())")
    base = {k: v for k, v in os.environ.items() if k not in SPIN_ENV and k != runtime.OFF_ENV}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_fresh_process_gets_the_defaults_or_keeps_the_users():
    fresh = _child({})  # one process for both checks of the clean environment (each child imports torch)
    assert fresh.startswith(f"ACTIVE {SPIN_ENV['GOMP_SPINCOUNT']} | ") and "specquant's defaults" in fresh
    assert _child({"OMP_WAIT_POLICY": "PASSIVE"}).startswith("PASSIVE None | ")
    assert _child({"SPECQUANT_OMP_WAIT": "off"}).startswith("None None | ")


def test_openmp_wait_names_the_setting_and_who_chose_it(state, monkeypatch):
    for k, v in SPIN_ENV.items():
        monkeypatch.setenv(k, v)
    state["applied"] = "specquant"
    assert openmp_wait() == ("OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=1000000, KMP_BLOCKTIME=20 "
                             "(specquant's defaults)")
    for k in SPIN_ENV:
        monkeypatch.delenv(k)
    state["applied"] = "late"
    assert openmp_wait() == "OpenMP's defaults (torch was imported before specquant)"
