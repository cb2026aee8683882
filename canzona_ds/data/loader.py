"""Deterministic, DP-sharded batches of byte windows.

Every step draws one *global* batch of ``global_batch = micro_batch * grad_accum * dp``
windows from a generator seeded by ``(seed, step)`` alone, then hands each (micro step,
rank) its slice:

    global batch of step s (seed fixed), dp = 2, grad_accum = 2, micro_batch = 2

      window index:  0  1 | 2  3 | 4  5 | 6  7
                     micro 0      | micro 1
                     rank0 rank1  | rank0 rank1

So a batch depends only on (seed, step): resuming at step s needs no loader state, and a
single-process reference that walks the same global batch sees exactly the same tokens as
the DP ranks together.  The last ``val_fraction`` of the corpus is held out for evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .corpus import load_corpus_bytes
from .tokenizer import ByteTokenizer


@dataclass(frozen=True)
class DataConfig:
    """What to sample."""

    #: corpus set name ("austen", "pride_and_prejudice", "persuasion") or a text file path
    corpus: str = "austen"
    #: tokens per training window (the model sees seq_len inputs, predicts seq_len targets)
    seq_len: int = 128
    #: fraction of the corpus (its tail) held out for validation
    val_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"Invalid seq_len={self.seq_len!r}. Must be an int >= 1.")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"Invalid val_fraction={self.val_fraction!r}. Must be within [0, 1).")


class BatchSampler:
    """Windows of ``seq_len + 1`` tokens at random offsets, seeded by (seed, step)."""

    def __init__(self, cfg: DataConfig, tokens: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        if tokens is None:
            tokens = ByteTokenizer().encode(load_corpus_bytes(cfg.corpus))
        n_val = int(len(tokens) * cfg.val_fraction)
        self.train_tokens = tokens[: len(tokens) - n_val]
        self.val_tokens = tokens[len(tokens) - n_val :]
        if len(self.train_tokens) <= cfg.seq_len + 1:
            raise ValueError(f"Corpus {cfg.corpus!r} has {len(self.train_tokens)} training tokens, "
                             f"too few for seq_len={cfg.seq_len}")

    def _windows(self, tokens: torch.Tensor, n: int, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(key)
        starts = torch.randint(0, len(tokens) - self.cfg.seq_len - 1, (n,), generator=g)
        idx = starts[:, None] + torch.arange(self.cfg.seq_len + 1)[None, :]
        w = tokens[idx]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def global_batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All windows of ``step`` (inputs, targets), shape (global_batch, seq_len)."""
        # distinct streams per (seed, step); 1_000_003 is prime so nearby seeds do not collide
        return self._windows(self.train_tokens, global_batch, self.cfg.seed * 1_000_003 + step)

    def micro_batch(self, step: int, micro_step: int, rank: int, dp: int, micro_batch: int,
                    grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slice of step ``step``'s global batch that ``rank`` uses at ``micro_step``."""
        if not 0 <= rank < dp:
            raise ValueError(f"Invalid rank={rank} for dp={dp}")
        if not 0 <= micro_step < grad_accum:
            raise ValueError(f"Invalid micro_step={micro_step} for grad_accum={grad_accum}")
        x, y = self.global_batch(step, micro_batch * grad_accum * dp)
        lo = (micro_step * dp + rank) * micro_batch
        return x[lo : lo + micro_batch], y[lo : lo + micro_batch]

    def val_batches(self, n_batches: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed validation set (same on every rank and every call)."""
        if len(self.val_tokens) <= self.cfg.seq_len + 1:
            return []
        # keys >= 2**48 never collide with training keys (seed * 1_000_003 + step)
        return [self._windows(self.val_tokens, batch, 2**48 + i) for i in range(n_batches)]
