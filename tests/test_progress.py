"""util/progress.py: a bar with the time left on a terminal, one line per phase elsewhere, result lines in both."""

from __future__ import annotations

import io
import re

from specquant.util.progress import BAR_ONLY, Progress, clock, progress_for


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Ticks:
    """A clock that advances 1 s per read."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_not_a_terminal_prints_one_line_per_phase_and_the_result_lines():
    out = io.StringIO()
    with Progress(4, "latency runs", "call", stream=out, timer=Ticks()) as bar:
        for i in range(4):
            bar.update(1, status=f"row {i}")
            assert out.getvalue() == ""  # quiet while it runs
        bar.note("      (b) W4 target: 335.1 tok/s")
    lines = out.getvalue().splitlines()
    # (the clock is read at the start and at the end: 1 s)
    assert lines == ["      (b) W4 target: 335.1 tok/s", "latency runs: 4 calls in 1s"]


def test_a_phase_cut_short_says_how_far_it_got_and_closing_twice_prints_once():
    out = io.StringIO()
    bar = Progress(10, "QAD", "step", stream=out, timer=Ticks())
    bar.update(3)
    bar.close()
    bar.close()
    assert out.getvalue().splitlines() == ["QAD: 3/10 steps in 1s"]


def test_a_terminal_gets_a_bar_with_count_and_time_left():
    out = Terminal()
    with Progress(200, "calibration", "layer", stream=out, summary=False) as bar:
        for _ in range(100):
            bar.update(1, status="layer 100")
        bar.bar.refresh()
        shown = out.getvalue()
        bar.note("a result line")
    assert "calibration" in shown and "100/200" in shown and "layer 100" in shown
    assert "<" in shown  # tqdm's "elapsed<left": the time left
    assert "a result line\n" in out.getvalue()


def test_progress_for_maps_the_pipeline_argument():
    for arg, want in ((True, r"quantize: 2 layers in \d+s\n"), (BAR_ONLY, ""), (False, "")):
        out = io.StringIO()
        bar = progress_for(arg, 2, "quantize", "layer", stream=out)
        bar.update(2)
        bar.close()
        assert re.fullmatch(want, out.getvalue()), arg
    out = io.StringIO()
    progress_for(False, 2, "quantize", stream=out).note("a result")
    assert out.getvalue() == ""  # progress off: nothing at all


def test_clock():
    assert (clock(4.4), clock(65), clock(3600)) == ("4s", "1m05s", "60m00s")
