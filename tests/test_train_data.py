"""Corpus provenance, byte tokenizer, seed-deterministic DP-sharded sampler."""
import hashlib
import re
from pathlib import Path

import pytest
import torch

from canzona_ds.data import BatchSampler, ByteTokenizer, DataConfig, corpus_path, load_corpus_bytes
from canzona_ds.data.corpus import CORPUS_FILES


def test_shipped_corpus_matches_sources_md():
    sources = (Path(corpus_path("persuasion")).parent / "SOURCES.md").read_text()
    for name, fname in CORPUS_FILES.items():
        data = corpus_path(name).read_bytes()
        row = next(line for line in sources.splitlines() if f"`{fname}`" in line)
        assert hashlib.sha256(data).hexdigest() in row
        assert f"{len(data):,}" in row
    assert load_corpus_bytes("austen").startswith(b"PRIDE AND PREJUDICE")


def test_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "It is a truth universally acknowledged — é"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])


def _sampler(seed=0, seq_len=16):
    return BatchSampler(DataConfig(corpus="persuasion", seq_len=seq_len, seed=seed))


def test_batches_depend_only_on_seed_and_step():
    a, b = _sampler(), _sampler()
    xa, ya = a.global_batch(3, 8)
    xb, yb = b.global_batch(3, 8)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, a.global_batch(4, 8)[0])
    assert not torch.equal(xa, _sampler(seed=1).global_batch(3, 8)[0])
    # targets are the inputs shifted by one token
    assert torch.equal(xa[:, 1:], ya[:, :-1])


def test_dp_slices_partition_the_global_batch():
    s = _sampler()
    micro, accum, dp = 2, 3, 2
    x, _ = s.global_batch(7, micro * accum * dp)
    parts = [s.micro_batch(7, k, r, dp, micro, accum)[0] for k in range(accum) for r in range(dp)]
    assert torch.equal(torch.cat(parts), x)
    # ranks never see the same windows in one micro step
    assert not torch.equal(parts[0], parts[1])
    with pytest.raises(ValueError, match="rank"):
        s.micro_batch(7, 0, 2, dp, micro, accum)


def test_validation_split_is_held_out_and_fixed():
    s = _sampler()
    n = len(s.train_tokens) + len(s.val_tokens)
    assert len(s.val_tokens) == int(n * 0.05)
    v1, v2 = s.val_batches(2, 4), s.val_batches(2, 4)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2))


def test_bad_data_config():
    with pytest.raises(ValueError, match="seq_len"):
        DataConfig(seq_len=0)
    with pytest.raises(ValueError, match="corpus"):
        load_corpus_bytes("no_such_corpus")
    assert re.search("austen", str(pytest.raises(ValueError, load_corpus_bytes, "nope").value))
