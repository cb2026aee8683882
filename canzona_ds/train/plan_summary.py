"""Per-rank optimizer load of a run: the partition plan summary printed at start.

Two layouts of the same model over ``dp`` ranks:

    equal_chunk  DeepSpeed's stock ZeRO-1 slicing: each param group (Muon half, Adam half)
                 flattened and cut into dp equal chunks, blind to tensor boundaries.  A
                 matrix cut by a boundary is orthogonalized in full on every rank it touches
                 (built-in Muon), with full-size momentum there.
    canzona      an OwnershipPlan: every matrix wholly on one rank, ranks padded to P.
                 Taken from the CanzonaMuon optimizer when it exposes one, else computed
                 here with ``plan_dp`` on the model's matrix specs (and labelled so).

Loads: Newton-Schulz FLOPs per step (``planning.cost.muon_flops``) and optimizer-memory
bytes (fp32 master + fp32 grad partition + momentum for matrices; + two Adam moments for
the element-wise parameters, which both layouts cut into equal chunks).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from canzona_ds.planning.cost import muon_flops
from canzona_ds.planning.dp import OwnershipPlan, plan_dp
from canzona_ds.planning.params import ParamSpec, specs_from_module

MATRIX_BYTES_PER_ELEM = 12  # fp32 master, fp32 grad, fp32 momentum
AUX_BYTES_PER_ELEM = 16     # fp32 master, fp32 grad, exp_avg, exp_avg_sq


@dataclass
class LayoutLoad:
    name: str
    rank_flops: list[float]
    rank_memory_bytes: list[float]
    rank_numel: list[int]
    padding_fraction: float = 0.0
    note: str = ""

    @property
    def imbalance(self) -> float:
        """max / mean of the FLOPs (1.0 = perfect balance)."""
        mean = sum(self.rank_flops) / len(self.rank_flops)
        return max(self.rank_flops) / mean if mean else 1.0


@dataclass
class PlanSummary:
    world_size: int
    plan_source: str
    layouts: list[LayoutLoad] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "plan_source": self.plan_source,
                "layouts": [asdict(lay) | {"imbalance": lay.imbalance} for lay in self.layouts]}


def _chunks(total: int, dp: int) -> list[tuple[int, int]]:
    size = -(-total // dp)
    return [(min(r * size, total), min((r + 1) * size, total)) for r in range(dp)]


def equal_chunk_load(specs: list[ParamSpec], dp: int) -> LayoutLoad:
    flops, mem, numel = [0.0] * dp, [0.0] * dp, [0] * dp
    for role, per_elem in (("matrix", MATRIX_BYTES_PER_ELEM), ("aux", AUX_BYTES_PER_ELEM)):
        group = [s for s in specs if s.role == role]
        total = sum(s.numel for s in group)
        for r, (lo, hi) in enumerate(_chunks(total, dp)):
            numel[r] += hi - lo
            mem[r] += (hi - lo) * per_elem
            off = 0
            for s in group:
                a, b = off, off + s.numel
                off = b
                if role == "matrix" and a < hi and b > lo:  # touches this rank's chunk
                    flops[r] += muon_flops(s.matrix_shape)
                    mem[r] += (s.numel - (min(b, hi) - max(a, lo))) * 4  # full-size momentum
    return LayoutLoad("equal_chunk (DeepSpeed stock ZeRO-1)", flops, mem, numel,
                      note="straddling matrices orthogonalized on every rank they touch")


def plan_load(plan: OwnershipPlan, aux_specs: list[ParamSpec]) -> LayoutLoad:
    dp = plan.world_size
    flops = [sum(muon_flops(plan.specs[i].matrix_shape) for i in plan.rank_params[r]) for r in range(dp)]
    aux_total = sum(s.numel for s in aux_specs)
    aux = [hi - lo for lo, hi in _chunks(aux_total, dp)]
    mem = [plan.shard_numel * MATRIX_BYTES_PER_ELEM + aux[r] * AUX_BYTES_PER_ELEM for r in range(dp)]
    numel = [plan.rank_numel[r] + aux[r] for r in range(dp)]
    return LayoutLoad(f"canzona ({plan.planner}, cost={plan.cost_model})", flops, mem, numel,
                      padding_fraction=plan.padding_fraction)


def find_plans(optimizer) -> list[OwnershipPlan]:
    """OwnershipPlans an optimizer object holds (duck-typed: any attribute that is one,
    or a list/tuple/dict of them), searched one level into a wrapped ``.optimizer``."""
    found: list[OwnershipPlan] = []
    for obj in (optimizer, getattr(optimizer, "optimizer", None)):
        if obj is None:
            continue
        for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            found.extend(v for v in items if isinstance(v, OwnershipPlan))
        if found:
            break
    return found


def summarize(model, world_size: int, optimizer=None) -> PlanSummary:
    specs = specs_from_module(model)
    matrices = [s for s in specs if s.is_matrix]
    aux = [s for s in specs if not s.is_matrix]
    plans = find_plans(optimizer) if optimizer is not None else []
    if plans:
        plan = max(plans, key=lambda p: p.total_numel)
        source = f"plan exposed by {type(optimizer).__name__}"
    else:
        plan = plan_dp(matrices, world_size, cost="flops")
        source = "computed with planning.plan_dp(cost='flops'); the optimizer exposes no plan"
    return PlanSummary(world_size, source, [equal_chunk_load(specs, world_size), plan_load(plan, aux)])


def format_plan(plan: dict) -> list[str]:
    """Text lines of a ``PlanSummary.to_dict()``."""
    out = [f"partition plan over dp={plan['world_size']} ranks ({plan['plan_source']})"]
    for lay in plan["layouts"]:
        out.append(f"  {lay['name']}: NS FLOPs max/mean={lay['imbalance']:.3f}, "
                   f"padding={100 * lay['padding_fraction']:.2f}%" + (f" [{lay['note']}]" if lay["note"] else ""))
        for r in range(plan["world_size"]):
            out.append(f"    rank {r}: NS GFLOP/step={lay['rank_flops'][r] / 1e9:.4f}  "
                       f"opt-mem={lay['rank_memory_bytes'][r] / 2**20:.3f} MiB  elems={lay['rank_numel'][r]}")
    return out
