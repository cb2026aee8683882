"""The checkpoint index (canzona_ds/ckpt): chunk arithmetic, JSON round trip, validation errors
that name the problem, and the memory-mapped region reader against real torch files.  Pure:
no processes, no DeepSpeed.

Cost: 1 launching test; 2 s on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from canzona_ds.ckpt import CheckpointIndexError, Chunk, Index, Reader, TPFrame, missing, overlaps
from canzona_ds.ckpt.frames import FrameError, assemble, to_global
from canzona_ds.tp.layout import shard

#: (4, 5) split along dim 0 over 2 TP ranks, one block
TP2 = TPFrame(0, (2, 2), (4,))


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
                [_chunk(0, 10), Chunk("w", "param", (4, 5), 10, 10, "b.pt", ("x", 0, "y"), 7, None, 1),
                 Chunk("w", "exp_avg", (4, 5), 0, 10, "b.pt", ("z",), 0, TP2.at(0).to_json(), 1),
                 Chunk("w", "exp_avg", (4, 5), 0, 10, "b.pt", ("z",), 10, TP2.at(1).to_json(), 1)])
    back = Index.loads(idx.dumps())
    assert back.chunks == idx.chunks and back.meta == idx.meta and back.tag == "t"
    assert back.chunks[1].key == ("x", 0, "y") and back.chunks[3].tp == TP2.at(1)
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


# ------------------------------------------------------------------------------ TP frames
#: (global shape, dim, shard sizes, blocks): a fused [gate; up] along rows, three fused blocks along
#: columns, a 3-D tensor cut along dim 1, AutoTP's uneven one-block split
FRAMES = [((8, 3), 0, (4, 4), (4, 4)), ((2, 12), 1, (6, 6), (4, 4, 4)), ((2, 6, 3), 1, (3, 3), (2, 4)),
          ((5, 3), 0, (3, 2), (5,))]


@pytest.mark.parametrize("shape,dim,sizes,blocks", FRAMES)
def test_to_global_is_the_shard_of_tp_layout(shape, dim, sizes, blocks):
    """Every element of every shard frame maps to the global element tp/layout.shard puts there."""
    full = torch.arange(float(torch.Size(shape).numel())).view(shape)
    for t in range(len(sizes)):
        f = TPFrame(dim, sizes, blocks, t)
        want = shard(full, dim, blocks, sizes, t).reshape(-1)
        n = want.numel()
        assert torch.equal(full.reshape(-1)[to_global(f, shape, 0, n)], want)
        assert torch.equal(full.reshape(-1)[to_global(f, shape, 1, n - 1)], want[1:n - 1])  # a cut range
    # the shards' pieces at their offsets assemble the global tensor
    pieces = [(TPFrame(dim, sizes, blocks, t), off, shard(full, dim, blocks, sizes, t).reshape(-1)[off:off + k])
              for t in range(len(sizes)) for off, k in ((0, 2), (2, 10 ** 6))]
    assert torch.equal(assemble(pieces, shape), full)
    with pytest.raises(FrameError, match="outside shard 0"):
        to_global(TPFrame(dim, sizes, blocks, 0), shape, 0, 10 ** 6)


def _tp_checkpoint(tmp_path, full, f: TPFrame, state="exp_avg", pieces=2):
    """Each TP shard of ``full`` in its own file, cut into ``pieces`` chunks (grid pieces)."""
    files, chunks = [], []
    for t in range(len(f.sizes)):
        sh = shard(full, f.dim, f.blocks, f.sizes, t).reshape(-1)
        name = f"tp{t}.pt"
        torch.save({"flat": torch.cat([torch.full((1,), -9.0), sh])}, tmp_path / name)
        files.append(name)
        cut = [0, sh.numel() // pieces, sh.numel()] if pieces == 2 else [0, sh.numel()]
        for a, b in zip(cut, cut[1:]):
            chunks.append(Chunk("w", state, tuple(full.shape), a, b - a, name, ("flat",), 1 + a,
                                f.at(t).to_json(), t))
    return files, chunks


def test_reader_reads_any_tp_frame_from_shard_chunks(tmp_path):
    full = torch.arange(24.0).view(8, 3)
    saved = TPFrame(0, (4, 4), (4, 4))  # a fused [gate; up]: shard t = [gate_t; up_t]
    files, chunks = _tp_checkpoint(tmp_path, full, saved)
    idx = Index("t", {}, files, chunks + [Chunk("w", "param", (8, 3), 0, 24, "m.pt", ("w",))])
    torch.save({"w": full}, tmp_path / "m.pt")
    idx.files.append("m.pt")
    idx.validate()
    r = Reader(str(tmp_path), idx)
    # the same frame: straight from the chunks, a view of the file where one chunk holds it
    for t in range(2):
        want = shard(full, 0, (4, 4), (4, 4), t).reshape(-1)
        assert torch.equal(r.region("w", "exp_avg", 1, 5, frame=saved.at(t)), want[1:5])
        assert torch.equal(r.region("w", "exp_avg", 4, 10, frame=saved.at(t)), want[4:10])  # across the two pieces
        assert torch.equal(r.whole("w", "exp_avg", saved.at(t)), want.view(4, 3))
    # the global frame (TP=1): rebuilt from the shards
    assert torch.equal(r.whole("w", "exp_avg"), full)
    assert torch.equal(r.region("w", "exp_avg", 5, 17), full.reshape(-1)[5:17])
    # another TP size's frame (TP 4), and TP 2 -> the global chunks' parameter into a shard frame
    tp4 = TPFrame(0, (2, 2, 2, 2), (4, 4), 3)
    assert torch.equal(r.whole("w", "exp_avg", tp4), shard(full, 0, (4, 4), (2, 2, 2, 2), 3))
    assert torch.equal(r.whole("w", "param", saved.at(1)), shard(full, 0, (4, 4), (4, 4), 1))
    out = torch.empty(6)
    assert r.region("w", "exp_avg", 0, 6, out=out, frame=tp4) is out and torch.equal(out, tp4_flat(full, tp4)[:6])


def tp4_flat(full, f):
    return shard(full, f.dim, f.blocks, f.sizes, f.rank).reshape(-1)


def test_reader_reads_a_hosts_concatenated_layout_state_in_its_frame_only(tmp_path):
    L = torch.arange(64.0).view(8, 8)  # e.g. a preconditioner of rows: the concatenated TP layout
    torch.save({"L": L}, tmp_path / "h.pt")
    host = TPFrame(0, (4, 4), (4, 4))
    torch.save({"w": torch.zeros(8, 3)}, tmp_path / "m.pt")
    idx = Index("t", {}, ["h.pt", "m.pt"], [Chunk("w", "L", (8, 8), 0, 64, "h.pt", ("L",), 0, host.to_json(), 0),
                                            Chunk("w", "param", (8, 3), 0, 24, "m.pt", ("w",))])
    idx.validate()
    r = Reader(str(tmp_path), idx)
    assert r.frame_of("w", "L") == host
    assert r.whole("w", "L", host) is not None and torch.equal(r.whole("w", "L", host), L)
    with pytest.raises(CheckpointIndexError, match="concatenated TP layout.*state_axes"):
        r.whole("w", "L")
    with pytest.raises(CheckpointIndexError, match="is not stored in the concatenated TP layout"):
        r.whole("w", "L", TPFrame(0, (2, 2, 2, 2), (4, 4)))


@pytest.mark.parametrize("frame,shape,match", [
    ({"tp": {"dim": 0, "sizes": [2, 2], "blocks": [4]}}, (4, 5), None),
    ({"tp": 2}, (4, 5), "is not one this reader knows"),
    ({"tp": {"dim": 0, "sizes": [2, 2]}}, (4, 5), "needs exactly dim, sizes, blocks"),
    ({"tp": {"dim": 0, "sizes": [2, 2], "blocks": [3], "rank": 0}}, (4, 5), "cover different lengths"),
    ({"tp": {"dim": 0, "sizes": [2, 2], "blocks": [4], "rank": 2}}, (4, 5), r"rank=2; expected 0..1"),
    ({"tp": {"dim": 1, "sizes": [2, 2], "blocks": [4], "rank": 0}}, (4, 5), r"does not cut shape \[4, 5\]"),
])
def test_bad_frames_are_refused_by_name(frame, shape, match):
    c = Chunk("w", "param", shape, 0, 20 if match is None else 10, "a.pt", ("f",), 0, frame, 0)
    idx = Index("t", {}, ["a.pt"], [c])
    if match is None:
        idx.validate()
        return
    with pytest.raises(CheckpointIndexError, match=match):
        idx.validate()


def test_a_tp_shard_not_covered_is_refused_by_name():
    f = TP2.at(0).to_json()
    with pytest.raises(CheckpointIndexError, match=r"TP shard 1 of frame .* is not covered: elements \[\(0, 10\)\]"):
        Index("t", {}, ["a.pt"], [Chunk("w", "param", (4, 5), 0, 10, "a.pt", ("f",), 0, f, 0)]).validate()
    with pytest.raises(CheckpointIndexError, match=r"chunk \[5, 15\) lies outside its 10 elements of frame"):
        Index("t", {}, ["a.pt"], [Chunk("w", "param", (4, 5), 5, 10, "a.pt", ("f",), 0, f, 0)]).validate()


def test_package_imports_no_deepspeed():
    code = "import sys, canzona_ds.ckpt; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
