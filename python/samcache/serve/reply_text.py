"""A reply's text as its tokens arrive: detokenized incrementally, cut at the first stop string,
and handed out in pieces that never split a character or show the start of a stop string that
may still complete.

Each new token is decoded together with the few tokens before it (not the whole reply) and only
text that extends what was decoded before is taken: a byte-level tokenizer's partial character
(decoded as one or more U+FFFD) waits for its remaining bytes."""

from __future__ import annotations

from collections.abc import Sequence

_CONTEXT = 6  # tokens decoded before the new ones, so a token's text comes out as in the whole reply


class ReplyText:
    """Tokens in (:meth:`add`), text out (:meth:`take`); :attr:`stopped` once a stop string appeared."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self._given = 0  # characters handed out by take()
        self._prefix = 0  # tokens[_prefix:_read] decode to the tail of text already
        self._read = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> bool:
        """Take one sampled token; True when the reply now holds a stop string (it ends there)."""
        if self.stopped:
            return True
        self.tokens.append(int(token))
        before = self._decode(self.tokens[self._prefix:self._read])
        now = self._decode(self.tokens[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return False  # nothing new yet, or a character still incomplete
        start = len(self.text)
        self.text += now[len(before):]
        self._prefix, self._read = max(0, len(self.tokens) - _CONTEXT), len(self.tokens)
        if self.stops:
            search = max(0, start - max(len(s) for s in self.stops))
            hits = [i for i in (self.text.find(s, search) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
        return self.stopped

    def take(self, final: bool = False) -> str:
        """The text not handed out yet: all of it when ``final`` (the whole reply decoded once
        more, so nothing held back is lost), else what can no longer change."""
        if final and not self.stopped:
            whole = self._decode(self.tokens)
            if whole.startswith(self.text[:self._given]):
                self.text = whole
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back(self.text)
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
