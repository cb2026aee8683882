"""ZeRO stage 0 in fp32: a step whose gradient is non-finite on any rank is skipped and counted,
as DeepSpeed's ZeRO 1-3 do (canzona_ds/integration/stage0.py), for the Canzona types and for
DeepSpeed's own AdamW alike.  Before, the NaN went into the weights and the optimizer state.

Two gloo ranks; rank 0 alone sees a NaN loss at the second of four steps.  The run must end
bit for bit where a run over the other three batches ends (weights; and so the optimizer
state and step counts, which shape every later update), with ``skipped_steps == 1``.  Finite
steps are untouched: the same code path, compared exactly.
"""
from __future__ import annotations

from canzona_testkit.kernels import assert_bits, test_threads
import pytest
import torch

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import batches, ds_config, make_model, params_of

pytestmark = pytest.mark.dist
DP, MICRO = 2, 2


def _train(rank: int, world: int, optimizer: str, data: list, nan_at: int | None):
    import canzona_ds  # noqa: F401 - registers the Canzona types (and the stage-0 check)
    import deepspeed

    torch.set_num_threads(test_threads())
    model = make_model(0)
    section = {"type": "AdamW", "params": {"lr": 0.01}} if optimizer == "AdamW" else optimizer
    cfg = ds_config(DP, MICRO, optimizer=section, stage=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for i, (x, y) in enumerate(data):
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(x, y)
        if i == nan_at and rank == 0:
            loss = loss * float("nan")  # this rank's gradient only; stage 0 all-reduces it to every rank
        engine.backward(loss)
        engine.step()
    return params_of(engine.module), engine.skipped_steps, engine.global_steps


@pytest.mark.parametrize("optimizer", ["CanzonaMuon", "AdamW"])
def test_nonfinite_step_is_skipped_at_stage_0(optimizer):
    data = batches(4, MICRO * DP)
    skipped = run_distributed(_train, DP, optimizer, data, 1)
    without = run_distributed(_train, DP, optimizer, [data[0], *data[2:]], None)
    for rank in range(DP):
        params, n_skipped, steps = skipped[rank]
        ref, ref_skipped, _ = without[rank]
        assert (n_skipped, steps, ref_skipped) == (1, 4, 0)
        for name in ref:
            assert_bits(params[name], ref[name], (optimizer, rank, name))
