"""Typed, validated settings of ``"optimizer": {"type": "CanzonaMuon", "params": {...}}``.

Three families of keys share the ``params`` dict (every key is documented once, with
default and valid range, in docs/zero1.md):

* DeepSpeed's built-in ``"Muon"`` keys, same names and meaning, so switching
  ``"Muon"`` -> ``"CanzonaMuon"`` is a one-word change: ``lr`` (shared by both halves),
  ``muon_lr`` / ``adam_lr`` (override ``lr`` per half), ``momentum``, ``weight_decay``
  (both halves), ``betas`` and ``eps`` (the AdamW half), ``ns_method``.
* ``torch.optim.Muon`` keys for the rest of the Muon math: ``nesterov``, ``ns_steps``,
  ``ns_coefficients``, ``adjust_lr_fn``, and ``ns_eps`` (torch's Muon ``eps``; renamed
  because DeepSpeed's ``eps`` already means the Adam epsilon).
* Partitioner keys: ``planner``, ``alpha``, ``cost_model``, ``matrix_exclude``,
  ``matrix_include``; and ``replicated`` (benchmark baseline: every rank updates every
  matrix, DDP style, ZeRO stage 0).

Unknown keys are an error: a misspelt hyper-parameter must not be silently ignored.
"""
from __future__ import annotations

from canzona_ds.planning.dp import DEFAULT_DP_PLANNER

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from canzona_ds.optim.muon import ADJUST_LR_FNS, NS_COEFFICIENTS, NS_METHODS
from canzona_ds.planning.params import DEFAULT_AUX_NAME_FRAGMENTS

# DeepSpeed's MuonWithAuxAdam defaults (runtime/zero/muon/original_muon.py), kept so that a
# config written for "Muon" means the same hyper-parameters here.
DS_MUON_DEFAULT_LR = 0.02
DS_ADAM_DEFAULT_LR = 3e-4


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class CanzonaMuonConfig:
    #: Muon learning rate (DeepSpeed ``muon_lr``, else ``lr``, else 0.02). > 0.
    muon_lr: float = DS_MUON_DEFAULT_LR
    #: AdamW learning rate for non-matrix parameters (``adam_lr``, else ``lr``, else 3e-4). > 0.
    adam_lr: float = DS_ADAM_DEFAULT_LR
    #: Muon momentum (``momentum``), in [0, 1).
    momentum: float = 0.95
    #: decoupled weight decay of both halves (``weight_decay``), >= 0.
    weight_decay: float = 0.0
    #: AdamW betas, each in [0, 1).
    betas: tuple[float, float] = (0.9, 0.95)
    #: AdamW epsilon, > 0.
    eps: float = 1e-10
    #: Newton-Schulz evaluation: "standard" (torch.optim.Muon, bit-exact) or "gram".
    ns_method: str = "standard"
    #: Nesterov momentum (torch.optim.Muon ``nesterov``).
    nesterov: bool = True
    #: Newton-Schulz iterations, int >= 1.
    ns_steps: int = 5
    #: quintic coefficients (a, b, c).
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    #: epsilon of the Frobenius normalisation before Newton-Schulz (torch's Muon ``eps``), > 0.
    ns_eps: float = 1e-7
    #: torch.optim.Muon learning-rate scaling: None/"original", "match_rms_adamw", "none".
    adjust_lr_fn: str | None = None
    #: DP ownership planner name passed to ``canzona_ds.planning.dp.plan_dp``.
    planner: str = DEFAULT_DP_PLANNER
    #: balance factor of the alpha-balanced planner, in [0, 1].
    alpha: float = 1.0
    #: planner load: "numel", "flops" (Newton-Schulz FLOPs) or "memory".
    cost_model: str = "flops"
    #: a >=2-D parameter whose name contains any of these goes to AdamW.
    matrix_exclude: tuple[str, ...] = DEFAULT_AUX_NAME_FRAGMENTS
    #: a >=2-D parameter whose name contains any of these goes to Muon even if excluded.
    matrix_include: tuple[str, ...] = ()
    #: baseline mode: no partitioning, every rank updates every matrix (needs ZeRO stage 0).
    replicated: bool = False
    #: keys the user gave (for messages); not a setting.
    given: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("muon_lr", "adam_lr", "eps", "ns_eps"):
            v = getattr(self, name)
            if not _is_number(v) or v <= 0:
                raise ValueError(f"Invalid {name}={v!r}. Must be a finite number > 0.")
        if not _is_number(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"Invalid momentum={self.momentum!r}. Must be within [0, 1).")
        if not _is_number(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"Invalid weight_decay={self.weight_decay!r}. Must be a finite number >= 0.")
        if len(self.betas) != 2 or not all(_is_number(b) and 0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Invalid betas={self.betas!r}. Must be two numbers within [0, 1).")
        if self.ns_method not in NS_METHODS:
            raise ValueError(f"Invalid ns_method={self.ns_method!r}. Allowed: {list(NS_METHODS)}")
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"Invalid nesterov={self.nesterov!r}. Must be true or false.")
        if not isinstance(self.ns_steps, int) or isinstance(self.ns_steps, bool) or self.ns_steps < 1:
            raise ValueError(f"Invalid ns_steps={self.ns_steps!r}. Must be an int >= 1.")
        if len(self.ns_coefficients) != 3 or not all(_is_number(c) for c in self.ns_coefficients):
            raise ValueError(f"Invalid ns_coefficients={self.ns_coefficients!r}. Must be three finite numbers.")
        if self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Invalid adjust_lr_fn={self.adjust_lr_fn!r}. Allowed: {list(ADJUST_LR_FNS)}")
        if not isinstance(self.planner, str) or not self.planner:
            raise TypeError(f"Invalid planner={self.planner!r}. Must be a planner name (str).")
        if not _is_number(self.alpha) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"Invalid alpha={self.alpha!r}. Must be within [0, 1].")
        from canzona_ds.planning.cost import COST_MODELS

        if self.cost_model not in COST_MODELS:
            raise ValueError(f"Invalid cost_model={self.cost_model!r}. Allowed: {list(COST_MODELS)}")
        for name in ("matrix_exclude", "matrix_include"):
            v = getattr(self, name)
            if not all(isinstance(s, str) and s for s in v):
                raise TypeError(f"Invalid {name}={v!r}. Must be a list of non-empty strings.")
        if not isinstance(self.replicated, bool):
            raise TypeError(f"Invalid replicated={self.replicated!r}. Must be true or false.")

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "CanzonaMuonConfig":
        """Build from a ds_config ``optimizer.params`` dict (DeepSpeed + torch + planner keys)."""
        params = dict(params or {})
        unknown = sorted(set(params) - set(ALLOWED_KEYS))
        if unknown:
            raise ValueError(
                f"Unknown CanzonaMuon parameter(s) {unknown}. Allowed: {sorted(ALLOWED_KEYS)} "
                "(see docs/zero1.md)."
            )
        kw: dict[str, Any] = {}
        lr = params.pop("lr", None)
        kw["muon_lr"] = params.pop("muon_lr", lr if lr is not None else DS_MUON_DEFAULT_LR)
        kw["adam_lr"] = params.pop("adam_lr", lr if lr is not None else DS_ADAM_DEFAULT_LR)
        for key in ("betas", "ns_coefficients", "matrix_exclude", "matrix_include"):
            if key in params:
                v = params.pop(key)
                if isinstance(v, str) or not hasattr(v, "__iter__"):
                    raise TypeError(f"Invalid {key}={v!r}. Must be a list.")
                kw[key] = tuple(v)
        kw.update(params)
        return cls(**kw, given=tuple(sorted(set(kw) - {"given"})))

    def is_matrix(self, name: str, shape: tuple[int, ...]) -> bool:
        """Muon (True) or AdamW (False) for a trainable parameter."""
        if len(shape) < 2:
            return False
        lowered = name.lower()
        if any(s.lower() in lowered for s in self.matrix_include):
            return True
        return not any(s.lower() in lowered for s in self.matrix_exclude)


#: every key accepted in ``optimizer.params``
ALLOWED_KEYS: tuple[str, ...] = ("lr",) + tuple(f.name for f in fields(CanzonaMuonConfig) if f.name != "given")
