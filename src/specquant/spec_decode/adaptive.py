"""Adaptive draft length: grow k after a fully accepted draft, shrink it after a rejection."""

from __future__ import annotations

from specquant.spec_decode.config import SpecConfig


def next_draft_len(k: int, proposed: int, accepted: int, config: SpecConfig) -> int:
    """k for the next step: +2 after all `proposed` tokens were accepted, -1 after a rejection, within
    [1, max_draft_len]; unchanged when not adaptive or when nothing was proposed."""
    if not config.adaptive or proposed == 0:
        return k
    return min(config.max_draft_len, k + 2) if accepted == proposed else max(1, k - 1)
