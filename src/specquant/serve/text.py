"""Incremental detokenizing with stop strings: text is released as tokens arrive, except a tail that could still
become a stop string or is an incomplete UTF-8 character."""

from __future__ import annotations


class TextStream:
    """feed(token ids) -> the new text that is final; `stopped` once a stop string appeared (the text is then cut
    before it, as OpenAI does). Decodes the whole completion each time: the same text `specquant generate` prints
    (skip_special_tokens), with no per-tokenizer merge rules to get wrong; completions are short enough."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters already released
        self.stopped = False

    def feed(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s, max(self.sent - self.hold, 0)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text, cut)
        end = len(text) - self.hold
        while end > self.sent and text[end - 1] == "\ufffd":  # bytes of a character still to come
            end -= 1
        return self._release(text, end)

    def finish(self) -> str:
        """The held-back tail once generation ended without a stop string."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.ids, skip_special_tokens=True), None)

    def _release(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        out = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out
