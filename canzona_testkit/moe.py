"""A tiny DeepSpeed MoE model (``deepspeed.moe.layer.MoE``) and its single-process reference.

``TinyMoE``: embedding, a dense matrix (``proj`` + bias), LayerNorm, one MoE layer (top-1 gate
``wg`` [E, D], E experts ``Linear(D, H) -> GELU -> Linear(H, D)`` with biases) and an lm_head;
loss = cross entropy + ``AUX_COEF`` x the gate's load-balancing loss.  Routing is
deterministic: no random token selection, no noise, and a capacity factor of E (capacity =
every token of a rank), so no token is dropped.  Every parameter is initialised from its
*whole-model* name (experts numbered globally), so a model at any ep_size holds the same
weights.

:func:`reference_run` computes, in one process, exactly what the distributed run computes::

    per rank s:   dense copy s -> gate -> dispatched_s [E, C, D]       (DeepSpeed's own gating,
                                                                         slots, encode, decode)
    per expert-parallel group G (ranks r0 < r1 < ... holding different experts):
        expert-parallel rank k's input = cat(dispatched_s[k*L:(k+1)*L] for s in G)
                                         -> [ep, L, C, D] -> chunk per local expert  (= all_to_all)
        its experts run on G's own copy of the expert weights; the outputs go back the same way
    backward of sum_s loss_s once: dense copy s gets rank s's gradient, expert copy G what
    G's holders get (one GEMM over all of G's tokens, as on the ranks)
    ZeRO's average: dense = sum_s g_s / dp (rank order), expert e = sum_G g_G / dp (expert-DP
    order); optionally torch's clip_grad_norm_ over the whole model; ReferenceOptimizer

Bit-identical to the ranks wherever the sums have two terms (dp <= 2, or an expert-DP group of
2); a 4-rank dense sum is associated in gloo's own order.
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .models import HP, VOCAB, batches

D, H, NUM_EXPERTS = 16, 24, 4
AUX_COEF = 0.01
MOE = "moe.deepspeed_moe."
EXPERTS = MOE + "experts.deepspeed_experts."
EXPERT_PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")
#: the optional second MoE layer (``TinyMoE(ep2=...)``: its own ep_size, hence its own expert groups)
MOE2 = "moe2.deepspeed_moe."
EXPERTS2 = MOE2 + "experts.deepspeed_experts."


def _init(name: str, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    scale = 0.02 if name.endswith("bias") or name.endswith("norm.bias") else (1.0 / shape[-1]) ** 0.5
    return torch.randn(shape, generator=g) * scale


class TinyMoE(nn.Module):
    """``ep2``: a second MoE layer (``moe2``, after the first, the same shape) with its own
    ``ep_size`` (DeepSpeed gives it its own expert groups; ``ep2_rank``: this rank's place in them);
    the loss adds its load-balancing loss to the first one's."""

    def __init__(self, ep_size: int, ep_rank: int, num_experts: int = NUM_EXPERTS, seed: int = 0,
                 ep2: int | None = None, ep2_rank: int = 0) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.proj = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        expert = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
        self.moe = MoE(hidden_size=D, expert=expert, num_experts=num_experts, ep_size=ep_size, k=1,
                       capacity_factor=float(num_experts), eval_capacity_factor=float(num_experts), min_capacity=0,
                       drop_tokens=True, use_rts=False)
        self.moe2 = None if ep2 is None else MoE(
            hidden_size=D, expert=expert, num_experts=num_experts, ep_size=ep2, k=1,
            capacity_factor=float(num_experts), eval_capacity_factor=float(num_experts), min_capacity=0,
            drop_tokens=True, use_rts=False)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        local = num_experts // ep_size
        local2 = num_experts // ep2 if ep2 is not None else 1
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.copy_(_init(global_name(n, ep_rank, local, ep2_rank, local2), tuple(p.shape), seed))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.proj(self.norm(h))
        out, l_aux, _ = self.moe(h)
        h = h + out
        if self.moe2 is not None:
            out2, l_aux2, _ = self.moe2(h)
            h = h + out2
            l_aux = l_aux + l_aux2
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), y.flatten()) + AUX_COEF * l_aux


def global_name(name: str, ep_rank: int, local: int, ep2_rank: int = 0, local2: int = 1) -> str:
    """A rank's parameter name in the whole model (local expert j on expert-parallel rank k is
    global expert k * local + j; ``ep2_rank``/``local2``: the same for the second MoE layer)."""
    for prefix, k, n in ((EXPERTS, ep_rank, local), (EXPERTS2, ep2_rank, local2)):
        if name.startswith(prefix):
            j, rest = name[len(prefix):].split(".", 1)
            return f"{prefix}{k * n + int(j)}.{rest}"
    return name


def whole_names(num_experts: int = NUM_EXPERTS, two: bool = False) -> list[str]:
    """The whole model's parameter names, in its order (every expert; ``two``: both MoE layers)."""
    dense_before = ["embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias", MOE + "gate.wg.weight"]
    experts = [f"{EXPERTS}{e}.{s}" for e in range(num_experts) for s in EXPERT_PARAMS]
    if two:
        experts += [MOE2 + "gate.wg.weight"] + [f"{EXPERTS2}{e}.{s}" for e in range(num_experts)
                                                 for s in EXPERT_PARAMS]
    return dense_before + experts + ["lm_head.weight"]


def ep_layout(world: int, ep_size: int, before: bool = False) -> list[list[int]]:
    """DeepSpeed's expert-parallel groups (DeepSpeed 0.19.8 ``_create_expert_and_data_parallel``,
    no pipeline, no TP), each in its group-rank order; the expert-DP groups are the same position
    across them.  Default (E + D): consecutive ranks, ``{0,1} {2,3}`` at world 4, ep_size 2 (expert-DP
    ``{0,2} {1,3}``).  ``before`` (ds_config ``use_data_before_expert_parallelism: true``, D + E):
    strided by ``world // ep_size``, ``{0,2} {1,3}`` (expert-DP ``{0,1} {2,3}``: consecutive ranks
    hold the same experts)."""
    if before:
        stride = world // ep_size
        return [list(range(i, world, stride)) for i in range(stride)]
    return [list(range(g, g + ep_size)) for g in range(0, world, ep_size)]


def ep_rank_of(rank: int, world: int, ep_size: int, before: bool = False) -> int:
    """This rank's expert-parallel rank in :func:`ep_layout` (which experts it holds)."""
    return rank // (world // ep_size) if before else rank % ep_size


def data_before(cfg: dict) -> bool:
    """The ds_config's ``use_data_before_expert_parallelism`` (DeepSpeed's key, default false)."""
    return bool(cfg.get("use_data_before_expert_parallelism", False))


def moe_ds_config(dp: int, optimizer: str = "CanzonaMuon", stage: int = 1, micro: int = 2, **extra) -> dict:
    from .models import ds_config

    return ds_config(dp, micro=micro, optimizer=optimizer, stage=stage, **extra)


def top1_route(flat: torch.Tensor, logits: torch.Tensor, num_experts: int):
    """DeepSpeed's top-1 routing of ``flat`` (tokens x D) as the installed ``MOELayer.forward``
    does it: ``(l_aux, dispatched (E, C, D), combine)``, ``combine(expert_out (E, C, D))`` the
    tokens' output.  Releases with sparse routes (``_route_slots``) encode and decode by slot;
    older ones (0.19.0 and before) dispatch and combine with the dense masks' einsum."""
    from deepspeed.moe import sharded_moe as sm

    D = flat.shape[-1]
    if hasattr(sm, "_route_slots"):
        l_aux, C, E, indices, locations, gates, _ = sm.top1gating(
            logits, float(num_experts), 0, None, None, True, False, None, sparse_routes=True, use_tutel=False)
        C = int(C)
        slots = sm._route_slots(indices, locations, E, C)
        return l_aux, sm._sparse_encode(flat, slots, E, C), \
            lambda out: sm._sparse_decode(out.reshape(E * C, D), slots, gates, flat.shape[0])
    l_aux, combine_weights, dispatch_mask, _ = sm.top1gating(logits, float(num_experts), 0, None, None, True, False,
                                                             None, use_tutel=False)
    return l_aux, sm.einsum("sec,sm->ecm", dispatch_mask.type_as(flat), flat), \
        lambda out: sm.einsum("sec,ecm->sm", combine_weights.type_as(flat), out)


def reference_run(world: int, ep_size: int, steps: int, optimizer: str = "CanzonaMuon", micro: int = 2,
                  clip: float = 0.0, seed: int = 0, params: dict | None = None, num_experts: int = NUM_EXPERTS,
                  data: list | None = None, start=None, tp_mlp: bool = False, ep2: int | None = None,
                  before: bool = False, schedule: bool = False) -> dict:
    """The whole model's parameters after ``steps`` (module docstring); call inside a worker.

    ``tp_mlp``: the model of :class:`TinyMoETP` at TP=1 (its ``up``/``down`` MLP whole, before the
    MoE layer; at TP=1 the ranks compute exactly this).  ``ep2``: :class:`TinyMoE`'s second MoE
    layer with that ep_size (its own expert-parallel groups, the same arithmetic).  ``before``:
    DeepSpeed's ``use_data_before_expert_parallelism`` layout of the expert groups (:func:`ep_layout`).
    ``schedule``: the resume scenarios' lr schedule (canzona_testkit/schedule.py) on the groups.

    ``start``: continue from a checkpoint's state instead of the initial weights (an
    ``canzona_testkit.ckpt.read``, every parameter and its state by whole-model name: the
    fp32 master weights, the rule state and step of every matrix, AdamW's moments and step)."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer

    torch.set_num_threads(test_threads())
    cfg = CanzonaConfig.from_ds(optimizer, dict(HP[optimizer] if params is None else params))
    names = whole_names(num_experts, two=ep2 is not None) + (list(TP_SPLIT) if tp_mlp else [])
    shapes = _shapes(num_experts)
    shapes.update({n: shape for n, (shape, _) in TP_SPLIT.items()})
    shapes.update({n.replace(MOE, MOE2, 1): v for n, v in shapes.items() if n.startswith(MOE)})
    master = {n: nn.Parameter(_init(n, shapes[n], seed)) for n in names}
    opt = ReferenceOptimizer([(n, master[n]) for n in names], cfg)
    if start is not None:
        _start_from(opt, master, start)
    #: each MoE layer: (its gate, its experts' name prefix, its ep_size, its expert-parallel groups)
    layers = [(MOE, EXPERTS, ep_size, ep_layout(world, ep_size, before))]
    if ep2 is not None:
        layers.append((MOE2, EXPERTS2, ep2, ep_layout(world, ep2, before)))
    data = data if data is not None else batches(steps, micro * world)
    dense_names = [n for n in names if not n.startswith((EXPERTS, EXPERTS2))]

    def moe_layer(hs: dict, dense: list, layer: tuple, experts: list) -> tuple[dict, dict]:
        """Every rank's MoE output added to its input, and its load-balancing loss."""
        gate, prefix, ep, ep_groups = layer
        local = num_experts // ep
        routed = {}
        for s in range(world):
            h = hs[s]
            flat = h.reshape(-1, D)
            # TopKGate.forward's arithmetic with this rank's gate weight
            logits = F.linear(flat.float(), weight=dense[s][gate + "gate.wg.weight"].float(), bias=None)
            routed[s] = (h, *top1_route(flat, logits, num_experts))  # (h, l_aux, dispatched, combine)
        back: dict[int, list] = {s: [None] * ep for s in range(world)}
        for g, G in enumerate(ep_groups):
            X = experts[g]
            for k, holder in enumerate(G):  # expert-parallel rank k of group G
                received = torch.cat([routed[s][2][k * local:(k + 1) * local] for s in G])  # all_to_all
                received = received.reshape(ep, local, -1, D)
                outs = []
                for j, chunk in enumerate(received.chunk(local, dim=1)):
                    e = k * local + j
                    w = [X[f"{prefix}{e}.{p}"] for p in EXPERT_PARAMS]
                    outs.append(F.linear(F.gelu(F.linear(chunk, w[0], w[1])), w[2], w[3]))
                out = torch.cat(outs, dim=1).reshape(ep * local, -1, D)
                for i, s in enumerate(G):  # the second all_to_all: back to the source ranks
                    back[s][k] = out[i * local:(i + 1) * local]
        out_h, aux = {}, {}
        for s in range(world):
            h, l_aux, _, combine = routed[s]
            combined = combine(torch.cat(back[s]))  # expert outputs (E, C, D), back at their source
            out_h[s], aux[s] = h + combined.reshape(h.shape), l_aux
        return out_h, aux

    for x_all, y_all in data[:steps]:
        dense = [{n: master[n].detach().clone().requires_grad_(True) for n in dense_names} for _ in range(world)]
        # each layer: one copy of its experts per expert-parallel group
        copies = [[{n: master[n].detach().clone().requires_grad_(True) for n in names if n.startswith(prefix)}
                   for _ in groups] for _, prefix, _, groups in layers]
        total = None
        hs, ys = {}, {}
        for s in range(world):
            P = dense[s]
            x, ys[s] = x_all[s * micro:(s + 1) * micro], y_all[s * micro:(s + 1) * micro]
            h = F.embedding(x, P["embed.weight"])
            h = h + F.linear(F.layer_norm(h, (D,), P["norm.weight"], P["norm.bias"]), P["proj.weight"], P["proj.bias"])
            if tp_mlp:
                h = h + F.linear(F.gelu(F.linear(h, P["up.weight"])), P["down.weight"])
            hs[s] = h
        aux = None
        for layer, experts in zip(layers, copies):
            hs, layer_aux = moe_layer(hs, dense, layer, experts)
            aux = layer_aux if aux is None else {s: aux[s] + layer_aux[s] for s in range(world)}
        for s in range(world):
            loss = F.cross_entropy(F.linear(hs[s], dense[s]["lm_head.weight"]).flatten(0, 1).float(),
                                   ys[s].flatten()) + AUX_COEF * aux[s]
            total = loss if total is None else total + loss
        total.backward()
        grads = {}
        for n in dense_names:  # ZeRO: each rank's gradient / dp, summed in rank order
            acc = torch.zeros_like(master[n])
            for s in range(world):
                g = dense[s][n].grad
                acc += (g if g is not None else torch.zeros_like(acc)) / world
            grads[n] = acc
        for experts in copies:  # over the expert-DP group: the copies of the expert, / dp
            for n in experts[0]:
                acc = torch.zeros_like(master[n])
                for copy in experts:
                    gr = copy[n].grad
                    acc += (gr if gr is not None else torch.zeros_like(acc)) / world
                grads[n] = acc
        for n in names:
            master[n].grad = grads[n]
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([master[n] for n in names], clip)
        if schedule:
            from .schedule import reference_lr

            reference_lr(opt)
        opt.step()
    return {n: master[n].detach().numpy().copy() for n in names}


def _start_from(opt, master: dict, start) -> None:
    """Set the reference's weights and optimizer state to a checkpoint's (``reference_run``)."""
    with torch.no_grad():
        for n, p in master.items():
            p.copy_(start.params[n])
    opt.step_count = int(start.matrix_step)
    opt.state = {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                 for n, st in start.rule_state.items()}
    if opt.adamw is not None:
        by_id = {id(p): n for n, p in master.items()}
        for p in opt.aux:
            moments = start.adam[by_id[id(p)]]
            opt.adamw.state[p] = {"step": torch.tensor(float(start.adam_step), dtype=torch.float32),
                                  "exp_avg": moments["exp_avg"].clone(), "exp_avg_sq": moments["exp_avg_sq"].clone()}


def _shapes(num_experts: int) -> dict:
    shapes = {"embed.weight": (VOCAB, D), "proj.weight": (D, D), "proj.bias": (D,), "norm.weight": (D,),
              "norm.bias": (D,), MOE + "gate.wg.weight": (num_experts, D), "lm_head.weight": (VOCAB, D)}
    for e in range(num_experts):
        shapes.update({f"{EXPERTS}{e}.0.weight": (H, D), f"{EXPERTS}{e}.0.bias": (H,),
                       f"{EXPERTS}{e}.2.weight": (D, H), f"{EXPERTS}{e}.2.bias": (D,)})
    return shapes


def run_moe_engine(rank: int, world: int, ep_size: int, cfg: dict, steps: int, micro: int = 2, seed: int = 0,
                   groups: bool = False, after_init=None, data: list | None = None, after_step=None, mpu=None,
                   client: bool = False, after_build=None, num_experts: int = NUM_EXPERTS,
                   ep2: int | None = None):
    """Train the tiny MoE model on a DeepSpeed engine; return (whole-model-named parameters of
    this rank, losses, engine).  ``groups``: pass DeepSpeed's own MoE param groups
    (split_params_into_different_moe_groups_for_optimizer) instead of the parameters (which
    deepspeed.initialize splits the same way itself); ``after_step(step, parameters)``; ``mpu``: a
    Megatron mpu passed to deepspeed.initialize (Megatron-DeepSpeed's configuration); ``client``:
    Megatron-DeepSpeed's stage-0 path, the optimizer built by ``build_tp_optimizer`` before
    ``deepspeed.initialize`` and passed to it as the client optimizer (``after_build(model,
    optimizer)`` runs in between); ``num_experts``: the MoE layer's experts (``reference_run`` takes
    the same); ``ep2``: a second MoE layer with that ep_size (``TinyMoE``).  The expert groups'
    layout follows ``cfg``'s ``use_data_before_expert_parallelism`` (:func:`ep_rank_of`)."""
    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    before = data_before(cfg)
    ep_rank = ep_rank_of(rank, world, ep_size, before)
    ep2_rank = ep_rank_of(rank, world, ep2, before) if ep2 else 0
    model = TinyMoE(ep_size, ep_rank, num_experts=num_experts, seed=seed, ep2=ep2, ep2_rank=ep2_rank)
    params = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense"}) if groups else list(model.parameters())
    if client:
        from canzona_ds.integration.megatron import build_tp_optimizer

        optimizer = build_tp_optimizer(model, cfg, mpu=mpu)
        if after_build is not None:
            after_build(model, optimizer)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=mpu)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg, mpu=mpu)
    if after_init is not None:
        after_init(engine)
    losses = []
    local = num_experts // ep_size
    local2 = num_experts // ep2 if ep2 else 1

    def whole():
        return {global_name(n, ep_rank, local, ep2_rank, local2): p.detach().float().numpy().copy()
                for n, p in engine.module.named_parameters()}

    for step, (x, y) in enumerate((data if data is not None else batches(steps, micro * world))[:steps], start=1):
        x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step, whole())
    return whole(), losses, engine


def gloo_gather_tokens() -> None:
    """Let DeepSpeed MoE's tensor-parallel token gather run on gloo (call once per worker).

    ``deepspeed.moe.mappings._gather_tokens`` all-gathers a [.., C, D] tensor into a flat
    buffer with ``all_gather_into_tensor``; NCCL accepts that, gloo wants the input flat too
    ("invalid tensor size").  This gathers the flattened input into the same flat buffer and
    reshapes exactly as DeepSpeed does: the same bytes, a pure copy (CPU tests only)."""
    import deepspeed
    import deepspeed.moe.mappings as mappings
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size

    def _gather_tokens(input_, dim=0):
        mpu = deepspeed.utils.groups.mpu
        input_ = input_.contiguous()
        world_size = bwc_tensor_model_parallel_world_size(mpu)
        if world_size == 1:
            return input_
        buffer = torch.empty(world_size * input_.numel(), dtype=input_.dtype, device=input_.device)
        deepspeed.comm.all_gather_into_tensor(buffer, input_.view(-1), group=bwc_tensor_model_parallel_group(mpu))
        return torch.cat([c.view_as(input_) for c in buffer.chunk(world_size)], dim=dim).contiguous()

    mappings._gather_tokens = _gather_tokens


# ---------------------------------------------------------------- MoE x tensor parallelism
#: the TP-split dense matrices of :class:`TinyMoETP`: name -> (whole shape, partition dim)
TP_SPLIT = {"up.weight": ((2 * D, D), 0), "down.weight": ((D, 2 * D), 1)}


class TinyMoETP(TinyMoE):
    """:class:`TinyMoE` with a Megatron tensor-parallel MLP before the MoE layer (the stand-in's
    ``ColumnParallelLinear(D, 2D)`` -> GELU -> ``RowParallelLinear(2D, D)``, split over the TP
    group of ``megatron_standin.initialize_model_parallel``); the experts stay whole
    (``enable_expert_tensor_parallelism=False``, DeepSpeed's default).  Every weight comes from its
    whole-model name (``up``/``down`` sliced by TP rank), so the model is the same at any layout."""

    def __init__(self, ep_size: int, ep_rank: int, tp_size: int, tp_rank: int, num_experts: int = NUM_EXPERTS,
                 seed: int = 0) -> None:
        from . import megatron_standin as ms

        super().__init__(ep_size, ep_rank, num_experts=num_experts, seed=seed)
        self.up = ms.ColumnParallelLinear(D, 2 * D)
        self.down = ms.RowParallelLinear(2 * D, D)
        with torch.no_grad():
            for n, (shape, dim) in TP_SPLIT.items():
                getattr(self, n.split(".")[0]).weight.copy_(_init(n, shape, seed).chunk(tp_size, dim=dim)[tp_rank])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.proj(self.norm(h))
        h = h + self.down(F.gelu(self.up(h)))
        out, l_aux, _ = self.moe(h)
        h = h + out
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), y.flatten()) + AUX_COEF * l_aux


def run_moe_tp_engine(rank: int, tp: int, ep_size: int, cfg: dict, steps: int, data: list, micro: int = 2,
                      after_init=None, seed: int = 0, after_step=None):
    """Train :class:`TinyMoETP` on a DeepSpeed engine with the Megatron stand-in's mpu (TP groups of
    consecutive ranks, DP strided); DeepSpeed's expert groups over the world (ep groups of
    consecutive ranks).  ``data``: global batches of ``micro * dp`` sequences, each DP rank its own
    slice (the TP ranks of one DP rank the same).  Returns (this rank's parameters by whole-model
    name, losses, engine).  The stand-in's model-parallel groups must exist
    (``megatron_standin.initialize_model_parallel(tp)``).  ``after_step(step, parameters)``."""
    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed

    from . import megatron_standin as ms

    gloo_gather_tokens()
    dp_rank, tp_rank = ms.get_data_parallel_rank(), ms.get_tensor_model_parallel_rank()
    ep_rank = rank % ep_size  # DeepSpeed's ep groups without expert TP: consecutive ranks
    model = TinyMoETP(ep_size, ep_rank, tp, tp_rank, seed=seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg,
                                           mpu=ms.mpu)
    if after_init is not None:
        after_init(engine)
    local = NUM_EXPERTS // ep_size
    losses = []

    def whole():  # whole-model names (a TP-split parameter keeps its name: its shards join along TP_SPLIT's dim)
        return {global_name(n, ep_rank, local): p.detach().float().numpy().copy()
                for n, p in engine.module.named_parameters()}

    for step, (x, y) in enumerate(data[:steps], start=1):
        x, y = x[dp_rank * micro:(dp_rank + 1) * micro], y[dp_rank * micro:(dp_rank + 1) * micro]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step, whole())
    return whole(), losses, engine


def tp_reference_run(initial: dict, data: list, steps: int, optimizer: str = "CanzonaMuon", dp: int = 2,
                     micro: int = 2, num_experts: int = NUM_EXPERTS, params: dict | None = None) -> dict:
    """The TP=1 single-process model of :class:`TinyMoETP` trained on its own gradients: every
    weight whole (``initial``: the whole model's weights by name, TP-split ones joined), each DP
    replica's forward with every expert in the process (DeepSpeed's own top-1 gating, slots,
    encode and decode; capacity = every token, so none is dropped), the gradient of the mean of
    the replicas' losses (ZeRO's average), ``ReferenceOptimizer``.  Not bit-identical to a TP run
    (the row-parallel partial sums, the TP ranks' capacity split and DeepSpeed's expert-DP
    averaging associate differently): a closed-loop check of the gradients, within rounding."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer

    torch.set_num_threads(test_threads())
    cfg = CanzonaConfig.from_ds(optimizer, dict(HP[optimizer] if params is None else params))
    master = {n: nn.Parameter(torch.as_tensor(v).clone()) for n, v in initial.items()}
    opt = ReferenceOptimizer(list(master.items()), cfg)
    P = master
    for x_all, y_all in data[:steps]:
        total = None
        for s in range(dp):
            x, y = x_all[s * micro:(s + 1) * micro], y_all[s * micro:(s + 1) * micro]
            h = F.embedding(x, P["embed.weight"])
            h = h + F.linear(F.layer_norm(h, (D,), P["norm.weight"], P["norm.bias"]), P["proj.weight"], P["proj.bias"])
            h = h + F.linear(F.gelu(F.linear(h, P["up.weight"])), P["down.weight"])
            flat = h.reshape(-1, D)
            logits = F.linear(flat.float(), weight=P[MOE + "gate.wg.weight"].float(), bias=None)
            l_aux, dispatched, combine = top1_route(flat, logits, num_experts)
            outs = []
            for e in range(dispatched.shape[0]):
                w = [P[f"{EXPERTS}{e}.{p}"] for p in EXPERT_PARAMS]
                outs.append(F.linear(F.gelu(F.linear(dispatched[e], w[0], w[1])), w[2], w[3]))
            combined = combine(torch.stack(outs))
            hs = h + combined.reshape(h.shape)
            loss = F.cross_entropy(F.linear(hs, P["lm_head.weight"]).flatten(0, 1).float(), y.flatten()) \
                + AUX_COEF * l_aux
            total = loss / dp if total is None else total + loss / dp
        opt.zero_grad()
        total.backward()
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in master.items()}


# ---------------------------------------------------------------- MoE in a PipelineModule
class PipeDense(nn.Module):
    """Pipeline layer 0: embedding and a dense residual matrix."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.proj = nn.Linear(D, D)
        _init_by_name(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return h + self.proj(h)


class PipeMoE(nn.Module):
    """A pipeline layer holding one ``deepspeed.moe.layer.MoE`` (residual; the aux loss dropped:
    a pipeline layer passes one tensor on)."""

    def __init__(self, ep_size: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.moe = MoE(hidden_size=D, expert=nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)),
                       num_experts=NUM_EXPERTS, ep_size=ep_size, k=1, capacity_factor=float(NUM_EXPERTS),
                       eval_capacity_factor=float(NUM_EXPERTS), min_capacity=0, use_rts=False)
        _init_by_name(self, seed=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out, _, _ = self.moe(h)
        return h + out


class PipeHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        _init_by_name(self)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


def _init_by_name(module: nn.Module, seed: int = 0) -> None:
    """Deterministic weights from each parameter's name (the pipeline layers' local names)."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(_init(n, tuple(p.shape), seed))


def _pipe_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def build_moe_pipe(moe_layers: int, ep_size: int = 2):
    """A 2-stage ``PipelineModule`` (``partition_method="uniform"``): ``PipeDense``, then
    ``moe_layers`` ``PipeMoE`` layers, then ``PipeHead``.  One MoE layer: stage 0 = dense + MoE,
    stage 1 = the head (MoE in one stage); two: one MoE layer in each stage (needs
    torch.distributed initialised)."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    if moe_layers not in (1, 2):
        raise ValueError(f"Invalid moe_layers={moe_layers}. Allowed: [1, 2].")
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    layers = [LayerSpec(PipeDense)] + [LayerSpec(PipeMoE, ep_size)] * moe_layers + [LayerSpec(PipeHead)]
    return PipelineModule(layers=layers, num_stages=2, loss_fn=_pipe_loss, partition_method="uniform")
