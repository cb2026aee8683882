"""Per-rank optimizer load of a run: the partition plan summary printed at start.

Two layouts of the same model over ``dp`` ranks, costed with the run's matrix rule (its
FLOPs and state bytes; Muon's for DeepSpeed's own Muon and AdamW runs):

    equal_chunk  DeepSpeed's stock ZeRO slicing: each param group cut into dp equal chunks,
                 blind to tensor boundaries (``planning.dp.plan_equal_chunk``).  A matrix
                 cut by a boundary is updated in full on every rank it touches (DeepSpeed's
                 Muon), with full-size optimizer state there.
    canzona      the optimizer's OwnershipPlan and the layout ZeRO realised (padding from
                 ``planning/layout.py``), or, for runs without a Canzona optimizer, the plan
                 ``plan_dp`` would make (labelled so).

Memory per rank: fp32 master + fp32 gradient of the rank's range (padding included for
the planned layout) + optimizer state, plus the AdamW half's equal chunk.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from canzona_ds.planning.cost import AUX_BYTES_PER_ELEMENT, MASTER_GRAD_BYTES, cost_vector, task_cost
from canzona_ds.planning.dp import plan_dp, plan_equal_chunk
from canzona_ds.planning.params import specs_from_module
from canzona_ds.planning.report import rank_costs


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
    rule: str
    layouts: list[LayoutLoad] = field(default_factory=list)
    #: names of the parameters planned as matrices (the module's own names)
    matrices: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "plan_source": self.plan_source, "rule": self.rule,
                "matrices": list(self.matrices),
                "layouts": [asdict(lay) | {"imbalance": lay.imbalance} for lay in self.layouts]}


def _aux_chunks(aux_numel: int, dp: int) -> list[int]:
    size = -(-aux_numel // dp)
    return [max(0, min(aux_numel, (r + 1) * size) - min(aux_numel, r * size)) for r in range(dp)]


def summarize(model, world_size: int, optimizer=None, layout=None) -> PlanSummary:
    """``optimizer``: the run's CanzonaOptimizer (None for other optimizers); ``layout``: the
    planned-padding Layout ZeRO realised (None: the plan's default layout)."""
    from canzona_ds.optim import cost_model

    model_cost = optimizer.rule if optimizer is not None else cost_model("muon")
    kw = {}
    if optimizer is not None:
        kw = dict(include=optimizer.config.placement.matrix_include, exclude=optimizer.config.placement.matrix_exclude)
    specs = specs_from_module(model, **kw)
    matrices = [s for s in specs if s.is_matrix]
    aux = _aux_chunks(sum(s.numel for s in specs if not s.is_matrix), world_size)
    out = PlanSummary(world_size, "", model_cost.name, matrices=[s.name for s in matrices])
    if not matrices:
        out.plan_source = "no matrices: every parameter uses AdamW"
        return out
    stock = plan_equal_chunk(matrices, world_size, cost_vector(matrices, "flops", model_cost), "flops")
    out.layouts.append(LayoutLoad(
        "equal_chunk (DeepSpeed stock ZeRO)", rank_costs(stock, "flops", model_cost),
        [m + a * AUX_BYTES_PER_ELEMENT for m, a in zip(rank_costs(stock, "memory", model_cost), aux)],
        [n + a for n, a in zip(stock.rank_numel, aux)], stock.padding_fraction,
        note="straddling matrices updated on every rank they touch"))
    runtime = getattr(optimizer, "tp_runtime", None)
    if optimizer is not None and optimizer.placement.kind == "sharded" and runtime is not None:
        out.plan_source = (f"hosts of the run's optimizer (ZeRO-3: every matrix in pieces over dp, the rule on its "
                           f"host; {type(optimizer).__name__}, rule {model_cost.name})")
        out.layouts.append(_sharded_layout(matrices, runtime.plan, world_size, model_cost, aux))
        return out
    plan = getattr(optimizer, "plan", None)
    if plan is not None:
        out.plan_source = f"plan of the run's optimizer ({type(optimizer).__name__}, rule {model_cost.name})"
    else:
        plan = plan_dp(matrices, world_size, cost="flops", model=model_cost)
        out.plan_source = "computed with planning.plan_dp(cost='flops'); the run's optimizer has no plan"
    layout = layout if layout is not None else plan.nonempty_first().layout()
    flops = rank_costs(plan, "flops", model_cost)
    state = [sum(task_cost(plan.specs[i], "memory", model_cost) - plan.specs[i].numel * MASTER_GRAD_BYTES
                 for i in plan.rank_params[r]) for r in range(world_size)]
    memory = [layout.shard_numel * MASTER_GRAD_BYTES + state[r] + aux[r] * AUX_BYTES_PER_ELEMENT
              for r in range(world_size)]
    numel = [plan.rank_numel[r] + aux[r] for r in range(world_size)]
    out.layouts.append(LayoutLoad(f"canzona ({plan.planner}, cost={plan.cost_model})", flops, memory, numel,
                                  padding_fraction=layout.padding_fraction))
    return out


def _sharded_layout(matrices, hosts, world_size: int, model_cost, aux: list[int]) -> LayoutLoad:
    """ZeRO-3: every rank holds 1/dp of every matrix (master + gradient), a host the whole-matrix
    rule work and rule state of the matrices it hosts (``hosts``: the micro-group plan)."""
    host = {s.name: h for s, h in zip(hosts.specs, hosts.host)}
    flops = [0.0] * world_size
    state = [0.0] * world_size
    for m in matrices:
        h = host[m.name]
        flops[h] += task_cost(m, "flops", model_cost)
        state[h] += task_cost(m, "memory", model_cost) - m.numel * MASTER_GRAD_BYTES
    piece = [sum(-(-m.numel // world_size) for m in matrices)] * world_size
    memory = [piece[r] * MASTER_GRAD_BYTES + state[r] + aux[r] * AUX_BYTES_PER_ELEMENT for r in range(world_size)]
    padding = sum(-(-m.numel // world_size) * world_size - m.numel for m in matrices) / max(
        1, sum(-(-m.numel // world_size) * world_size for m in matrices))
    return LayoutLoad(f"canzona zero3 ({hosts.scheduler}, cost={hosts.cost_model}, {len(hosts.groups)} micro-groups)",
                      flops, memory, [piece[r] + aux[r] for r in range(world_size)], padding_fraction=padding)


def format_plan(plan: dict) -> list[str]:
    """Text lines of a ``PlanSummary.to_dict()``, or of the main job's per-stage summary under
    pipeline parallelism (``{"pipeline_stages", "stages": [stage's to_dict() + stage, ranks]}``)."""
    if "stages" in plan:
        out = [f"pipeline of {plan['pipeline_stages']} stages: each stage plans its own matrices over its "
               f"dp={plan['world_size']} ranks, rule {plan['rule']} ({plan['plan_source']})"]
        for st in plan["stages"]:
            out.append(f"stage {st['stage']} (global ranks {st['ranks']}): {len(st.get('matrices', []))} matrices: "
                       f"{compact_names(st.get('matrices', []))}")
            out += ["  " + line for line in _layout_lines(st)]
        return out
    out = [f"partition plan over dp={plan['world_size']} ranks, rule {plan['rule']} ({plan['plan_source']})"]
    return out + _layout_lines(plan)


def _layout_lines(plan: dict) -> list[str]:
    out = []
    for lay in plan["layouts"]:
        flops = lay["rank_flops"]
        busiest = max(range(len(flops)), key=flops.__getitem__) if flops else 0
        out.append(f"  {lay['name']}: FLOPs max/mean={lay['imbalance']:.3f}, busiest rank {busiest}, "
                   f"padding={100 * lay['padding_fraction']:.2f}%" + (f" [{lay['note']}]" if lay["note"] else ""))
        for r in range(plan["world_size"]):
            out.append(f"    rank {r}: GFLOP/step={lay['rank_flops'][r] / 1e9:.4f}  "
                       f"opt-mem={lay['rank_memory_bytes'][r] / 2**20:.3f} MiB  elems={lay['rank_numel'][r]}")
    return out


def compact_names(names: list[str]) -> str:
    """``model.layers.3.mlp.up_proj.weight``, ... -> ``model.layers.3.* (7)``; other names as they are."""
    import re

    out: list[str] = []
    counts: dict[str, int] = {}
    for n in names:
        m = re.match(r"(.*\blayers\.\d+)\.", n)
        key = f"{m.group(1)}.*" if m else n
        if key not in counts:
            out.append(key)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(k if counts[k] == 1 and not k.endswith(".*") else f"{k} ({counts[k]})" for k in out)
