"""Tokenizers. `ByteTokenizer` (UTF-8 bytes + a few special tokens) needs no download and serves tiny CPU
models and tests; Hugging Face tokenizers plug in behind the same small interface for real models."""
from __future__ import annotations

from dataclasses import dataclass

SPECIALS = ("<pad>", "<bos>", "<eos>")


@dataclass(frozen=True)
class ByteTokenizer:
    """Token ids 0..255 are bytes; 256.. are the special tokens; vocab padded to `vocab_size`."""

    vocab_size: int = 384
    """Model vocabulary (>= 259); ids past the specials are never produced."""

    def __post_init__(self):
        if self.vocab_size < 256 + len(SPECIALS):
            raise ValueError(f"ByteTokenizer needs vocab_size >= {256 + len(SPECIALS)}, got {self.vocab_size}")

    @property
    def pad_id(self) -> int:
        return 256

    @property
    def bos_id(self) -> int:
        return 257

    @property
    def eos_id(self) -> int:
        return 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Bytes back to text; special and out-of-range ids are dropped, bad UTF-8 is replaced."""
        return bytes(i for i in (int(t) for t in ids) if 0 <= i < 256).decode("utf-8", errors="replace")
