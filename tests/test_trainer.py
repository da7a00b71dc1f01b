"""The shared training loop: SIGKILL + resume is bit-identical; 2-process torchrun (gloo) matches 1 process."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _qad_models import ROOT, distill_args, run_cli, run_in_process, write_pair
from safetensors.torch import load_file

from specquant.train.trainer import checkpoints

RUN = ["--seq-len", "32", "--batch", "2", "--eval-samples", "2", "--eval-seq-len", "32", "--eval-every", "0",
       "--lr", "1e-2", "--warmup", "2", "--no-progress"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("trainer"))


def _args(pair, out, *extra):
    return distill_args(pair, out, *RUN, *extra)


def _final(out):
    return load_file(checkpoints(out)[-1] / "trainable.safetensors")


def test_sigkill_then_resume_is_bit_identical(pair, tmp_path):
    steps = ["--steps", "12", "--save-every", "2"]
    run_in_process(_args(pair, tmp_path / "ref", *steps))

    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specquant.cli", *_args(pair, out, *steps)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not checkpoints(out) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = checkpoints(out)
    assert done, "no checkpoint appeared before the kill"
    killed_at = int(done[-1].name.split("-")[1])
    assert killed_at < 12, "the run finished before it could be killed; the test proves nothing"

    resumed = run_cli(_args(pair, out, *steps, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    a, b = _final(tmp_path / "ref"), _final(out)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ref_model = load_file(tmp_path / "ref" / "model" / "model.safetensors")
    res_model = load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(ref_model[k], res_model[k]) for k in ref_model)
    events = [json.loads(ln).get("event") for ln in (out / "log.jsonl").read_text().splitlines()]
    assert "resume" in events
    losses = lambda p: [json.loads(ln)["loss"] for ln in (p / "log.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert losses(out) == losses(tmp_path / "ref")  # the log, too, reads as one uninterrupted run


def _torchrun(args, nproc):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "specquant.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _why(proc) -> str:
    """A failed torchrun's stderr: the ranks' own error lines (a C++ abort prints them long before torchrun's
    summary, which alone says only "SIGABRT"), then the summary's end."""
    words = ("error", "terminate", "what()", "abort", "traceback")
    said = [ln for ln in proc.stderr.splitlines() if any(w in ln.lower() for w in words)]
    return "\n".join(said[:40]) + "\n...\n" + proc.stderr[-1500:]


def test_two_process_ddp_matches_one_process(pair, tmp_path):
    """2 ranks × batch 2 vs 1 rank × batch 4: the same global batch of the same rows every step; DDP and FSDP2
    (gloo on CPU). Both DDP ranks end
    with identical weights (checked in the trainer by comparing per-rank digests); the logged global mean loss
    matches the single process to float-summation error. Tolerance: 1e-4 relative; observed ~1e-7."""
    steps = ["--steps", "3", "--save-every", "3"]
    two = _torchrun(_args(pair, tmp_path / "two", *steps), 2)
    assert two.returncode == 0, _why(two)
    run_in_process(_args(pair, tmp_path / "one", *steps, "--batch", "4"))
    log2 = [json.loads(ln) for ln in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    log1 = [json.loads(ln) for ln in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    end = next(e for e in log2 if e.get("event") == "train_end")
    assert len(end["rank_digests"]) == 2 and len(set(end["rank_digests"])) == 1
    assert next(e for e in log2 if e.get("event") == "train_start")["global_batch"] == 4
    l2 = [e["loss"] for e in log2 if "loss" in e]
    l1 = [e["loss"] for e in log1 if "loss" in e]
    assert len(l1) == len(l2) == 3
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-4, atol=0)
    w2, w1 = _final(tmp_path / "two"), _final(tmp_path / "one")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-5)
    # FSDP2 (sharded parameters, gradients and optimizer state) takes the same steps as DDP
    fsdp = _torchrun(_args(pair, tmp_path / "fsdp", *steps, "--strategy", "fsdp"), 2)
    assert fsdp.returncode == 0, _why(fsdp)
    w3 = _final(tmp_path / "fsdp")
    for name in w2:
        torch.testing.assert_close(w3[name], w2[name], rtol=0, atol=1e-6)


def test_gradient_accumulation_matches_one_large_batch(pair, tmp_path):
    """batch 2 × grad_accum 2 reads the same rows per step as batch 4 and averages the same per-token KL."""
    steps = ["--steps", "2", "--save-every", "2"]
    run_in_process(_args(pair, tmp_path / "big", *steps, "--batch", "4"))
    run_in_process(_args(pair, tmp_path / "acc", *steps, "--grad-accum", "2"))
    loss = lambda p: [json.loads(ln)["loss"] for ln in (p / "log.jsonl").read_text().splitlines() if '"loss"' in ln]
    torch.testing.assert_close(torch.tensor(loss(tmp_path / "acc")), torch.tensor(loss(tmp_path / "big")),
                               rtol=1e-4, atol=0)
    a, b = _final(tmp_path / "acc"), _final(tmp_path / "big")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)


def test_a_joined_process_group_is_left_at_exit(monkeypatch, tmp_path):
    """setup_distributed leaves the group it joined at exit (atexit, while the interpreter is whole): without it,
    gloo's threads could abort a finished torchrun run at finalization. One process stands in for a torchrun rank
    (a world of 1 through a file store), so this costs no subprocess; the group is left by the registered hook."""
    from specquant.train import trainer

    hooks = []
    monkeypatch.setattr(trainer.atexit, "register", hooks.append)
    monkeypatch.setenv("WORLD_SIZE", "2")  # what makes setup_distributed join a group
    store, init = torch.distributed.FileStore(str(tmp_path / "store"), 1), torch.distributed.init_process_group
    monkeypatch.setattr(trainer.dist, "init_process_group",
                        lambda backend: init(backend, store=store, rank=0, world_size=1))
    try:
        assert trainer.setup_distributed("cpu")[0] == 0 and torch.distributed.is_initialized()
        assert len(hooks) == 1
        hooks[0]()
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
