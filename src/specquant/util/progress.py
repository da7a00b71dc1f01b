"""Progress of a long phase (latency rows, acceptance passes, cost curves, QAD steps, calibration): one
implementation for every command (demo, bench, distill, quantize, latency).

On a terminal: a tqdm bar on stderr with the count, the rate and the time left, gone when the phase ends. Not a
terminal (a log file, CI): nothing while the phase runs. Either way, with `summary`, one line when it ends
("awq 4-bit: 8 layers in 12s"), so a log stays short; a caller that logs its own line per phase (bench's stage
times) turns that line off. `note` prints a result line (a row's tok/s) in both cases, above the bar.

The time left assumes the rest takes as long per unit as the average so far (tqdm's smoothing 0): the phases here
repeat the same mix of work (rounds over the same prompts), where a running average beats tqdm's default of
weighting the last few units.
"""

from __future__ import annotations

import sys
import time

# progress= of the pipeline functions (quantize, regen, Trainer): True = a bar on a terminal and one line when the
# phase ends elsewhere; BAR_ONLY = the bar only (the caller logs its own line per phase); False = nothing
BAR_ONLY = "bar"


def clock(seconds: float) -> str:
    """12s, 3m05s"""
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def is_terminal(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """`with Progress(84, "latency runs", "call") as bar: ... bar.update(1, status="(d) 400 tok/s")`."""

    def __init__(self, total: int | None, desc: str, unit: str = "step", *, stream=None, summary: bool = True,
                 enabled: bool = True, timer=time.monotonic):
        self.total, self.desc, self.unit, self.summary = total, desc, unit, summary and enabled
        self.stream = stream if stream is not None else sys.stderr
        self.enabled, self.done, self.timer, self.start = enabled, 0, timer, timer()
        self.bar = None
        if enabled and is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=False, smoothing=0,
                            dynamic_ncols=True, mininterval=0.5)

    def update(self, n: int = 1, status: str | None = None) -> None:
        self.done += n
        if self.bar is not None:
            if status is not None:
                self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(n)

    def note(self, line: str) -> None:
        """A result line, printed on a terminal and off it (above the bar while one is shown)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def line(self) -> str:
        """The phase's closing line: what was done and how long it took."""
        unit = self.unit if self.done == 1 else self.unit + "s"
        of = f"{self.done}/{self.total}" if self.total is not None and self.done != self.total else str(self.done)
        return f"{self.desc}: {of} {unit} in {clock(self.timer() - self.start)}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.summary:
            print(self.line(), file=self.stream, flush=True)
        self.summary = False  # closed: a second close prints nothing

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_for(progress: bool | str, total: int | None, desc: str, unit: str = "step", stream=None) -> Progress:
    """The Progress a pipeline function's `progress=` argument asks for (True, BAR_ONLY or False; see above)."""
    return Progress(total, desc, unit, stream=stream, summary=progress is True, enabled=bool(progress))
