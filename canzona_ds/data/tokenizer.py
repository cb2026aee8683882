"""Byte-level tokenizer: token id = UTF-8 byte value.  Nothing to download or train."""
from __future__ import annotations

import torch


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes; ``vocab_size`` is 256 (ids 0..255)."""

    vocab_size: int = 256

    def encode(self, text: str | bytes) -> torch.Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)

    def decode(self, ids) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [v for v in values if not 0 <= int(v) < 256]
        if bad:
            raise ValueError(f"ByteTokenizer.decode got ids outside [0, 256): {bad[:5]}")
        return bytes(int(v) for v in values).decode("utf-8", errors="replace")
