"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` of a Canzona engine (what HF Trainer,
Megatron-DeepSpeed and most scripts call) carry and check the manifest
(integration/ckpt/hooks.py).

Each scenario is its own run of 2 gloo ranks: train, ``engine.save_checkpoint`` at step 1 and
step 2, train a third step, damage step2 for real (rank 0, then a barrier), then
``engine.load_checkpoint(dir)`` (``latest`` = step2) on every rank:

* 64 bytes flipped in mp_rank_00_model_states.pt, an optimizer file truncated, one deleted:
  refused on both ranks with the same CheckpointError naming the file (before this, the
  flipped bytes loaded silently, parameters off by ~1e-2);
* step2 saved by DeepSpeed alone (no manifest): loads, rank 0 logs exactly once that it was
  not verified;
* ``"canzona_checkpoint": {"fallback": true}``: the flipped step2 is skipped, step1 loads
  exactly (but never a step1 without a manifest);
* a round trip through the engine methods still resumes bit for bit; a resume at another
  DP size (the index loop) is verified first; `latest` moves only once the manifest is
  written; an engine with another optimizer keeps DeepSpeed's own methods;
* a bad ``canzona_checkpoint`` section is an error naming the value.

Cost: 14 rank runs; 9 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from canzona_ds.ckpt import tag as ck
from canzona_ds.config import CheckpointConfig
from canzona_testkit.dist import run_distributed
from canzona_testkit.models import batches, ds_config, make_model, params_of, run_engine

pytestmark = pytest.mark.dist

MICRO = 2
MODEL = "mp_rank_00_model_states.pt"
OPT0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
OPT1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def flip_middle(path: Path, n: int = 64) -> None:
    """Overwrite ``n`` bytes in the middle of a file with their bitwise complement."""
    from tests.test_checkpoint_integrity import overwrite_middle

    overwrite_middle(path, n)


#: damage applied to the step2 directory
FAULTS = {
    "none": lambda d: None,
    "flip_model_states": lambda d: flip_middle(d / MODEL),
    "truncate_optim": lambda d: os.truncate(d / OPT1, os.path.getsize(d / OPT1) // 2),
    "missing_optim": lambda d: (d / OPT0).unlink(),
}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _engine(world: int, extra: dict):
    import canzona_ds  # noqa: F401 - registers CanzonaMuon
    import deepspeed

    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(world, micro=MICRO, **extra))
    return engine


def _step(engine, rank, x, y) -> None:
    engine.backward(engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
    engine.step()


def _save(engine, root, tag, step, plain):
    if plain:  # DeepSpeed's own save, as without canzona_ds: no manifest
        with ck.engine_hooks_off():
            engine.save_checkpoint(root, tag=tag, client_state={"step": step})
    else:
        engine.save_checkpoint(root, tag=tag, client_state={"step": step})


def _scenario(rank, world, root, fault, extra, plain):
    import torch.distributed as dist

    records = _Records()
    logging.getLogger("canzona_ds").addHandler(records)
    root = Path(root)
    engine = _engine(world, extra)
    data = batches(3, MICRO * world)
    _step(engine, rank, *data[0])
    _save(engine, root, "step1", 1, "step1" in plain)
    p1 = params_of(engine.module)
    _step(engine, rank, *data[1])
    _save(engine, root, "step2", 2, "step2" in plain)
    p2 = params_of(engine.module)
    _step(engine, rank, *data[2])  # the engine moves away from both checkpoints
    if rank == 0:
        FAULTS[fault](root / "step2")
    dist.barrier()
    out = dict(p1=p1, p2=p2, files=sorted(os.listdir(root / "step2")), log_before_load=len(records.messages))
    try:
        path, client = engine.load_checkpoint(root)
        out["loaded"] = (path, client["step"], params_of(engine.module))
    except ck.CheckpointError as e:
        out["refused"] = (str(e), e.problems)
    out["log"] = records.messages[out.pop("log_before_load"):]
    return out


def run_scenario(tmp_path, fault: str, extra: dict | None = None, plain: tuple = ()) -> list[dict]:
    """``plain``: the tags saved by DeepSpeed alone (no manifest)."""
    return run_distributed(_scenario, 2, str(tmp_path / "ckpt"), fault, extra or {}, plain, timeout=300)


def _assert_refused(res: list[dict], fname: str, words: str) -> None:
    assert res[0].get("refused") == res[1].get("refused"), res  # one verdict on both ranks
    assert "refused" in res[0], f"loaded: {res[0].get('loaded', '')!s:.200}"
    msg, problems = res[0]["refused"]
    assert "step2" in msg and fname in msg and words in msg, msg
    assert (fname, ) == tuple(p[0] for p in problems), problems


def test_flipped_bytes_in_model_states_refused_naming_the_file(tmp_path):
    res = run_scenario(tmp_path, "flip_model_states")
    _assert_refused(res, MODEL, "sha256 mismatch")


def test_truncated_optim_states_refused_naming_the_file(tmp_path):
    res = run_scenario(tmp_path, "truncate_optim")
    _assert_refused(res, OPT1, "size mismatch")


def test_missing_file_refused_naming_it(tmp_path):
    res = run_scenario(tmp_path, "missing_optim")
    _assert_refused(res, OPT0, "missing")


def test_size_mode_refuses_a_truncated_file(tmp_path):
    res = run_scenario(tmp_path, "truncate_optim", extra={"canzona_checkpoint": {"verify": "size"}})
    _assert_refused(res, OPT1, "size mismatch")


def test_checkpoint_without_manifest_loads_with_one_notice(tmp_path):
    res = run_scenario(tmp_path, "none", plain=("step2",))
    for r in res:
        assert ck.MANIFEST not in r["files"], r["files"]
        path, step, params = r["loaded"]
        assert step == 2 and "step2" in path
        for n, v in r["p2"].items():
            np.testing.assert_array_equal(params[n], v, err_msg=n)
    notices = [m for m in res[0]["log"] if "NOT verified" in m]
    assert len(notices) == 1 and ck.MANIFEST in notices[0] and "step2" in notices[0], res[0]["log"]
    assert not [m for m in res[1]["log"] if "NOT verified" in m], res[1]["log"]  # rank 0 only


def test_fallback_to_newest_intact_tag_when_opted_in(tmp_path):
    res = run_scenario(tmp_path, "flip_model_states", extra={"canzona_checkpoint": {"fallback": True}})
    for r in res:
        assert "refused" not in r, r["refused"]
        path, step, params = r["loaded"]
        assert step == 1 and "step1" in path
        for n, v in r["p1"].items():
            np.testing.assert_array_equal(params[n], v, err_msg=n)
        assert any((r["p1"][n] != r["p2"][n]).any() for n in r["p1"])  # step 1 != step 2
    skips = [m for m in res[0]["log"] if "skipping" in m]
    assert len(skips) == 1 and MODEL in skips[0] and "sha256 mismatch" in skips[0], res[0]["log"]


def test_fallback_never_loads_a_tag_without_manifest(tmp_path):
    """Only the tag asked for may load unverified; a fallback candidate must verify."""
    res = run_scenario(tmp_path, "flip_model_states", extra={"canzona_checkpoint": {"fallback": True}},
                       plain=("step1",))
    assert res[0].get("refused") == res[1].get("refused")
    msg, problems = res[0]["refused"]
    assert msg.startswith("no intact checkpoint in "), msg
    assert f"step2: {MODEL}: sha256 mismatch" in msg and f"step1: {ck.MANIFEST}: missing" in msg, msg


def _round_trip(rank, world, root):
    data = batches(4, MICRO * world)
    _, _, a = run_engine(rank, world, ds_config(world, micro=MICRO), 2, data=data[:2])
    a.save_checkpoint(root, tag="t2")
    saved = params_of(a.module)
    for x, y in data[2:]:
        _step(a, rank, x, y)
    b = _engine(world, {})
    path, _ = b.load_checkpoint(root)
    resumed = params_of(b.module)
    for x, y in data[2:]:
        _step(b, rank, x, y)
    return dict(saved=saved, resumed=resumed, a=params_of(a.module), b=params_of(b.module), path=path)


def test_round_trip_through_engine_methods_is_bit_exact(tmp_path):
    root = tmp_path / "ckpt"
    res = run_distributed(_round_trip, 2, str(root), timeout=300)
    for r in res:
        assert "t2" in r["path"]
        for n in r["saved"]:
            np.testing.assert_array_equal(r["resumed"][n], r["saved"][n], err_msg=n)
            np.testing.assert_array_equal(r["b"][n], r["a"][n], err_msg=n)
    # the manifest describes exactly DeepSpeed's files and the checkpoint index, and `latest` names the tag
    man = ck.verify(root, "t2")
    assert [f["path"] for f in man["files"]] == [ck.INDEX, MODEL, OPT0, OPT1]
    assert man["tag"] == "t2" and man["world_size"] == 2 and man["global_steps"] == 2
    assert (root / "latest").read_text() == "t2"
    assert json.loads((root / "t2" / ck.MANIFEST).read_text()) == man


def _manifest_write_fails(rank, world, root):
    root = Path(root)
    engine = _engine(world, {})
    data = batches(2, MICRO * world)
    _step(engine, rank, *data[0])
    engine.save_checkpoint(root, tag="step1")
    _step(engine, rank, *data[1])
    real = ck.write_atomic

    def full(path, data):
        raise OSError(28, "No space left on device (injected)")

    ck.write_atomic = full  # rank 0 cannot write the manifest of step2
    try:
        engine.save_checkpoint(root, tag="step2")
        error = None
    except ck.CheckpointError as e:
        error = str(e)
    finally:
        ck.write_atomic = real
    return dict(error=error, latest=(root / "latest").read_text(), files=sorted(os.listdir(root / "step2")))


def test_latest_is_written_only_after_the_manifest(tmp_path):
    """A save whose manifest cannot be written raises on every rank and leaves `latest` on the
    previous tag (DeepSpeed alone would already point it at the new one)."""
    res = run_distributed(_manifest_write_fails, 2, str(tmp_path / "ckpt"), timeout=300)
    for r in res:
        assert r["error"] is not None and "No space left on device (injected)" in r["error"], r["error"]
        assert r["latest"] == "step1"
        assert ck.MANIFEST not in r["files"]


def _other_optimizer(rank, world, root):
    _, _, engine = run_engine(rank, world, ds_config(world, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}), 1)
    engine.save_checkpoint(root, tag="step1")
    path, _ = engine.load_checkpoint(root)
    return dict(files=sorted(os.listdir(Path(root) / "step1")), path=path)


def test_engines_with_other_optimizers_are_untouched(tmp_path):
    r = run_distributed(_other_optimizer, 1, str(tmp_path / "ckpt"), timeout=300)[0]
    assert ck.MANIFEST not in r["files"] and "step1" in r["path"]


def _save_at_dp2(rank, world, root):
    _, _, engine = run_engine(rank, world, ds_config(world, micro=MICRO), 2)
    engine.save_checkpoint(root, tag="step2")
    return params_of(engine.module)


def _elastic_load_at_dp1(rank, world, intact, damaged):
    engine = _engine(world, {})
    try:
        engine.load_checkpoint(damaged)
        refused = None
    except ck.CheckpointError as e:
        refused = (str(e), e.problems)
    path, _ = engine.load_checkpoint(intact)
    return dict(refused=refused, path=path, params=params_of(engine.module))


def test_elastic_resume_is_verified_first(tmp_path):
    """Saved at DP=2, loaded at DP=1 (the index loop reads every optimizer file): a
    flipped optimizer file is refused by name before the index loop sees it; the intact
    checkpoint verifies and resumes exactly."""
    import shutil

    intact, damaged = tmp_path / "intact", tmp_path / "damaged"
    saved = run_distributed(_save_at_dp2, 2, str(intact), timeout=300)[0]
    shutil.copytree(intact, damaged)
    flip_middle(damaged / "step2" / OPT1)
    r = run_distributed(_elastic_load_at_dp1, 1, str(intact), str(damaged), timeout=300)[0]
    assert r["refused"] is not None, "the damaged checkpoint loaded"
    msg, problems = r["refused"]
    assert OPT1 in msg and "sha256 mismatch" in msg and [p[0] for p in problems] == [OPT1], msg
    assert "step2" in r["path"]
    for n, v in saved.items():
        np.testing.assert_array_equal(r["params"][n], v, err_msg=n)


@pytest.mark.parametrize("section,exc,text", [
    ({"verify": "md5"}, ValueError, "canzona_checkpoint.verify='md5'"),
    ({"fallback": "yes"}, TypeError, "canzona_checkpoint.fallback='yes'"),
    ({"fallback": True, "verify": "off"}, ValueError, "fallback=true with verify='off'"),
    ({"fallbak": True}, ValueError, "Unknown canzona_checkpoint key(s) ['fallbak']"),
    ({"verify": None}, ValueError, "canzona_checkpoint.verify=None"),
    ([True], TypeError, "Invalid canzona_checkpoint=[True]"),
])
def test_bad_checkpoint_section_names_the_value(section, exc, text):
    with pytest.raises(exc) as ei:
        CheckpointConfig.from_section(section)
    assert text in str(ei.value)


def _bad_section(rank, world):
    try:
        run_engine(rank, world, ds_config(world, canzona_checkpoint={"verify": "md5"}), 0)
    except ValueError as e:
        return str(e)
    return None


def test_bad_checkpoint_section_refused_at_initialize():
    msg = run_distributed(_bad_section, 1)[0]
    assert msg is not None and "canzona_checkpoint.verify='md5'" in msg, msg


def _nested(seed: int):
    """The tiny model saving its state dict nested, as Megatron-DeepSpeed does
    (``state_dict_for_save_checkpoint()``: ``{"language_model": {"encoder": {...}}}``), with the
    matching ``load_state_dict`` DeepSpeed's stock load calls."""
    import torch

    class Nested(type(make_model(seed))):
        def state_dict(self, *args, **kwargs):
            return {"outer": {"inner": dict(torch.nn.Module.state_dict(self, *args, **kwargs))}}

        def load_state_dict(self, state_dict, strict=True):
            return torch.nn.Module.load_state_dict(self, state_dict["outer"]["inner"], strict)

    model = make_model(seed)
    model.__class__ = Nested
    return model


def _nested_resume(rank, world, root):
    import canzona_ds  # noqa: F401
    import deepspeed

    records = _Records()
    logging.getLogger("canzona_ds").addHandler(records)
    a_model = _nested(0)
    a, *_ = deepspeed.initialize(model=a_model, model_parameters=a_model.parameters(),
                                 config=ds_config(world, micro=MICRO, stage=0))
    x, y = batches(1, MICRO * world)[0]
    _step(a, rank, x, y)
    a.save_checkpoint(root, tag="t1")
    b_model = _nested(1)  # other weights: the load must replace every one
    b, *_ = deepspeed.initialize(model=b_model, model_parameters=b_model.parameters(),
                                 config=ds_config(world, micro=MICRO, stage=1, checkpoint={"load_universal": True}))
    path, _ = b.load_checkpoint(root)
    index = json.loads((Path(root) / "t1" / ck.INDEX).read_text())
    keys = sorted({tuple(c["key"][:3]) for c in index["chunks"] if c["state"] == "param"})
    return dict(saved=params_of(a.module), loaded=params_of(b.module), path=path, log=records.messages, keys=keys,
                universal=b.load_universal_checkpoint())


def test_nested_module_state_dict_resumes_at_another_stage_under_load_universal(tmp_path):
    """A client whose module state dict is nested (Megatron-DeepSpeed) saved at ZeRO 0 resumes at
    ZeRO 1 (the index loop), with DeepSpeed's ``checkpoint.load_universal`` set (Megatron's
    ``--universal-checkpoint``): the index records where each weight was written in the nested
    dict, the canzona-ds tag loads through it, and every weight is the saved one bit for bit."""
    res = run_distributed(_nested_resume, 2, str(tmp_path / "ckpt"), timeout=300)
    for r in res:
        assert r["path"].endswith("t1") and r["universal"], r["path"]  # the flag is back after the load
        assert r["keys"] == [("module", "outer", "inner")], r["keys"]
        assert set(r["loaded"]) == set(r["saved"])
        for n in r["saved"]:
            assert (r["loaded"][n] != make_model(1).state_dict()[n].numpy()).any() or n.endswith("bias")
            np.testing.assert_array_equal(r["loaded"][n], r["saved"][n], err_msg=n)
    assert any("load_universal" in m and "loaded through it" in m for m in res[0]["log"]), res[0]["log"]
