"""The resume scenario table's machinery (tests/test_ckpt_resume.py): a layout spec, the checks
every scenario makes, and one module per model family that saves, resumes and checks.

A scenario is (model, optimizer, saved layout, running layout).  A layout is a spec string of
space-separated tokens (:class:`Layout`), e.g. ``"z1 dp2"``, ``"z3 dp2 offload"``, ``"z2 dp4 ep2
mixed"``, ``"z1 tp2 dp2 ep2"``, ``"z1 pp2 dp1"``.  A family module has three functions:

  ``save(rank, world, model, layout, optimizer, ckpt)``   (a worker) train ``BEFORE`` steps at
      ``layout`` and save tag ``saved`` into ``ckpt``;
  ``resume(rank, world, model, layout, optimizer, ckpt, out)``   (a worker) build the running
      layout, :func:`index_route_only`, ``engine.load_checkpoint(ckpt, tag="saved")``, save tag
      ``reloaded`` into ``out`` at once (what this rank holds right after the load), train
      ``AFTER`` steps; return a dict with at least ``params`` and ``steps``;
  ``check(model, optimizer, saved, running, ckpt, out, results)``   (in pytest) lossless:
      every (whole-model name, state) of the saved index reads back bit for bit from the
      reloaded one; exact continuation against the family's single-process reference (bit for
      bit where the arithmetic is the same; otherwise the tolerance and why).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch

BEFORE, AFTER, MICRO = 2, 2, 2
#: below the tiny models' gradient norm on every step (~1): every step clips
CLIP = 0.05


@dataclass(frozen=True)
class Layout:
    """A parallel layout.  Tokens: ``z<stage>`` (ZeRO 0-3, required), ``dp<n>`` (the
    data-parallel size; for DeepSpeed MoE the expert-parallel groups are carved out of it),
    ``tp<n>``, ``pp<n>``, ``ep<n>`` (the MoE layer's ep_size), ``epb<n>`` (a second MoE layer with
    that ep_size), ``offload`` (the optimizer on the CPU), ``mixed`` (the mixed ZeRO-1/2 layout),
    ``before`` (``use_data_before_expert_parallelism``)."""

    stage: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    epb: int | None = None
    offload: bool = False
    mixed: bool = False
    before: bool = False

    @classmethod
    def parse(cls, spec: str) -> "Layout":
        kw: dict = {}
        flags = {f.name for f in fields(cls) if f.type in ("bool", bool)}
        for token in spec.split():
            if token in flags:
                kw[token] = True
                continue
            key = token.rstrip("0123456789")
            value = token[len(key):]
            key = {"z": "stage"}.get(key, key)
            if key not in {f.name for f in fields(cls)} or not value:
                raise ValueError(f"layout token {token!r} in {spec!r}: expected z<n>, dp<n>, tp<n>, pp<n>, "
                                 f"ep<n>, epb<n>, {', '.join(sorted(flags))}")
            kw[key] = int(value)
        if "stage" not in kw:
            raise ValueError(f"layout {spec!r} names no ZeRO stage (z0-z3)")
        return cls(**kw)

    def __str__(self) -> str:
        out = [f"z{self.stage}", f"dp{self.dp}"] + [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "ep")
                                                   if getattr(self, k) != 1]
        out += [] if self.epb is None else [f"epb{self.epb}"]
        return " ".join(out + [k for k in ("offload", "mixed", "before") if getattr(self, k)])

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def record_routes(index_only: bool = False) -> list[str]:
    """Record the route each ``engine.load_checkpoint`` takes in this process: "index" (the index
    loop) or "stock" (DeepSpeed's own load); ``index_only``: fail where it picks the stock load."""
    from canzona_ds.integration.ckpt import route as ckpt_index

    route, taken = ckpt_index.index_route, []

    def recorded(*args, **kwargs):
        index = route(*args, **kwargs)
        if index is None and index_only:
            raise AssertionError("DeepSpeed's stock load was chosen; the index loop was expected")
        taken.append("stock" if index is None else "index")
        return index

    ckpt_index.index_route = recorded
    return taken


def index_route_only() -> None:
    """Make the one comparison fail if it picks DeepSpeed's stock load: a resume here goes
    through the index loop."""
    record_routes(index_only=True)


def assert_same_state(a_dir: str, b_dir: str) -> int:
    """Every (name, state) of checkpoint ``a_dir``'s index equals ``b_dir``'s, bit for bit, read
    through each one's own index (whatever layout wrote it); returns how many were compared."""
    from canzona_ds.ckpt import Index, Reader

    a, b = Index.read(a_dir), Index.read(b_dir)
    ra, rb = Reader(a_dir, a), Reader(b_dir, b)
    assert set(a.by_key()) == set(b.by_key()), sorted(set(a.by_key()) ^ set(b.by_key()))[:5]
    for name, state in a.by_key():
        x, y = ra.whole(name, state), rb.whole(name, state)
        assert torch.equal(x, y), (name, state, float((x - y).abs().max()))
    for index, reader in ((a, ra), (b, rb)):  # every chunk, replicas too (stage-0 MoE), holds those values
        for c in index.chunks:
            got = reader.stored(c)[c.at:c.at + c.length]
            assert torch.equal(got, reader.whole(c.name, c.state).reshape(-1)[c.offset:c.stop]), (c.name, c.state, c.file)
    for key in ("rule", "matrix_step", "adam_step", "roles"):
        assert a.meta[key] == b.meta[key], key
    return len(a.by_key())


def tp1_state(folder: str) -> dict:
    """(whole-model name, state) -> the tensor in the TP=1 frame: shards rebuilt by the reader,
    a TP host's state mapped through its rule's state_axes (IndexSource)."""
    from canzona_ds.ckpt import Index
    from canzona_ds.integration.ckpt.fill import IndexSource

    index = Index.read(folder)
    src = IndexSource(folder, index)
    out = {}
    for n, k in index.by_key():
        if src.reader.frame_of(n, k) is not None:
            out[n, k] = src.state_of(n)[k].clone()
        else:
            out[n, k] = src.reader.whole(n, k).clone()
    return out


def assert_same_tp1_state(a_dir: str, b_dir: str) -> int:
    """:func:`assert_same_state` in the TP=1 frame (the two saves at other TP sizes)."""
    a, b = tp1_state(a_dir), tp1_state(b_dir)
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    for key in a:
        assert torch.equal(a[key], b[key]), (key, float((a[key] - b[key]).abs().max()))
    return len(a)


def start_state(index, whole: dict) -> SimpleNamespace:
    """The saved state in ``canzona_testkit.moe.reference_run``'s ``start`` form, from ``whole``:
    (name, state) -> the whole tensor of every chunk family of ``index``."""
    roles = index.meta["roles"]
    return SimpleNamespace(
        params={n: whole[n, "param"] for n in index.names},
        adam={n: {k: whole[n, k] for k in ("exp_avg", "exp_avg_sq")} for n in index.names if roles[n] == "adamw"},
        rule_state={n: {k: v for (n2, k), v in whole.items() if n2 == n and k != "param"}
                    for n in index.names if roles[n] == "matrix"},
        adam_step=index.meta["adam_step"], matrix_step=index.meta["matrix_step"])


def start_of(folder: str) -> SimpleNamespace:
    """:func:`start_state` of the tag in ``folder`` (in the TP=1 frame)."""
    from canzona_ds.ckpt import Index

    return start_state(Index.read(folder), tp1_state(folder))


def assert_steps(results: list) -> None:
    for r in results:
        assert r["steps"] == BEFORE + AFTER, r["steps"]
