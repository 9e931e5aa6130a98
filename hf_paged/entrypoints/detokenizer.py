"""Incremental text for one choice: tokens in, text pieces out, stop strings cut off.

A streamed choice must read exactly like the same choice returned whole: the concatenation of
its pieces equals `tokenizer.decode(output_ids, skip_special_tokens=True)` cut before the first
stop string (OpenAI leaves the stop sequence out; the engine keeps it in its tokens). Decoding
goes through the fast tokenizer's DecodeStream, which holds back a partial UTF-8 character (a
byte-level token that ends mid-character) until the tokens that complete it arrive, and costs
O(new tokens) per call. At the end the whole output is decoded once and the remainder handed
out, so a decoder quirk can never make the stream differ from the non-streamed text.

While a choice runs, the last (longest stop string - 1) characters are held back: they may be
the start of a stop string that the next token completes.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once one is seen)
        self.sent = 0  # characters of text handed out
        self.stopped = False  # a stop string was found
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Take new tokens; return the text that can be handed out now ("" if none). With
        finished, everything left goes out."""
        if self.stopped:
            return ""
        self.token_ids += token_ids
        start = max(len(self.text) - self.hold, 0)  # where a new stop string could begin
        if finished:
            self.text = self._decode_all()
            start = min(start, self.sent)
        elif self._stream is not None:
            if token_ids:
                piece = self._stream.step(self._backend, token_ids)
                if piece:
                    self.text += piece
        else:  # a slow tokenizer: decode the whole output each time
            self.text = self._decode_all()
        self._find_stop(start)
        end = len(self.text) if finished or self.stopped else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        piece = self.text[self.sent : end]
        self.sent = end
        return piece

    def _decode_all(self) -> str:
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not full.startswith(self.text[: self.sent]):
            # never seen with DecodeStream; the pieces already sent cannot be taken back
            return self.text[: self.sent]
        return full

    def _find_stop(self, start: int) -> None:
        cut = -1
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1 and (cut == -1 or at < cut):
                cut = at
        if cut != -1:
            self.text = self.text[:cut]
            self.stopped = True


def final_text(tokenizer, token_ids: list[int], stop: list[str] | None) -> tuple[str, bool]:
    """A finished choice's text, and whether a stop string cut it (the non-streamed path)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in stop or ()) if i != -1), default=-1)
    return (text[:cut], True) if cut != -1 else (text, False)
