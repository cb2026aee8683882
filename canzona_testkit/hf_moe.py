"""A real tiny transformers ``Qwen3MoeForCausalLM`` and an independent per-expert reference.

transformers 5 stores a Qwen3-MoE layer's experts as two 3-D parameters::

    model.layers.<i>.mlp.experts.gate_up_proj   [E, 2 * moe_intermediate, hidden]
    model.layers.<i>.mlp.experts.down_proj      [E, hidden, moe_intermediate]
    model.layers.<i>.mlp.gate.weight            [E, hidden]   (the router: one 2-D matrix)

:class:`PerExpertReference` is the oracle for the per-expert update, written without the code it
checks (``rule_step``'s stack dispatch, ``MatrixInfo.expert``): every expert slice ``W[e]`` is
copied into a 2-D tensor of its own and stepped as an independent parameter, by
``torch.optim.Muon`` for Muon, and by the rule on that standalone matrix for Shampoo/SOAP; the
other matrices likewise, and torch's AdamW on the rest.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .models import HP

VOCAB, HIDDEN, EXPERTS, T = 64, 32, 4, 8


class MoELM(nn.Module):
    """(input_ids, labels) -> loss over a ``Qwen3MoeForCausalLM`` (the shape ``canzona_testkit.models``'
    runners call); ``config`` is the HF model's, so the optimizer builder finds ``num_experts``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, labels=y).loss


def tiny_qwen3_moe_config(layers: int = 1, experts: int = EXPERTS, hidden: int = HIDDEN, moe_intermediate: int = 16):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=experts,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def tiny_qwen3_moe(seed: int = 0, layers: int = 1, experts: int = EXPERTS, **shape) -> nn.Module:
    """The bare HF model (eager attention, fp32), seeded; ``shape``: hidden, moe_intermediate."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(layers, experts, **shape))
    model.config._attn_implementation = "eager"
    return model


def make_moe_model(seed: int = 0, layers: int = 1, experts: int = EXPERTS, **shape) -> MoELM:
    return MoELM(tiny_qwen3_moe(seed, layers, experts, **shape))


def moe_batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Causal-LM batches (labels = inputs; the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (global_batch, T), generator=g)
        out.append((x, x.clone()))
    return out


def expert_stacks(module: nn.Module) -> list[str]:
    """Names of the 3-D expert parameters (transformers 5's ``mlp.experts.*``)."""
    return [n for n, p in module.named_parameters() if p.ndim == 3 and ".experts." in f".{n}."]


class PerExpertReference:
    """Single-process oracle: every matrix and every expert slice as its own 2-D parameter.

    ``opt_type``/``params``: a Canzona type and its ds_config params (default ``HP``).  Call
    :meth:`step` after the model's gradients are set; the model's parameters are updated."""

    def __init__(self, model: nn.Module, opt_type: str, params: dict | None = None) -> None:
        from canzona_ds.config import CanzonaConfig

        params = dict(HP[opt_type] if params is None else params)
        self.cfg = cfg = CanzonaConfig.from_ds(opt_type, params)
        self.model = model
        stacks = set(expert_stacks(model))
        #: (stack or matrix name, expert index or None, standalone 2-D tensor)
        self.pieces: list[tuple[str, int | None, torch.Tensor]] = []
        aux = []
        for n, p in model.named_parameters():
            if n in stacks:
                for e in range(p.shape[0]):
                    self.pieces.append((n, e, p.detach()[e].clone().requires_grad_()))
            elif cfg.is_matrix(n, tuple(p.shape)):
                self.pieces.append((n, None, p.detach().clone().requires_grad_()))
            else:
                aux.append(p)
        standalone = [t for _, _, t in self.pieces]
        if opt_type == "CanzonaMuon":
            rule = cfg.rule
            self.matrix_opt = torch.optim.Muon(standalone, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                               momentum=rule.momentum, nesterov=rule.nesterov,
                                               ns_coefficients=tuple(rule.ns_coefficients), eps=rule.ns_eps,
                                               ns_steps=rule.ns_steps)
        else:
            self.matrix_opt = None
        self.states: dict = {}
        self.t = 0
        self.adamw = torch.optim.AdamW(aux, lr=cfg.adam_lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                       weight_decay=cfg.weight_decay)
        self.aux = aux
        self.lr = cfg.lr

    @property
    def config(self):
        return self.cfg

    @property
    def step_count(self) -> int:
        return self.t

    def set_lr(self, matrix_lr: float, adam_lr: float) -> None:
        """The lrs of the next step (a schedule: canzona_testkit.schedule.reference_lr)."""
        self.lr = matrix_lr
        for g in (self.matrix_opt.param_groups if self.matrix_opt is not None else []):
            g["lr"] = matrix_lr
        for g in self.adamw.param_groups:
            g["lr"] = adam_lr

    @torch.no_grad()
    def step(self) -> None:
        from canzona_ds.optim.rule import MatrixInfo, rule_step

        self.t += 1
        params = dict(self.model.named_parameters())
        for n, e, t in self.pieces:
            g = params[n].grad
            g = torch.zeros_like(params[n]) if g is None else g
            t.grad = (g[e] if e is not None else g).clone()
        if self.matrix_opt is not None:
            self.matrix_opt.step()
        else:
            for i, (n, e, t) in enumerate(self.pieces):
                key = f"piece{i}"  # a name of its own: nothing shared with the optimizer's keys
                rule_step(self.cfg.rule, t, t.grad, self.states, MatrixInfo(key, tuple(t.shape)), self.t,
                          self.lr, self.cfg.weight_decay)
        for n, e, t in self.pieces:
            (params[n][e] if e is not None else params[n]).copy_(t)
        for p in self.aux:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.adamw.step()

    def expert_state(self, name: str, e: int) -> dict:
        """The reference's state of expert ``e`` of stack ``name`` (Muon: torch's momentum buffer)."""
        i = next(i for i, (n, k, _) in enumerate(self.pieces) if n == name and k == e)
        if self.matrix_opt is not None:
            return dict(self.matrix_opt.state[self.pieces[i][2]])
        return self.states[f"piece{i}"]
