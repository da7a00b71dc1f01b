"""Device checks and clock syncs shared by every command."""

from __future__ import annotations

import torch

from specquant.errors import SpecquantError

DEVICES = ("cpu", "cuda")


def check_device(device: str | torch.device) -> torch.device:
    """The torch.device for a --device value; raises when CUDA is asked for and none is visible."""
    device = torch.device(device)
    if device.type not in DEVICES:
        raise SpecquantError(f"device {str(device)!r} is not supported; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecquantError("--device cuda requested but no CUDA device is visible; use --device cpu")
    return device


def sync(device: torch.device):
    """Wait for the device's queued work, so a host clock read after it covers that work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
