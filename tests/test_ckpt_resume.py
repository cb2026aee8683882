"""Resume through the checkpoint index: one scenario table (model, optimizer, saved layout,
running layout), then the index's guarantees (role changes, save faults, a damaged index,
canzona-ckpt, a tag from before the index, another optimizer).

Each scenario saves (real gloo processes, gradient clipping that clips on every step where the
path clips torch-exactly: not under TP), loads at the running layout through the plain
``engine.load_checkpoint`` (the index loop only: DeepSpeed's stock load would fail the test; a
``tp`` row at its saved layout must take the stock load instead), and checks
(``canzona_testkit/resume``):

  * lossless: right after the load the engine saves again; every (whole-model name, state key)
    the first index holds (fp32 master, AdamW moments, every rule-state entry) reads back bit
    for bit from the second, whatever the two layouts (in the TP=1 frame where TP changed), and
    the step counts agree;
  * the lr schedule: every row runs a warm-up-then-decay schedule (torch's LambdaLR as the engine's
    client scheduler; canzona_testkit/schedule.py), and every param group's lr at each resumed
    step is the schedule's, bit for bit (the first resumed step is neither the fresh schedule's
    first value nor the configured peak);
  * exact continuation: the resumed run equals its family's single-process reference (torch's
    clip_grad_norm_, the reference optimizer) continued from the saved state: bit for bit where
    both sides average over at most 2 ranks in fp32 (a sum of two is exact in either order) and
    run the same kernels; at 4 ranks within the reordered-sum bounds each family names.  The
    references run the same schedule (the same factor on their groups' lrs).

Saved checkpoints are shared between the scenarios that start from the same layout.

Cost: 137 rank runs, 2 launching tests; 2.0 min on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

from canzona_testkit.kernels import assert_bits, test_threads
import importlib
import os

import numpy as np
import pytest
import torch

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import ds_config, make_model, params_of
from canzona_testkit.resume import AFTER, BEFORE, Layout, assert_same_state, dense, tp1_state
from canzona_testkit.schedule import check_lrs, scheduled

#: model -> the family module that saves, resumes and checks it (canzona_testkit/resume/)
FAMILIES = {"dense": "dense", "stacks": "dense", "moe": "moe", "moe-e2": "moe"}
FAMILIES.update({"moetp": "moetp", "moepipe": "moepipe", "moepipe-s0": "moepipe"})
FAMILIES.update({"tp": "tp", "pipe": "pipe", "pptp": "pipe"})

M, SH, SO = "CanzonaMuon", "CanzonaShampoo", "CanzonaSOAP"
#: (model, optimizer, saved layout, running layout) -- layouts as canzona_testkit.resume.Layout specs
SCENARIOS = [
    # ZeRO stage changes at the same and at another DP size, DP resizes at one stage
    ("dense", M, "z1 dp2", "z3 dp2"), ("dense", SO, "z3 dp2", "z1 dp2"), ("dense", SH, "z2 dp2", "z0 dp2"),
    ("dense", M, "z0 dp2", "z3 dp2"), ("dense", M, "z1 dp2", "z3 dp1"), ("dense", SO, "z3 dp1", "z1 dp2"),
    ("dense", SH, "z2 dp2", "z0 dp1"), ("dense", M, "z0 dp1", "z3 dp2"), ("dense", M, "z1 dp2", "z1 dp1"),
    ("dense", SH, "z1 dp1", "z1 dp2"), ("dense", SO, "z2 dp2", "z2 dp1"), ("dense", SO, "z3 dp2", "z3 dp1"),
    ("dense", M, "z1 dp4", "z1 dp2"), ("dense", M, "z1 dp2", "z2 dp4"), ("dense", SH, "z2 dp2", "z1 dp4"),
    # ZeRO-3 with the optimizer offloaded, off and on; the mixed ZeRO-1/2 layout to owned
    ("dense", SO, "z3 dp2 offload", "z3 dp1"), ("dense", M, "z1 dp2", "z3 dp2 offload"),
    ("dense", M, "z2 dp2 mixed", "z1 dp1"),
    # transformers expert stacks (3-D mlp.experts.*, rule state per expert W[e])
    ("stacks", M, "z1 dp2", "z1 dp1"), ("stacks", M, "z1 dp2", "z0 dp2"), ("stacks", SO, "z2 dp1", "z2 dp2"),
    # DeepSpeed MoE: experts by whole-model name; another ep_size, DP size, stage
    ("moe", SO, "z1 dp2 ep2", "z1 dp2 ep1"), ("moe", M, "z2 dp2 ep2", "z2 dp1 ep1"),
    ("moe", M, "z2 dp2 ep2", "z1 dp2 ep2"), ("moe", SH, "z0 dp2 ep2", "z0 dp2 ep1"),
    ("moe", SH, "z0 dp2 ep2", "z2 dp1 ep1"), ("moe", SO, "z1 dp2 ep2", "z0 dp2 ep2"),
    ("moe", SH, "z0 dp2 ep2", "z0 dp4 ep2"),
    ("moe", M, "z2 dp2 ep2", "z2 dp4 ep4"), ("moe", M, "z0 dp4 ep2", "z0 dp2 ep2"),
    # two MoE layers of different ep_size (two expert groups), same and swapped
    ("moe", SH, "z2 dp4 ep2 epb1", "z2 dp2 ep2 epb1"), ("moe", SH, "z2 dp4 ep2 epb1", "z1 dp2 ep1 epb2"),
    # ZeRO-Offload with MoE: ep_size 2 -> 1 (the experts' expert-DP group 1 -> 2 ranks), DP 4 -> 2
    ("moe", SH, "z2 dp2 ep2 offload", "z2 dp2 ep1 offload"), ("moe", M, "z1 dp4 ep2 offload", "z1 dp2 ep2 offload"),
    # use_data_before_expert_parallelism flipped at the same size, and resized
    ("moe", SH, "z2 dp4 ep2 before", "z2 dp4 ep2"), ("moe", SH, "z2 dp4 ep2 before", "z2 dp2 ep2"),
    ("moe", M, "z0 dp4 ep2", "z1 dp4 ep2 before"),
    # the mixed layout with MoE (each rank's expert hosted over its expert-DP pair): to owned, to
    # mixed at another size, owned to mixed
    ("moe-e2", M, "z2 dp4 ep2 mixed", "z2 dp2 ep2"), ("moe-e2", M, "z2 dp4 ep2 mixed", "z2 dp2 ep2 mixed"),
    ("moe-e2", SO, "z1 dp4 ep2 mixed", "z1 dp2 ep2 mixed"), ("moe-e2", M, "z2 dp2 ep2", "z2 dp4 ep2 mixed"),
    # moetp, moepipe: DeepSpeed MoE x TP (no clipping: DeepSpeed reduces the norm over the
    # model-parallel group under TP) and MoE x PP (canzona_testkit/resume/moetp.py, moepipe.py)
    # TP 2 -> 1 at DP 2 (ZeRO 1, 2, offloaded both sides), from ep_size 1 too; the mixed layout to owned
    ("moetp", SH, "z1 tp2 dp2 ep2", "z1 tp1 dp2 ep2"), ("moetp", SO, "z2 tp2 dp2 ep2", "z2 tp1 dp2 ep2"),
    ("moetp", SH, "z2 tp2 dp2 ep2 offload", "z2 tp1 dp2 ep2 offload"), ("moetp", M, "z2 tp2 dp2 ep1", "z2 tp1 dp2 ep2"),
    ("moetp", M, "z1 tp2 dp2 ep2 mixed", "z1 tp1 dp2 ep2"),
    # TP 2 kept: half the nodes (the expert-parallel group is the TP group), owned -> mixed and mixed
    # at another size (the TP-split MLP grid-hosted), another ep_size; TP 1 -> 2
    ("moetp", SH, "z1 tp2 dp2 ep2", "z1 tp2 dp1 ep2"), ("moetp", SH, "z1 tp2 dp2 ep2", "z1 tp2 dp2 ep2 mixed"),
    ("moetp", M, "z1 tp2 dp2 ep2 mixed", "z1 tp2 dp1 ep2 mixed"), ("moetp", M, "z2 tp2 dp2 ep1", "z2 tp2 dp1 ep2"),
    ("moetp", SH, "z1 tp2 dp2 ep2", "z1 tp2 dp2 ep1"), ("moetp", SO, "z1 tp1 dp2 ep2", "z1 tp2 dp2 ep2"),
    # ZeRO 0 (DeepSpeed's own files: the module per TP rank, expp_rank optimizer files) at another TP
    # size, and to and from ZeRO 1 with TP 2 kept
    ("moetp", M, "z0 tp2 dp1 ep2", "z0 tp1 dp2 ep2"), ("moetp", M, "z0 tp2 dp1 ep2", "z1 tp2 dp1 ep2"),
    ("moetp", SH, "z1 tp2 dp2 ep2", "z0 tp2 dp1 ep2"),
    # PP 2 x DP 2 (ep_size 2) at another DP size and ep_size, at ZeRO 0 (expp_rank files), Shampoo;
    # MoE in stage 0 only (stage 1: the head, AdamW, no matrix)
    ("moepipe", M, "z1 pp2 dp2 ep2", "z1 pp2 dp1 ep1"), ("moepipe", M, "z1 pp2 dp2 ep2", "z1 pp2 dp2 ep1"),
    ("moepipe", M, "z0 pp2 dp2 ep2", "z0 pp2 dp1 ep1"), ("moepipe", SH, "z1 pp2 dp2 ep2", "z1 pp2 dp1 ep1"),
    ("moepipe-s0", M, "z0 pp2 dp2 ep2", "z0 pp2 dp1 ep1"),
    # tensor and pipeline parallelism without MoE (canzona_testkit/resume/tp.py, pipe.py; no clipping under
    # TP): TP 2 -> 1 (TP shard frames; Muon's momentum and SOAP's factors and eigenbases in a TP host's
    # concatenated layout); the mixed layout at DP 2 x TP 2 (grid-hosted matrices) at the same layout
    # (DeepSpeed's stock load: Muon's pieces, SOAP's grid host), owned <-> mixed, to mixed at TP 1;
    # TP 2 -> 1 under PP 2; PP 2 <-> 1 at ZeRO 0 and 1 (the tied embedding), ZeRO 0 -> 1 with it
    ("tp", M, "z1 tp2 dp1", "z1 tp1 dp2"), ("tp", SO, "z1 tp2 dp1", "z1 tp1 dp2"),
    ("tp", M, "z1 tp2 dp2 mixed", "z1 tp2 dp2 mixed"), ("tp", SO, "z1 tp2 dp2 mixed", "z1 tp2 dp2 mixed"),
    ("tp", M, "z1 tp2 dp2", "z1 tp2 dp2 mixed"), ("tp", M, "z1 tp2 dp2 mixed", "z1 tp2 dp2"),
    ("tp", M, "z1 tp2 dp2 mixed", "z1 tp1 dp2 mixed"), ("pptp", M, "z1 pp2 tp2 dp1", "z1 pp2 tp1 dp2"),
    ("pipe", SO, "z1 pp2 dp1", "z1 pp1 dp1"), ("pipe", SO, "z1 pp1 dp1", "z1 pp2 dp1"),
    ("pipe", SO, "z0 pp2 dp1", "z0 pp1 dp1"), ("pipe", SO, "z0 pp1 dp1", "z0 pp2 dp1"),
    ("pipe", SO, "z0 pp2 dp1", "z1 pp1 dp1"),
]


def family(model: str):
    return importlib.import_module(f"canzona_testkit.resume.{FAMILIES[model]}")


def _id(row) -> str:
    model, opt, a, b = row
    return f"{model}-{opt[7:]}-{a.replace(' ', '')}-to-{b.replace(' ', '')}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved checkpoint per (model, optimizer, saved layout), shared by its scenarios."""
    made = {}

    def get(model: str, opt_type: str, spec: str, old: bool = False) -> str:
        """``old``: the save writes the pre-index records too (canzona_testkit.ckpt.pre_index_records:
        for _pre_index)."""
        key = (model, opt_type, spec, old)
        if key not in made:
            from canzona_testkit.ckpt import save_pre_index

            lay = Layout.parse(spec)
            ckpt = str(tmp_path_factory.mktemp(f"saved-{model}-{opt_type}-{spec.replace(' ', '')}{'-old' * old}"))
            if old:
                res = run_distributed(scheduled, lay.world, save_pre_index, family(model).__name__, model, lay,
                                      opt_type, ckpt)
            else:
                res = run_distributed(scheduled, lay.world, family(model).save, model, lay, opt_type, ckpt)
            check_lrs(res, range(BEFORE), prefix=True)  # (moepipe's save runs its own continuation on)
            made[key] = ckpt
        return made[key]

    return get


def _resume_and_check(ckpt, tmp_path, model, opt_type, a, b):
    """Resume ``ckpt`` (saved at layout ``a``) at layout ``b`` through the index loop only; check
    the state bit for bit against ``ckpt``'s index (or ``index``) and the continuation."""
    fam, sa, sb = family(model), Layout.parse(a), Layout.parse(b)
    out = str(tmp_path / "out")
    res = run_distributed(scheduled, sb.world, fam.resume, model, sb, opt_type, ckpt, out)
    # every resumed step ran at the schedule's lr in every param group (the saving run's did too)
    check_lrs(res, range(BEFORE, BEFORE + AFTER))
    fam.check(model, opt_type, sa, sb, ckpt, out, res)


@pytest.mark.parametrize("model,opt_type,a,b", SCENARIOS, ids=[_id(r) for r in SCENARIOS])
def test_resume_across_layouts(saved, tmp_path, model, opt_type, a, b):
    _resume_and_check(saved(model, opt_type, a), tmp_path, model, opt_type, a, b)


def test_moe_pipeline_checkpoint_read_whole_by_name(saved):
    """The offline form (``canzona_testkit.ckpt.read``, what ``canzona-ckpt convert`` writes): a
    MoE x PP checkpoint read through its index, every stage's parameters and every expert by
    whole-model name, equal to what the saving ranks held, bit for bit."""
    from canzona_testkit.ckpt import read
    from canzona_testkit.resume import moepipe

    ckpt = saved("moepipe", M, "z1 pp2 dp2 ep2")
    held = moepipe.saving_run(ckpt, 4)
    params = {n: w for r in held for n, w in r["held"]["module"].items()}
    rule_state = {n: st for r in held for n, st in r["held"]["rule_state"].items()}
    got = read(ckpt, "saved")
    assert sorted(got.params) == sorted(params) and sorted(got.rule_state) == sorted(rule_state)
    assert len([n for n in rule_state if ".deepspeed_experts." in n]) == 2 * 4 * 2  # both stages' experts
    for n, w in params.items():
        np.testing.assert_array_equal(got.params[n].numpy(), w, err_msg=n)
    for n, st in rule_state.items():
        assert st and set(st) <= set(got.rule_state[n]), n
        for k, v in st.items():
            np.testing.assert_array_equal(got.rule_state[n][k].numpy(), v, err_msg=f"{k} of {n}")


def _moe_pipe_into_plain_moe(rank, world, ckpt):
    """The MoE x PP checkpoint into the tiny MoE model without pipeline parallelism (PP 1 x DP 2,
    ep_size 2): another model (its parameters are not the pipeline's ``<layer>.<name>``)."""
    from canzona_ds.ckpt import CheckpointIndexError
    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    try:
        run_moe_engine(rank, world, 2, moe_ds_config(world, optimizer="CanzonaMuon", stage=1), 1,
                       after_init=lambda engine: engine.load_checkpoint(ckpt, tag="saved"))
    except CheckpointIndexError as e:
        return str(e)
    return None


def test_moe_pipeline_checkpoint_into_another_model_is_refused(saved):
    """The pipeline's checkpoint loaded by a model without pipeline parallelism (other parameter
    names) goes through the checkpoint index (MoE at ZeRO 1/2 describes its chunks), which refuses
    it by name on every rank, naming the parameters, before anything loads."""
    ckpt = saved("moepipe", M, "z1 pp2 dp2 ep2")
    for rank, msg in enumerate(run_distributed(_moe_pipe_into_plain_moe, 2, ckpt)):
        assert msg is not None and "parameters differ from the model's" in msg and "1.moe." in msg, (rank, msg)


def _pre_index(src: str, dst: str) -> str:
    """A copy of tag ``src/saved`` (saved with ``old=True``: the records canzona-ds wrote before
    the index too) as canzona-ds wrote it before the index: the same files, no index, no manifest."""
    import shutil

    from canzona_ds.ckpt import tag as ck

    shutil.copytree(src, dst)
    for name in (ck.INDEX, ck.MANIFEST):
        os.remove(os.path.join(dst, "saved", name))
    return dst


def _engine(dp: int, stage: int, opt_type: str, cfg: dict | None = None):
    return dense.engine_for("dense", Layout(stage, dp), opt_type, cfg)


def _train(engine, rank: int, steps: int, seed: int) -> None:
    dense.train(engine, rank, dense.data("dense", engine.dp_world_size, steps, seed))


# ------------------------------------------------------------------------------ role changes
def _resume_roles(rank, dp, ckpt, stage, include, reinit, out):
    """Load with another matrix selection; returns the refusal (buffers checked untouched) or saves."""
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_ds.ckpt import CheckpointIndexError

    cfg = dense.config(Layout(stage, dp), "CanzonaMuon")
    cfg["optimizer"]["params"]["matrix_include"] = include
    cfg["canzona_checkpoint"] = {"reinit_changed_roles": reinit}
    model = make_model(0)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    before = dense.params(engine, stage)
    try:
        engine.load_checkpoint(ckpt, tag="saved")
    except CheckpointIndexError as e:
        after = dense.params(engine, stage)
        assert_bits(after, before, "a refused load changed the weights")
        return str(e)
    engine.save_checkpoint(out, tag="reloaded")
    return None


@pytest.mark.parametrize("stage", [1, 3])
def test_changed_matrix_selection_is_refused_or_reinitialised(saved, tmp_path, stage):
    from canzona_ds.ckpt import Index, Reader

    ckpt = saved("dense", M, "z1 dp2")
    out = str(tmp_path / "out")
    refused = run_distributed(_resume_roles, 2, ckpt, stage, ["lm_head"], False, out)
    for msg in refused:  # every rank, by name, with the way out
        assert msg is not None and "'lm_head.weight' (adamw -> matrix)" in msg and "reinit_changed_roles" in msg
    assert run_distributed(_resume_roles, 2, ckpt, stage, ["lm_head"], True, out) == [None, None]
    a_dir, b_dir = os.path.join(ckpt, "saved"), os.path.join(out, "reloaded")
    a, b = Index.read(a_dir), Index.read(b_dir)
    assert a.meta["roles"]["lm_head.weight"] == "adamw" and b.meta["roles"]["lm_head.weight"] == "matrix"
    dropped = {("lm_head.weight", "exp_avg"), ("lm_head.weight", "exp_avg_sq")}
    assert set(a.by_key()) - dropped == set(b.by_key())  # exactly its AdamW moments re-initialised
    ra, rb = Reader(a_dir, a), Reader(b_dir, b)
    for name, state in b.by_key():
        assert torch.equal(ra.whole(name, state), rb.whole(name, state)), (name, state)


# ------------------------------------------------------------------------------ save faults
def _save_failing(rank, dp, ckpt, fail_rank):
    """Save 'good'; one more step; save 'bad' with ``fail_rank``'s torch.save hitting a full disk."""
    import errno

    from canzona_ds.ckpt import tag as ck
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    engine = _engine(dp, 1, "CanzonaMuon")
    _train(engine, rank, BEFORE, 1)
    engine.save_checkpoint(ckpt, tag="good")
    _train(engine, rank, 1, 3)
    stock = TorchCheckpointEngine.save

    def full_disk(self, state_dict, path):
        if rank == fail_rank and "optim_states" in str(path):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)  # a partly written file, as a real full disk leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return stock(self, state_dict, path)

    TorchCheckpointEngine.save = full_disk
    try:
        engine.save_checkpoint(ckpt, tag="bad")
    except ck.CheckpointError as e:
        return str(e)
    finally:
        TorchCheckpointEngine.save = stock
    return None


def test_full_disk_is_named_on_every_rank_and_keeps_the_previous_tag(tmp_path):
    from canzona_ds.ckpt import tag as ck

    ckpt = str(tmp_path / "ckpt")
    msgs = run_distributed(_save_failing, 2, ckpt, 1)
    for msg in msgs:
        assert msg is not None and "No space left on device" in msg and "rank 1" in msg
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in msg
    bad = os.path.join(ckpt, "bad")
    assert not [f for f in os.listdir(bad) if ".tmp" in f] and not os.path.exists(
        os.path.join(bad, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))  # no temp file, no half-written file
    assert open(os.path.join(ckpt, "latest")).read() == "good"
    with pytest.raises(ck.CheckpointError, match=r"incomplete save.*zero_pp_rank_1_mp_rank_00_optim_states.pt.*"
                                                 r"No space left on device"):
        ck.verify(ckpt, "bad")
    ck.verify(ckpt, "good")
    out = str(tmp_path / "out")
    res = run_distributed(_resume_good, 2, ckpt, out)
    assert res[0] == "good"  # `latest`
    assert_same_state(os.path.join(ckpt, "good"), os.path.join(out, "reloaded"))


def _resume_good(rank, dp, ckpt, out):
    engine = _engine(dp, 1, "CanzonaMuon")
    path, _ = engine.load_checkpoint(ckpt)  # `latest`
    engine.save_checkpoint(out, tag="reloaded")
    return os.path.basename(os.path.dirname(path))  # DeepSpeed returns the model-states file's path


KILL_SCRIPT = r"""
import os, signal, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, torch.distributed as dist
from canzona_testkit.kernels import test_threads
torch.set_num_threads(test_threads())
dist.init_process_group("gloo", rank=0, world_size=1)
sys.path.insert(0, sys.argv[3])
import test_ckpt_resume as t
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
engine = t._engine(1, 1, "CanzonaMuon")
t._train(engine, 0, t.BEFORE, 1)
engine.save_checkpoint(sys.argv[1], tag="good")
t._train(engine, 0, 1, 3)
stock = TorchCheckpointEngine.save
def killed(self, state_dict, path):
    if "optim_states" in str(path):
        with open(path, "wb") as f:
            f.write(b"PK\3\4 half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    return stock(self, state_dict, path)
TorchCheckpointEngine.save = killed
engine.save_checkpoint(sys.argv[1], tag="bad")
"""


def test_save_killed_mid_write_is_reported_incomplete(tmp_path):
    import subprocess
    import sys

    from canzona_ds.ckpt import tag as ck
    from canzona_testkit.dist import free_port

    ckpt = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, ckpt, str(free_port()), os.path.dirname(__file__)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    # (the optimizer file is there, half written: the commit mark is what tells)
    with pytest.raises(ck.CheckpointError, match=r"incomplete save.*missing \['canzona_index\.json', "
                                                 r"'canzona_manifest\.json'\]") as e:
        ck.verify(ckpt, "bad")
    assert e.value.problems[0] == ("canzona_index.json", "missing")
    assert open(os.path.join(ckpt, "latest")).read() == "good"
    out = str(tmp_path / "out")
    assert run_distributed(_resume_good, 1, ckpt, out) == ["good"]
    assert_same_state(os.path.join(ckpt, "good"), os.path.join(out, "reloaded"))
    # the incomplete tag asked for by name is refused by the engine too, naming what is missing
    assert "incomplete save" in run_distributed(_load_refused, 1, ckpt, "bad")[0]


def _load_refused(rank, dp, ckpt, tag):
    from canzona_ds.ckpt import tag as ck

    engine = _engine(dp, 1, "CanzonaMuon")
    try:
        engine.load_checkpoint(ckpt, tag=tag)
    except ck.CheckpointError as e:
        return str(e)
    return None


def test_damaged_index_is_refused_by_name(saved, tmp_path):
    import shutil

    from canzona_ds.ckpt import tag as ck

    src = saved("dense", M, "z1 dp2")
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(src, ckpt)
    index = os.path.join(ckpt, "saved", ck.INDEX)
    with open(index, "r+b") as f:
        f.truncate(100)  # a damaged (cut) index
    # the manifest names it first ...
    with pytest.raises(ck.CheckpointError, match="canzona_index.json: size mismatch"):
        ck.verify(ckpt, "saved")
    # ... and with verification off the index's own check does
    msgs = run_distributed(_load_other_stage, 1, ckpt)
    assert "canzona_index.json: not valid JSON" in msgs[0] and "damaged" in msgs[0], msgs[0]


def _load_other_stage(rank, dp, ckpt):
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_ds.ckpt import CheckpointIndexError

    cfg = dense.config(Layout(3, dp), "CanzonaMuon")
    cfg["canzona_checkpoint"] = {"verify": "off"}
    model = make_model(0)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    try:
        engine.load_checkpoint(ckpt, tag="saved")
    except CheckpointIndexError as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------ canzona-ckpt
@pytest.mark.parametrize("spec", ["z1 dp2", "z3 dp2", "z0 dp2"])
def test_a_save_writes_the_index_and_no_layout_records(saved, spec):
    """The index is the one description of a tag: the ZeRO files carry no ``canzona_layout``
    record and the optimizer state no parameter-name lists (what canzona-ds wrote before the
    index)."""
    from canzona_ds.ckpt import tag as ck

    folder = os.path.join(saved("dense", SO if spec.startswith("z3") else M, spec), "saved")
    assert os.path.isfile(os.path.join(folder, ck.INDEX))
    checked = 0
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".pt"):
            continue
        sd = torch.load(os.path.join(folder, f), weights_only=False)
        opt = sd.get("optimizer_state_dict") or sd.get("optimizer")
        if not isinstance(opt, dict):
            continue
        assert "canzona_layout" not in opt, f
        canzona = (opt.get("base_optimizer_state") or opt.get("optimizer_state_dict") or opt).get("canzona")
        assert canzona is not None and not {"param_names", "global_names"} & set(canzona), (f, sorted(canzona))
        checked += 1
    assert checked >= 1


def test_canzona_ckpt_inspect_verify_convert(saved, tmp_path, capsys):
    from safetensors.torch import load_file

    from canzona_ds.ckpt import Index, Reader
    from canzona_ds.cli.ckpt import main

    ckpt = saved("dense", SO, "z3 dp2")
    assert main(["inspect", ckpt, "--tag", "saved"]) == 0
    text = capsys.readouterr().out
    assert "ZeRO stage 3, DP=2 TP=1 PP=1" in text and "rule 'soap' on 4 matrices" in text and "rank 1:" in text
    assert main(["verify", ckpt, "--tag", "saved"]) == 0
    assert "chunks agree with their files" in capsys.readouterr().out
    out = str(tmp_path / "conv")
    assert main(["convert", ckpt, out, "--tag", "saved"]) == 0
    folder = os.path.join(ckpt, "saved")
    index = Index.read(folder)
    reader = Reader(folder, index)
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(weights) == sorted(index.names)
    for n, w in weights.items():
        assert torch.equal(w, reader.whole(n)), n
    opt = torch.load(os.path.join(out, "optimizer.pt"), weights_only=False)
    assert opt["rule"] == "soap" and torch.equal(opt["state"]["fc1.weight"]["exp_avg"], reader.whole("fc1.weight", "exp_avg"))
    assert torch.equal(opt["state"]["embed.weight"]["exp_avg"], reader.whole("embed.weight", "exp_avg"))
    assert main(["inspect", ckpt, "--tag", "nope"]) == 2
    assert "nope does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------ memory
def _resume_counting(rank, dp, ckpt):
    """Load through the checkpoint index and count what this rank copied out of the files."""
    from canzona_ds.integration.ckpt import fill as ckpt_fill
    from canzona_ds.integration.ckpt import route as ckpt_index
    from canzona_ds.integration.runtime_info import canzona_optimizer

    engine = _engine(dp, 1, M)
    folder = os.path.join(ckpt, "saved")
    src = ckpt_fill.IndexSource(folder, ckpt_index.read_index(folder))
    opened = src.reader.elements_read
    ckpt_fill.fill_zero12(engine, src)
    zopt, opt = engine.optimizer, canzona_optimizer(engine)
    share = 0  # what this rank holds in the new layout: fp32 master, AdamW moments, rule state
    for i, group in enumerate(opt.param_groups):
        flat = zopt.single_partition_of_fp32_groups[i]
        if group["canzona_role"] == "matrix":
            share += sum(v.numel for v in opt.placement.views[id(flat)])
            continue
        lo, hi = rank * zopt.partition_size[i], (rank + 1) * zopt.partition_size[i]
        held = sum(max(0, min(off + p.numel(), hi) - max(off, lo))
                   for p, off in zip(zopt.round_robin_bit16_groups[i], zopt.round_robin_bit16_offsets[i]))
        share += 3 * held  # master, exp_avg, exp_avg_sq
    share += sum(v.numel() for st in opt.matrix_state.values() for v in st.values() if torch.is_tensor(v))
    return dict(opened=opened, read=src.reader.elements_read, share=share, params=params_of(engine.module))


def test_each_rank_reads_only_its_share(saved, tmp_path):
    """Resuming DP 2 -> 4 through the checkpoint index, a rank copies out of the checkpoint
    exactly the elements it holds in the new layout (its matrices, its AdamW range and moments,
    its matrices' rule state), none when the files are opened; the four shares together are the
    checkpoint (every chunk of its index), read once.  The weights every rank then holds are
    the ones ``python -m canzona_ds.cli.ckpt convert`` writes."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from canzona_ds.ckpt import Index

    ckpt = saved("dense", M, "z1 dp2")
    res = run_distributed(_resume_counting, 4, ckpt)
    total = sum(c.length for c in Index.read(os.path.join(ckpt, "saved")).chunks)  # every element, once
    for r in res:
        assert r["opened"] == 0
        assert r["read"] == r["share"] and 0 < r["read"] < total / 2, (r["read"], r["share"], total)
    assert sum(r["read"] for r in res) == total
    out = str(tmp_path / "conv")
    proc = subprocess.run([sys.executable, "-m", "canzona_ds.cli.ckpt", "convert", ckpt, out, "--tag", "saved"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "DP=2 TP=1" in proc.stdout, proc.stderr[-2000:]
    weights = load_file(os.path.join(out, "model.safetensors"))
    for r in res:
        for k, v in r["params"].items():
            np.testing.assert_array_equal(v, weights[k].numpy(), err_msg=k)


def _foreign(rank, dp, ckpt):
    cfg = ds_config(dp, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    import deepspeed

    import canzona_ds  # noqa: F401

    model = make_model(0)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    try:
        engine.load_checkpoint(ckpt, tag="saved")
    except ValueError as e:
        return str(e)
    return None


def test_canzona_checkpoint_opened_by_another_optimizer_is_refused(saved):
    ckpt = saved("dense", M, "z1 dp2")
    for msg in run_distributed(_foreign, 2, ckpt):
        assert msg is not None and "written by a Canzona optimizer" in msg and "canzona-ckpt convert" in msg, msg


def _foreign_save_canzona_load(rank, dp, ckpt, stage):
    """DeepSpeed's own AdamW saves; a Canzona engine at the same layout loads it."""
    import deepspeed

    import canzona_ds  # noqa: F401

    adamw = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    model = make_model(0)
    cfg = dense.config(Layout(stage, dp), M)
    cfg["optimizer"] = adamw
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    _train(engine, rank, 1, 1)
    engine.save_checkpoint(ckpt, tag="foreign")
    engine = _engine(dp, stage, M)
    try:
        engine.load_checkpoint(ckpt, tag="foreign")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("stage", [1, 3])
def test_another_optimizers_checkpoint_opened_by_canzona_is_refused(tmp_path, stage):
    """A checkpoint DeepSpeed's own AdamW wrote (no index, no Canzona state) loaded with a Canzona
    optimizer's state: refused by name on every rank, with the way out."""
    for msg in run_distributed(_foreign_save_canzona_load, 2, str(tmp_path / "ckpt"), stage):
        assert msg is not None and "not written by a Canzona optimizer" in msg and "load_module_only" in msg or \
            "load_optimizer_states=False" in msg, msg


# ------------------------------------------------------------------------------ tensor parallelism
# TP scenarios at ZeRO 1 through the index (TP shard frames, a TP host's state in its concatenated
# layout).  No gradient clipping here: under TP DeepSpeed reduces the norm over the model-parallel
# group (not canzona's torch-exact clip), as in tests/test_zero_tp.py and the moetp rows above.
def test_tp_checkpoint_holds_shard_frames_and_converts_at_tp1(saved, tmp_path):
    """The TP 2 x DP 1 Muon checkpoint (the first ``tp`` row's): the fused qkv ([q; k; v] per TP rank)
    is saved as TP shard frames, fc1's momentum ([gate; up], partition_stride 2) in its TP host's
    concatenated layout; canzona-ckpt convert writes the same TP=1 state (the host's momentum
    un-permuted)."""
    from safetensors.torch import load_file

    from canzona_ds.ckpt import Index
    from canzona_ds.cli.ckpt import main

    ckpt = saved("tp", M, "z1 tp2 dp1")
    folder = os.path.join(ckpt, "saved")
    index = Index.read(folder)
    assert index.meta["tp"] == 2 and index.chunks is not None
    assert {c.tp.rank for c in index.by_key()["qkv.weight", "param"]} == {0, 1}  # shard frames
    assert all(c.tp is not None and c.tp.rank is None for c in index.by_key()["fc1.weight", "momentum_buffer"])
    conv = str(tmp_path / "conv")
    assert main(["convert", ckpt, conv, "--tag", "saved"]) == 0
    tp1 = tp1_state(folder)
    weights = load_file(os.path.join(conv, "model.safetensors"))
    state = torch.load(os.path.join(conv, "optimizer.pt"), weights_only=False)["state"]
    assert sorted(weights) == sorted(index.names)
    for n in ("qkv.weight", "fc1.weight"):
        assert torch.equal(weights[n], tp1[n, "param"]) and torch.equal(state[n]["momentum_buffer"],
                                                                         tp1[n, "momentum_buffer"]), n


def test_tp_change_refuses_state_that_cannot_follow(saved):
    """Blocked Shampoo factors of a fused layout (blocks of 16 rows cut the fused qkv and fc1
    differently at TP 2 and TP 1) cannot be permuted into another TP size: refused by name, on
    every rank, without a hang."""
    from canzona_testkit.resume import tp

    ckpt = saved("tp", SH, "z1 tp2 dp1")
    for (msg,) in run_distributed(tp.try_loads, 2, "tp", [Layout.parse("z1 tp1 dp2")], SH, ckpt):
        assert msg is not None and "tensor-parallel size" in msg and ("'qkv.weight'" in msg or "'fc1.weight'" in msg), msg


def test_pre_index_tag_resumes_at_its_layout_and_refuses_another_by_name(saved, tmp_path):
    """A TP=2 tag as canzona-ds wrote it before the checkpoint index (its files with the layout
    records of then, no index, no manifest): at its saved layout DeepSpeed's stock load takes it
    (the layout records agree with this run's); at another layout it is refused by name on every
    rank, saying that it predates the index, the saved and running sizes, and how to continue."""
    from canzona_testkit.resume import tp

    ckpt = _pre_index(saved("tp", M, "z1 tp2 dp1", old=True), str(tmp_path / "old"))
    for same, msg in run_distributed(tp.try_loads, 2, "tp", [Layout.parse(s) for s in ("z1 tp2 dp1", "z1 tp1 dp2")],
                                     M, ckpt):
        assert same is None, same
        assert msg is not None and "has no canzona_index.json: a Canzona tag written before the checkpoint index" \
            in msg, msg
        assert "saved at ZeRO stage 1, DP=1, model-parallel size 2" in msg and "ZeRO stage 1, DP=2, TP=1" in msg, msg
        assert "resume it at the layout it was saved at" in msg and "save once" in msg, msg


def test_mixed_tp_checkpoint_with_other_grid_tp_hosts_resumes_exactly(tmp_path):
    """A mixed DP 2 x TP 2 Shampoo checkpoint whose grid hosts sit at other TP ranks (chosen
    without the owned TP runtime's load, as before the seed) resumes at the same layout spec
    through the index loop (another layout fingerprint; DeepSpeed's own load would leave the new
    hosts without their rule state), the hosts' state taken as saved, unpermuted (Shampoo's
    blocked factors of the fused layouts have no TP=1 frame; SOAP's grid host state is the
    ``tp`` row at the saved layout's): lossless, and the continued run is the reference bit for
    bit (canzona_testkit/resume/tp.py's checks)."""
    from canzona_testkit.resume import tp

    lay, opt_type = Layout.parse("z1 tp2 dp2 mixed"), SH
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    res = run_distributed(scheduled, lay.world, tp.save_unseeded_and_resume, "tp", lay, opt_type, ckpt, out)
    check_lrs(res, range(BEFORE + AFTER))  # (the saving engine's steps, then the resumed one's)
    assert all(r["route"] == ["index"] for r in res), [r["route"] for r in res]
    old, new = res[0]["saved_tp_hosts"], res[0]["tp_hosts"]
    assert old and old != new, (old, new)
    tp.check_state("tp", opt_type, lay, lay, ckpt, out, res)


