"""Reading a checkpoint never runs code from it (canzona_ds/ckpt/safe_load.py, integration/ckpt/safe.py).

A planted object (``canzona_testkit.ckpt.Planted``: its unpickling creates a marker file, as an
attacker's ``os.system`` would run a command) is added to one file of a copy of a real tag, and
the manifest's sizes, hashes and ``files_sha256`` are recomputed (anyone can), so the tag
verifies and the refusal must come from the loader.  For each kind of file a tag holds (model
states, ZeRO optimizer states, DeepSpeed MoE expert files, pipeline layer files; the main job
reads the model states), the resume path (``engine.load_checkpoint`` on every rank),
``canzona-ckpt verify`` and ``convert`` and the main job's look at a tag refuse it naming the
file and the type, and the marker is never created.  The opt-in
(``canzona_checkpoint.allow_unsafe_pickle``) does create it: the check is what stops it.

Cost: subprocesses; 2 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from canzona_ds.ckpt import safe_load
from canzona_ds.ckpt.safe_load import UnsafeCheckpointError
from canzona_testkit.ckpt import PLANTED_TYPE, Planted, plant
from canzona_testkit.dist import run_distributed

MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
EXPERT = "layer_0_expert_1_mp_rank_00_model_states.pt"
LAYER = "layer_01-model_states.pt"


# ------------------------------------------------------------------------------ the loader
@pytest.mark.parametrize("form", ["zip", "legacy", "protocol4"])
def test_planted_object_is_refused_by_name_and_never_runs(tmp_path, form):
    kw = {"zip": {}, "legacy": {"_use_new_zipfile_serialization": False}, "protocol4": {"pickle_protocol": 4}}[form]
    marker, path = tmp_path / "ran", str(tmp_path / "f.pt")
    torch.save({"w": torch.ones(3), "x": Planted(str(marker))}, path, **kw)
    with pytest.raises(UnsafeCheckpointError) as e:
        safe_load.load(path)
    assert str(e.value).startswith(f"{path}: holds {PLANTED_TYPE}") and "\n" not in str(e.value)
    assert e.value.types == [PLANTED_TYPE] and e.value.path == path
    assert not marker.exists()
    if form == "zip":  # the check too, unpickling nothing; and the file would have run without the loader
        with pytest.raises(UnsafeCheckpointError, match=PLANTED_TYPE):
            safe_load.check(path)
        assert not marker.exists()
        torch.load(path, weights_only=False)
        assert marker.exists()


def test_allowed_types_load_and_the_allowlist_does_not_leak(tmp_path):
    path = str(tmp_path / "f.pt")
    state = {"args": argparse.Namespace(lr=0.1, dtype=torch.bfloat16), "w": torch.arange(4.0)}
    before = set(map(repr, torch.serialization.get_safe_globals()))
    torch.save(state, path)
    got = safe_load.load(path)
    assert got["args"] == state["args"] and torch.equal(got["w"], state["w"])
    assert set(map(repr, torch.serialization.get_safe_globals())) == before  # scoped to the call
    with pytest.raises(UnsafeCheckpointError, match="argparse.Namespace"):  # only what is allowed
        safe_load.load(path, allowed=())
    # a type the process allowed itself stays allowed after a load that needed it
    with torch.serialization.safe_globals([argparse.Namespace]):
        safe_load.load(path)
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    # the opt-in: today's weights_only=False
    marker = tmp_path / "ran"
    torch.save({"x": Planted(str(marker))}, path)
    safe_load.load(path, unsafe=True)
    assert marker.exists()


def test_a_set_pickled_by_python_2_name_loads(tmp_path):
    """DeepSpeed before 0.19.7 pickles ``sparse_tensor_module_names=set()`` into ZeRO-3 model
    states; torch's protocol 2 names ``set`` by its Python 2 module (``__builtin__.set``), which
    pickle maps to ``builtins`` and torch's weights_only allows: it loads, and a type outside the
    allowlist named by a Python 2 module is still refused."""
    import pickletools

    path = str(tmp_path / "f.pt")
    torch.save({"sparse_tensor_module_names": set(), "names": {"a", "b"}, "w": torch.ones(2)}, path)
    import zipfile

    with zipfile.ZipFile(path) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert any(op.name == "GLOBAL" and arg == "__builtin__ set" for op, arg, _ in pickletools.genops(pkl))
    got = safe_load.load(path)
    assert got["sparse_tensor_module_names"] == set() and got["names"] == {"a", "b"}
    torch.save({"r": range(3)}, path)  # __builtin__.xrange in protocol 2: not data we allow
    with pytest.raises(UnsafeCheckpointError, match="xrange|range"):
        safe_load.load(path)


# ------------------------------------------------------------------------------ real tags
def _load_each(engine, root: str, tags: list[str]) -> dict:
    from canzona_ds.ckpt import tag as ck

    out = {}
    for tag in tags:
        try:
            engine.load_checkpoint(root, tag=tag)
            out[tag] = None
        except ck.CheckpointError as e:  # UnsafeCheckpointError is one
            out[tag] = (type(e).__name__, str(e))
    return out


def _emptied(src_tag: str, dst_tag: str, file: str) -> None:
    """A copy of a tag with ``file`` emptied and the manifest recomputed (it verifies)."""
    import json
    import shutil

    from canzona_ds.ckpt import tag as ck

    shutil.copytree(src_tag, dst_tag)
    open(os.path.join(dst_tag, file), "wb").close()
    mpath = os.path.join(dst_tag, ck.MANIFEST)
    manifest = json.loads(open(mpath).read())
    for entry in manifest["files"]:
        entry["bytes"], entry["sha256"] = ck.sha256_file(os.path.join(dst_tag, entry["path"]))
    manifest["tag"], manifest["files_sha256"] = "empty", ck._files_digest(manifest["files"])
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _moe_run(rank, world, root):
    """The tiny MoE model at ZeRO 1, DP 2, ep_size 2 (model states, ZeRO optimizer states and
    expert files): save, plant one object per kind of file (rank 0), load each on every rank;
    then the opt-in loads the planted model states."""
    import torch.distributed as dist

    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    *_, engine = run_moe_engine(rank, world, 2, moe_ds_config(world), steps=1)
    engine.save_checkpoint(root, tag="good")
    planted = {"model": MODEL, "optim": OPTIM, "expert": EXPERT}
    if rank == 0:
        for tag, f in planted.items():
            plant(os.path.join(root, "good"), os.path.join(root, tag), f, os.path.join(root, f"ran_{tag}"))
        _emptied(os.path.join(root, "good"), os.path.join(root, "empty"), OPTIM)
    dist.barrier()
    out = _load_each(engine, root, list(planted) + ["empty"])
    dist.barrier()
    out["markers"] = sorted(f for f in os.listdir(root) if f.startswith("ran_"))
    engine._config._param_dict["canzona_checkpoint"] = {"allow_unsafe_pickle": True}
    out["opted_in"] = _load_each(engine, root, ["model"])["model"]
    dist.barrier()
    out["markers_opted_in"] = sorted(f for f in os.listdir(root) if f.startswith("ran_"))
    return out


def _pipe_run(rank, world, root):
    """The tiny decoder on a PipelineEngine, PP 2 at ZeRO 1 (its layer files)."""
    import torch.distributed as dist

    from canzona_testkit.models import ds_config
    from canzona_testkit.pipeline import run_pipe_engine

    got = {}
    run_pipe_engine(rank, world, ds_config(1, stage=1), pp=2, steps=1, after_init=lambda e: got.update(engine=e))
    engine = got["engine"]
    engine.save_checkpoint(root, tag="good")
    if rank == 0:
        plant(os.path.join(root, "good"), os.path.join(root, "layer"), LAYER, os.path.join(root, "ran_layer"))
    dist.barrier()
    out = _load_each(engine, root, ["layer"])
    dist.barrier()
    out["markers"] = sorted(f for f in os.listdir(root) if f.startswith("ran_"))
    return out


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """{kind: (checkpoint dir, tag, planted file)} after the resumes, with what each rank saw."""
    base = tmp_path_factory.mktemp("planted")
    moe, pipe = str(base / "moe"), str(base / "pipe")
    runs = {"moe": run_distributed(_moe_run, 2, moe, timeout=300),
            "pipe": run_distributed(_pipe_run, 2, pipe, timeout=300)}
    tags = {"model": (moe, MODEL), "optim": (moe, OPTIM), "expert": (moe, EXPERT), "layer": (pipe, LAYER)}
    return runs, tags


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["model", "optim", "expert", "layer"])
def test_resume_refuses_a_planted_object_by_name(planted, kind):
    runs, tags = planted
    root, fname = tags[kind]
    for rank, res in enumerate(runs["pipe" if kind == "layer" else "moe"]):
        assert res[kind] is not None, (rank, kind)
        name, msg = res[kind]
        assert name == "UnsafeCheckpointError", (rank, msg)
        assert f"{os.path.join(root, kind, fname)}: holds {PLANTED_TYPE}," in msg, (rank, msg)
        assert not [m for m in res["markers"] if m == f"ran_{kind}"], (rank, res["markers"])


@pytest.mark.dist
def test_every_rank_refuses_a_malformed_file_together(planted):
    """An empty ZeRO optimizer-states file (not an UnsafeCheckpointError: issue 47 saw rank 0 raise
    EOFError while rank 1 waited in a collective until rank 0's process exited): every rank
    raises the same one-line MalformedCheckpointError naming the file, from the collective check."""
    runs, tags = planted
    root, _ = tags["optim"]
    got = [res["empty"] for res in runs["moe"]]
    assert got[0] is not None and got[0][0] == "MalformedCheckpointError", got
    assert got[0][1].startswith(f"{os.path.join(root, 'empty', OPTIM)}: ") and "\n" not in got[0][1], got
    assert all(g == got[0] for g in got), got


@pytest.mark.dist
def test_opting_in_unpickles_anything(planted):
    runs, _ = planted
    for rank, res in enumerate(runs["moe"]):
        assert res["opted_in"] is None, (rank, res["opted_in"])  # loaded
        assert res["markers_opted_in"] == ["ran_model"], (rank, res)  # and the planted object ran


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["model", "optim", "expert", "layer"])
def test_canzona_ckpt_verify_and_convert_refuse_a_planted_object(planted, kind, tmp_path, capsys):
    from canzona_ds.cli.ckpt import main

    _, tags = planted
    root, fname = tags[kind]
    marker = Path(root) / f"ran_{kind}"
    if marker.exists():  # (the opt-in run's, model states only)
        marker.unlink()
    for cmd in (["verify", root, "--tag", kind], ["convert", root, str(tmp_path / "out"), "--tag", kind]):
        assert main(cmd) == 2, cmd
        err = capsys.readouterr().err
        assert f"{os.path.join(root, kind, fname)}: holds {PLANTED_TYPE}," in err, (cmd, err)
        assert not marker.exists(), cmd
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # the intact tag passes both
    assert main(["verify", root, "--tag", "good"]) == 0
    assert "every file holds only data" in capsys.readouterr().out


@pytest.mark.dist
def test_the_main_jobs_look_at_a_tag_refuses_a_planted_object(planted):
    from canzona_ds.train.rundir import saved_layout
    from canzona_ds.train.trainer import saved_optimizer_type

    _, tags = planted
    root, fname = tags["model"]
    marker = Path(root) / "ran_model"
    if marker.exists():
        marker.unlink()
    with pytest.raises(UnsafeCheckpointError, match=f"{fname}: holds {PLANTED_TYPE},"):
        saved_optimizer_type(os.path.join(root, "model"))
    (Path(root) / "latest").write_text("model")
    with pytest.raises(UnsafeCheckpointError, match=f"{fname}: holds {PLANTED_TYPE},"):
        saved_layout(root)
    assert not marker.exists()
    assert saved_optimizer_type(os.path.join(root, "good")) == "CanzonaMuon"


def test_bad_opt_in_value_names_the_key():
    from canzona_ds.config import CheckpointConfig

    assert CheckpointConfig.from_section({"allow_unsafe_pickle": True}).allow_unsafe_pickle
    with pytest.raises((TypeError, ValueError), match="canzona_checkpoint.allow_unsafe_pickle"):
        CheckpointConfig.from_section({"allow_unsafe_pickle": "yes"})
