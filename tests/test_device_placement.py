"""Device-correct by construction, checked without a GPU.

Every buffer the optimizer, the rules and the TP runtime allocate must come from the device
of the tensors they serve (``zeros_like``, ``device=param.device``), never from the default
device: on a GPU a CPU-allocated receive buffer would be handed to NCCL.  These tests run
the step with the *default* device set to ``meta`` (``with torch.device("meta")``): any
factory call that relies on the default device creates a meta tensor, which either raises
in the first real op (a CPU tensor cannot mix with a meta one; gloo cannot send meta data) or
leaks a meta result.  The results must be bit-identical to a normal run.  (The old TP
runtime, whose receive buffers were ``torch.empty(n, dtype=...)``, fails this test.)

Cost: 6 rank runs; 3 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import numpy as np
import pytest
import torch

from canzona_ds.config import CanzonaConfig
from canzona_ds.optimizer import CanzonaOptimizer
from canzona_testkit.dist import device_params, rank_device, run_distributed
from canzona_testkit.models import HP, TYPES, batches, make_model

SHAPES = {"col": ((12, 6), 0), "row": ((6, 10), 1)}


def _train(opt_type: str, meta_default: bool) -> dict:
    torch.set_num_threads(test_threads())
    model = make_model(0)
    opt = CanzonaOptimizer(model.named_parameters(), CanzonaConfig.from_ds(opt_type, HP[opt_type]))
    for x, y in batches(4, 4):
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        if meta_default:
            with torch.device("meta"):
                opt.step()
        else:
            opt.step()
    for st in opt.matrix_state.values():
        for v in st.values():
            assert not isinstance(v, torch.Tensor) or v.device.type == "cpu"
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("opt_type", TYPES)
def test_optimizer_step_allocates_on_the_parameters_device(opt_type):
    normal, guarded = _train(opt_type, False), _train(opt_type, True)
    for n in normal:
        np.testing.assert_array_equal(guarded[n], normal[n], err_msg=n)


def _tp_worker(rank, tp, opt_type, meta_default, device="cpu"):
    import torch.distributed as dist

    from canzona_ds.optim import rule_class
    from canzona_ds.config import TPConfig
    from canzona_ds.tp.runtime import MicroGroupRuntime, TPMatrix

    rule = CanzonaConfig.from_ds(opt_type, HP[opt_type]).rule
    assert isinstance(rule, rule_class(rule.name))
    mats = [TPMatrix(n, shape, dim, (shape[dim] // tp,) * tp) for n, (shape, dim) in SHAPES.items()]
    dev = rank_device(device, rank)
    for pipelined in (True, False):
        runtime = MicroGroupRuntime(mats, rule, None, TPConfig(pipelined=pipelined, c_max=1.0 * 72))
        g = torch.Generator().manual_seed(0)
        full = {n: torch.randn(shape, generator=g) for n, (shape, _) in SHAPES.items()}
        params = [full[m.name].chunk(tp, dim=m.partition_dim)[rank].clone().to(dev) for m in mats]
        for step in range(1, 4):
            grads = [torch.randn(m.full_shape, generator=g).chunk(tp, dim=m.partition_dim)[rank].to(dev) for m in mats]
            if meta_default:
                with torch.device("meta"):
                    runtime.step(params, grads, lr=0.05, weight_decay=0.1, step=step)
            else:
                runtime.step(params, grads, lr=0.05, weight_decay=0.1, step=step)
        assert all(p.device == dev for p in params)
        assert all(t.device == dev for st in runtime.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    dist.barrier()
    return {m.name: p.cpu().numpy() for m, p in zip(mats, params)}


@pytest.mark.parametrize("device", device_params(2))
@pytest.mark.parametrize("opt_type", TYPES)
def test_tp_runtime_allocates_on_the_gradients_device(opt_type, device):
    normal = run_distributed(_tp_worker, 2, opt_type, False, device, device=device)
    guarded = run_distributed(_tp_worker, 2, opt_type, True, device, device=device)
    for a, b in zip(normal, guarded):
        for n in a:
            np.testing.assert_array_equal(b[n], a[n], err_msg=n)


#: implicit device-to-host syncs: ``.item()`` / ``.cpu()`` / ``.tolist()``, and ``bool``/``int``/
#: ``float`` of a tensor expression: of a ``torch.*`` call (not ``torch.Size``), of a parenthesised
#: comparison, or of a reduction method (``.sum()``, ``.max()``, ``.all()``, ...)
HOST_SYNC = (r"\.(item|cpu|tolist)\(\)"
             r"|\b(?:bool|int|float)\((?:torch\.(?!Size\b)\w+\(|\([^()]*[<>]=?[^()]*\)"
             r"|[\w.\[\]]+\.(?:sum|max|min|all|any|amax|amin|norm|mean|prod)\(\))")


def test_host_sync_pattern_catches_implicit_syncs():
    import re

    sync = re.compile(HOST_SYNC)
    for line in ("n = int((s > tau).sum())", "if bool(torch.isneginf(s).all()):", "m = float(flat.max())",
                 "x = float(t.norm())", "k = int(torch.count_nonzero(mask))", "v = s.tolist()", "f = t.item()"):
        assert sync.search(line), line
    for line in ("off += int(torch.Size(shape).numel())", "bf16 = bool((ds.get('bf16') or {}).get('enabled'))",
                 "n = int(stage)", "t = float(threshold)"):
        assert not sync.search(line), line


def test_step_code_has_no_host_round_trip():
    """docs/zero.md promises no ``.item()`` / ``.cpu()`` / ``.tolist()`` (nor ``bool``/``int``/
    ``float`` of a tensor, the same sync written implicitly) in the step's packages: each one is a
    device-to-host sync on a GPU (the CPU suite cannot see the stall)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "canzona_ds"
    sync = re.compile(HOST_SYNC)
    step_code = [root / "optimizer.py"] + [path for pkg in ("optim", "placement", "tp", "integration")
                                           for path in sorted((root / pkg).rglob("*.py"))]
    found = [f"{path.relative_to(root)}:{i}: {line.strip()}"
             for path in step_code for i, line in enumerate(path.read_text().splitlines(), 1) if sync.search(line)]
    # the two syncs a step cannot do without, once per step each: a skip decision (as DeepSpeed's own
    # overflow check at stages 1-3) and MuonClip's reduced maxima (which heads clip, what the step
    # logs), copied to the host once
    allowed = {"integration/stage0.py: return bool(flag.item())",
               "optim/qk_clip.py: host = flat.cpu().numpy()",
               # (at construction, once: whether any pipeline stage found an attention layer)
               "optimizer.py: found = int(count.item())",
               # (at a save, once per param group: a tensor lr written into the index as a number)
               "integration/ckpt/param_groups.py: return float(value.item()) if value.numel() == 1 else None"}
    found = [f for f in found if re.sub(r":\d+:", ":", f, count=1) not in allowed]
    assert not found, "host round trips in the step's code:\n" + "\n".join(found)
