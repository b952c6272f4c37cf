"""A reply's text as its tokens arrive: detokenized incrementally, cut at the first stop string,
and handed out in pieces that never split a character or show the start of a stop string that
may still complete."""

from __future__ import annotations

from collections.abc import Sequence


class ReplyText:
    """Tokens in (:meth:`add`), text out (:meth:`take`); :attr:`stopped` once a stop string appeared."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self._given = 0  # characters handed out by take()

    def add(self, token: int) -> bool:
        """Take one sampled token; True when the reply now holds a stop string (it ends there)."""
        if self.stopped:
            return True
        self.tokens.append(int(token))
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self.stops:
            longest = max(len(s) for s in self.stops)
            start = max(0, self._given - longest)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
        return self.stopped

    def set_final(self, text: str) -> None:
        """The engine's own decode of the whole reply (the stop string's cut kept)."""
        if not self.stopped:
            self.text = text

    def take(self, final: bool = False) -> str:
        """The text not handed out yet: all of it when ``final``, else what can no longer change."""
        end = len(self.text)
        if not final and not self.stopped:
            if self.text.endswith("\ufffd"):  # a character whose bytes are not all here yet
                end -= 1
            end -= self._held_back(self.text[:end])
        piece = self.text[self._given:max(end, self._given)]
        self._given = max(end, self._given)
        return piece

    def _held_back(self, text: str) -> int:
        """How many trailing characters could be the start of a stop string."""
        held = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held


__all__ = ["ReplyText"]
