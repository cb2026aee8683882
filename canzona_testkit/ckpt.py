"""A checkpoint read whole, by whole-model name, through its index: what a test compares.

``read(dir, tag)`` -> :class:`Whole`: every parameter's fp32 master weight, the AdamW moments
of the AdamW parameters, every matrix's rule state (an expert stack's per expert, ``W[e]``),
the step counts and the engine's counters, lr scheduler and client state, whatever layout
wrote the tag (ZeRO 0-3, TP, PP, MoE).
Every tensor is a copy (the files are memory-mapped).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class Whole:
    rule: str
    params: dict[str, Tensor]
    adam: dict[str, dict[str, Tensor]]
    adam_step: float
    rule_state: dict[str, dict[str, Any]]
    matrix_step: int
    zero_scalars: dict[str, Any]
    engine_state: dict[str, Any]
    client_state: dict[str, Any]
    source: dict[str, Any] = field(default_factory=dict)


def open_source(ckpt_dir: str, tag: str | None = None):
    """The tag's :class:`~canzona_ds.integration.ckpt.fill.IndexSource` (``latest`` by default)."""
    from canzona_ds.integration.ckpt import fill as ckpt_fill
    from canzona_ds.integration.ckpt import route as ckpt_index

    if tag is None:
        with open(os.path.join(ckpt_dir, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
    folder = os.path.join(ckpt_dir, str(tag))
    index = ckpt_index.read_index(folder)
    if index is None:
        raise FileNotFoundError(f"{folder}: no checkpoint index.")
    return ckpt_fill.IndexSource(folder, index)


def read(ckpt_dir: str, tag: str | None = None) -> Whole:
    from canzona_ds.ckpt.index import MASTER

    src = open_source(ckpt_dir, tag)
    index, reader = src.index, src.reader
    params = {n: reader.whole(n, MASTER).detach().clone() for n in index.names}
    adam = {n: {k: reader.whole(n, k).detach().clone() for k in ADAM_KEYS} for n in index.names
            if src.roles.get(n) != "matrix" and reader.has(n, ADAM_KEYS[0])}
    rule_state = {n: {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in src.state_of(n).items()}
                  for n in src.state_names()}
    m = index.meta
    return Whole(rule=src.rule, params=params, adam=adam, adam_step=src.adam_step, rule_state=rule_state,
                 matrix_step=src.matrix_step, zero_scalars=src.zero_scalars, engine_state=src.engine_state,
                 client_state=src.client_state,
                 source={"dp": m.get("dp"), "tp": m.get("tp"), "pp": m.get("pp"), "stage": m.get("stage"),
                         "dir": src.folder})


@contextmanager
def pre_index_records():
    """Inside: saves also write the records canzona-ds wrote before the checkpoint index (a ZeRO
    file's ``canzona_layout``, the optimizer state's ``param_names`` / ``global_names``), from the
    same producers; a tag so written, its index and manifest removed, is a pre-index tag
    (``ckpt/route.unindexed``: the stock load at its saved layout, else refused by name).  Call
    inside the saving worker."""
    from canzona_ds.integration.zero import zero_optimizer_class
    from canzona_ds.integration.zero3 import zero3_optimizer_class
    from canzona_ds.optimizer import STATE_KEY, CanzonaOptimizer

    def with_layout(cls):
        stock = cls.state_dict

        def state_dict(self):
            sd = stock(self)
            sd["canzona_layout"] = self.canzona_layout_meta()
            return sd

        return stock, state_dict

    def with_names(self):
        sd = stock_opt(self)
        sd[STATE_KEY]["param_names"] = [list(names) for names in self.group_names]
        sd[STATE_KEY]["global_names"] = [[self.global_name(n) for n in names] for names in self.group_names]
        return sd

    classes = [zero_optimizer_class(), zero3_optimizer_class()]
    patched = [with_layout(cls) for cls in classes]
    stock_opt = CanzonaOptimizer.state_dict
    for cls, (_, new) in zip(classes, patched):
        cls.state_dict = new
    CanzonaOptimizer.state_dict = with_names
    try:
        yield
    finally:
        for cls, (old, _) in zip(classes, patched):
            cls.state_dict = old
        CanzonaOptimizer.state_dict = stock_opt


def save_pre_index(rank: int, world: int, module: str, *args):
    """A worker: ``module``'s ``save`` (a canzona_testkit.resume family) inside
    :func:`pre_index_records`."""
    import importlib

    with pre_index_records():
        return importlib.import_module(module).save(rank, world, *args)


class Planted:
    """An object whose unpickling creates the file ``marker`` (``open(marker, "w")``): what an
    attacker's ``os.system`` would be, with a side effect a test can look for."""

    def __init__(self, marker: str) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


#: the type a planted object's pickle names
PLANTED_TYPE = "io.open"


def plant(src_tag: str, dst_tag: str, file: str, marker: str) -> str:
    """Copy the tag directory ``src_tag`` to ``dst_tag`` with a :class:`Planted` object added to
    the dict stored in ``file`` (key ``"planted"``) and the manifest's sizes, hashes and
    ``files_sha256`` recomputed (anyone can: it has no key), so the tag verifies.  Returns the
    planted file's path."""
    import json
    import shutil

    import torch

    from canzona_ds.ckpt import tag as ck

    shutil.copytree(src_tag, dst_tag)
    path = os.path.join(dst_tag, file)
    obj = torch.load(path, map_location="cpu", weights_only=False)  # (the suite's own file)
    obj["planted"] = Planted(marker)
    torch.save(obj, path)
    mpath = os.path.join(dst_tag, ck.MANIFEST)
    if os.path.isfile(mpath):
        manifest = json.loads(open(mpath).read())
        for entry in manifest["files"]:
            entry["bytes"], entry["sha256"] = ck.sha256_file(os.path.join(dst_tag, entry["path"]))
        manifest["tag"] = os.path.basename(dst_tag.rstrip("/"))
        manifest["files_sha256"] = ck._files_digest(manifest["files"])
        with open(mpath, "w") as f:
            json.dump(manifest, f, indent=1)
    return path
