"""The checkpoint index (canzona_ds/ckpt): chunk arithmetic, JSON round trip, validation errors
that name the problem, and the memory-mapped region reader against real torch files.  Pure:
no processes, no DeepSpeed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from canzona_ds.ckpt import CheckpointIndexError, Chunk, Index, Reader, missing, overlaps


def _chunk(offset, length, at=0, file="a.pt", key=("flat",), name="w", state="param", shape=(4, 5)):
    return Chunk(name, state, shape, offset, length, file, key, at)


def test_overlaps_fills_each_element_once():
    a, b, c = _chunk(0, 8, at=3), _chunk(8, 12, at=0, file="b.pt"), _chunk(4, 10, at=100, file="c.pt")  # c: replica
    plan = overlaps([b, c, a], 6, 15)
    # by offset: a's [6, 8), then the replica c's [8, 14), then b's [14, 15)
    assert [(x.file, src, dst, n) for x, src, dst, n in plan] == [("a.pt", 9, 0, 2), ("c.pt", 104, 2, 6),
                                                                   ("b.pt", 6, 8, 1)]
    assert sum(n for *_, n in plan) == 9
    # a region inside one chunk
    assert [(x.file, s, d, n) for x, s, d, n in overlaps([a, b], 9, 11)] == [("b.pt", 1, 0, 2)]


def test_overlaps_and_missing_name_the_gap():
    a, b = _chunk(0, 5), _chunk(9, 11)
    assert missing([a, b], 0, 20) == [(5, 9)]
    assert missing([a, b], 9, 20) == []
    with pytest.raises(CheckpointIndexError, match=r"'w' param: elements \[5, 20\) are in no chunk"):
        overlaps([a, b], 2, 20)


def test_json_round_trip():
    idx = Index("t", {"stage": 1, "dp": 2}, ["a.pt", "b.pt"],
                [_chunk(0, 10), Chunk("w", "param", (4, 5), 10, 10, "b.pt", ("x", 0, "y"), 7, {"tp": 2}, 1)])
    back = Index.loads(idx.dumps())
    assert back.chunks == idx.chunks and back.meta == idx.meta and back.tag == "t"
    assert back.chunks[1].key == ("x", 0, "y") and back.chunks[1].frame == {"tp": 2}
    back.validate()
    no_chunks = Index.loads(Index("t", {"no_chunks": "why"}, []).dumps())
    assert no_chunks.chunks is None


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format="other/9"), "format 'other/9'"),
    (lambda d: d.pop("files"), "field 'files'"),
    (lambda d: d["chunks"][0].pop("offset"), "missing field 'offset'"),
    (lambda d: d["chunks"][0].update(length="3"), "field 'length' is '3'"),
    (lambda d: d["chunks"][0].update(shape=[4, -5]), "shape"),
    (lambda d: d["chunks"][0].update(at=-1), "at=-1"),
])
def test_damaged_index_is_refused_by_name(mutate, match):
    d = Index("t", {}, ["a.pt"], [_chunk(0, 20)]).to_json()
    mutate(d)
    with pytest.raises(CheckpointIndexError, match=match):
        Index.from_json(d)


def test_not_json_is_refused():
    with pytest.raises(CheckpointIndexError, match="not valid JSON.*damaged"):
        Index.loads('{"format": "canzona')


@pytest.mark.parametrize("chunks,files,match", [
    ([_chunk(0, 10)], ["a.pt"], r"'w' param is not covered: elements \[\(10, 20\)\]"),
    ([_chunk(0, 21)], ["a.pt"], r"chunk \[0, 21\) lies outside its 20 elements"),
    ([_chunk(0, 20, file="gone.pt")], ["a.pt"], "'gone.pt', which the index's file list does not name"),
    ([_chunk(0, 10), _chunk(10, 10, shape=(20,))], ["a.pt"], "disagree on its shape"),
    ([_chunk(0, 20), _chunk(0, 5, name="v", state="exp_avg", shape=(5,))], ["a.pt"], r"\['v'\] have optimizer state"),
])
def test_inconsistent_index_is_refused_by_name(chunks, files, match):
    with pytest.raises(CheckpointIndexError, match=match):
        Index("t", {}, files, chunks).validate()


def test_reader_reads_regions_from_the_files(tmp_path):
    w = torch.arange(20, dtype=torch.float32).view(4, 5)
    # rank 0's file holds w[0:8) at element 3 of a flat; rank 1's holds w[8:20) at element 0 of a nested key
    torch.save({"flat": torch.cat([torch.full((3,), -1.0), w.view(-1)[:8]])}, tmp_path / "a.pt")
    torch.save({"x": [None, {"y": torch.cat([w.view(-1)[8:], torch.full((2,), -2.0)])}]}, tmp_path / "b.pt")
    idx = Index("t", {}, ["a.pt", "b.pt"], [_chunk(0, 8, at=3), Chunk("w", "param", (4, 5), 8, 12, "b.pt",
                                                                        ("x", 1, "y"), 0)])
    idx.validate()
    r = Reader(str(tmp_path), idx)
    assert torch.equal(r.whole("w"), w)
    assert torch.equal(r.region("w", "param", 6, 11), w.view(-1)[6:11])
    assert r.region("w", "param", 7, 7).numel() == 0  # an empty region (a rank's empty piece)
    # a file that disagrees with its index
    bad = Index("t", {}, ["a.pt"], [_chunk(0, 20, at=3)])
    with pytest.raises(CheckpointIndexError, match=r"'a.pt' 'flat' has 11 elements.*disagree"):
        Reader(str(tmp_path), bad).whole("w")
    bad = Index("t", {}, ["a.pt"], [_chunk(0, 20, key=("nope",))])
    with pytest.raises(CheckpointIndexError, match="'a.pt' has no 'nope'.*disagree"):
        Reader(str(tmp_path), bad).whole("w")
    gone = Index("t", {}, ["c.pt"], [_chunk(0, 20, file="c.pt")])
    with pytest.raises(CheckpointIndexError, match="names 'c.pt', which is not in the checkpoint"):
        Reader(str(tmp_path), gone).whole("w")


def test_index_read_names_a_missing_or_damaged_index(tmp_path):
    with pytest.raises(CheckpointIndexError, match="no canzona_index.json"):
        Index.read(str(tmp_path))
    (tmp_path / "canzona_index.json").write_text(json.dumps({"format": "canzona_ds.ckpt.index/1"})[:-3])
    with pytest.raises(CheckpointIndexError, match="damaged"):
        Index.read(str(tmp_path))


def test_package_imports_no_deepspeed():
    code = "import sys, canzona_ds.ckpt; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
