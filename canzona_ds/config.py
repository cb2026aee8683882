"""One typed config for every matrix optimizer: what the user's ds_config means.

    "optimizer": {"type": "CanzonaMuon" | "CanzonaShampoo" | "CanzonaSOAP",
                  "params": {...}},                      -> CanzonaConfig.from_ds()
    "canzona_tp": {...}                                   -> TPConfig (optional section)
    "canzona_checkpoint": {...}                           -> CheckpointConfig (optional section)
    "canzona_metrics": {...}                              -> MetricsConfig (optional section)

``params`` holds three families of keys, every one listed with default, range and meaning
in docs/config.md (generated from this file and the rule files: ``python -m
canzona_ds.config``; a test keeps it in sync):

* the common keys (:class:`CommonKeys`): learning rates, AdamW for the non-matrix
  parameters, weight decay, and where matrices go (:class:`PlacementConfig`);
* the rule's keys: the fields of its ``MatrixRule`` dataclass (``MuonRule``,
  ``ShampooRule``, ``SOAPRule``);
* aliases a rule declares (``config_aliases``): DeepSpeed's own ``"Muon"`` reads
  ``betas``/``eps`` as the AdamW half's and ``muon_lr`` as the matrix lr, so switching
  ``"Muon"`` -> ``"CanzonaMuon"`` is a one-word change.

Unknown keys, ``null`` where a value is required, wrong types and out-of-range values are
``ValueError``/``TypeError`` naming the key the user wrote and what is allowed.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .planning.dp import ATOMIC_DP_PLANNERS, DEFAULT_BUCKET_NUMEL, DEFAULT_DP_PLANNER, DEFAULT_MAX_PADDING, LAYOUTS
from .planning.params import DEFAULT_EXCLUDE, is_matrix, matrix_experts
from .planning.tp import DEFAULT_TP_SCHEDULER, TP_SCHEDULERS
from .optim import OPTIMIZER_TYPES, rule_class
from .optim.qk_clip import QKClipConfig
from .optim.rule import MatrixRule, check_bool, check_choice, check_int, check_number

#: largest learning rate accepted (a guard against typos such as 2e2 for 2e-2)
MAX_LR = 10.0
#: DP plan cost models the optimizer can balance
DP_COSTS = ("flops", "peak_flops", "numel", "memory")
TP_COSTS = ("numel", "flops", "memory")


@dataclass(frozen=True)
class PlacementConfig:
    """Which parameters are matrices, and how DP ranks share them."""

    #: DP ownership planner, one of planning.dp.ATOMIC_DP_PLANNERS
    planner: str = DEFAULT_DP_PLANNER
    #: balance factor of the alpha_balanced planner, in [0, 1]
    alpha: float = 1.0
    #: load the planner balances: "flops" (amortised), "peak_flops", "numel", "memory"
    cost_model: str = "flops"
    #: bucket size in elements of the bucketed planners (alpha_balanced, paper_naive): the
    #: paper's Algorithm 1 and eq. 1 plan bucket by bucket; DeepSpeed's reduce_bucket_size default
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    #: name fragments that make a >=2-D parameter a matrix even if excluded
    matrix_include: tuple[str, ...] = ()
    #: name fragments that send a >=2-D parameter to AdamW
    matrix_exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    #: ZeRO-1/2 layout of the matrices: "owned" (every matrix whole on its planned owner, each rank's range
    #: padded to the largest), "mixed" (equal chunks; matrices that do not fit are hosted: updated on a planned
    #: rank through all-to-alls over the DP group, no padding; docs/zero.md), "auto" (owned unless its padding
    #: exceeds max_padding; under DeepSpeed MoE "auto" keeps owned and "mixed" plans every matrix group over its
    #: own DP or expert-DP group, docs/moe.md). Under tensor parallelism a hosted TP-split matrix is updated over
    #: the DP x TP grid (each TP shard cut into DP pieces, docs/tp.md)
    layout: str = "auto"
    #: largest padding of the owned layout (padding / matrix elements, 0.02 = 2%) that layout "auto" accepts
    #: before it switches to the mixed layout
    max_padding: float = DEFAULT_MAX_PADDING
    #: name fragments of >=3-D matrices that are stacks of experts along dim 0 (E matrices of the trailing shape, updated and costed one by one), besides the automatic rule: a path component "experts" (transformers 5 MoE)
    expert_params: tuple[str, ...] = ()
    #: experts per stack (dim 0 of every expert stack; a stack with another dim 0 is refused); null = the model config's num_experts / num_local_experts / n_routed_experts where one is at hand, else unchecked
    num_experts: int | None = None

    def __post_init__(self) -> None:
        check_choice("planner", self.planner, ATOMIC_DP_PLANNERS)
        check_choice("layout", self.layout, LAYOUTS)
        check_number("max_padding", self.max_padding, 0.0, 1000.0)
        check_number("alpha", self.alpha, 0.0, 1.0)
        check_choice("cost_model", self.cost_model, DP_COSTS)
        if isinstance(self.bucket_numel, float) and self.bucket_numel.is_integer():  # JSON 5e8
            object.__setattr__(self, "bucket_numel", int(self.bucket_numel))
        check_int("bucket_numel", self.bucket_numel, 1, 10**11)
        for name in ("matrix_include", "matrix_exclude", "expert_params"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(isinstance(s, str) and s for s in v):
                raise TypeError(f"Invalid {name}={v!r}. Must be a list of non-empty strings.")
        if self.num_experts is not None:
            check_int("num_experts", self.num_experts, 1, 2**20)


@dataclass(frozen=True)
class TPConfig:
    """ds_config section ``"canzona_tp"``: the micro-group runtime (matrices split by tensor
    parallelism, and every matrix at ZeRO stage 3)."""

    #: micro-group scheduler: "lpt_rollback" (paper Algorithms 2-4), "no_fusion" (one matrix per
    #: all-to-all), "round_robin" (no load balancing)
    scheduler: str = DEFAULT_TP_SCHEDULER
    #: per-host cost cap of one micro-group, in `cost` units of FULL matrices (> 0); null = the
    #: largest single task (smallest groups)
    c_max: float | None = None
    #: load the scheduler balances: "numel", "flops", "memory" (at ZeRO stage 3 the default is
    #: "flops": the registry fills it in when the section does not set it)
    cost: str = "numel"
    #: overlap micro-group k's compute with the all-to-alls of k-1 and k+1 (false: one at a time)
    pipelined: bool = True

    def __post_init__(self) -> None:
        check_choice("canzona_tp.scheduler", self.scheduler, tuple(TP_SCHEDULERS))
        if self.c_max is not None:
            check_number("canzona_tp.c_max", self.c_max, 0.0, None, low_open=True)
        check_choice("canzona_tp.cost", self.cost, TP_COSTS)
        check_bool("canzona_tp.pipelined", self.pipelined)

    @classmethod
    def from_section(cls, section: Any) -> "TPConfig":
        if section is None:
            return cls()
        if not isinstance(section, Mapping):
            raise TypeError(f"Invalid canzona_tp={section!r}. Must be a JSON object of {sorted(_field_names(cls))}.")
        if "strategy" in section:
            raise ValueError("canzona_tp.strategy was removed: the runtime is always TP-ASC (micro-group hosting). "
                             "TP-SC and shard-local TP are benchmark baselines, not options (docs/tp.md).")
        unknown = sorted(set(section) - _field_names(cls))
        if unknown:
            raise ValueError(f"Unknown canzona_tp key(s) {unknown}. Allowed: {sorted(_field_names(cls))}.")
        for k, v in section.items():
            if v is None and k != "c_max":
                raise ValueError(f"Invalid canzona_tp.{k}=None. Give a value or remove the key.")
        return cls(**dict(section))


#: what a Canzona engine's load_checkpoint checks before loading (canzona_checkpoint.verify)
CHECKPOINT_VERIFY = ("sha256", "size", "off")


def _from_section(cls, name: str, section: Any):
    """A ds_config section (``name``) as the dataclass ``cls``: absent -> the defaults; not an
    object, an unknown key or a null value -> one error naming it."""
    if section is None:
        return cls()
    if not isinstance(section, Mapping):
        raise TypeError(f"Invalid {name}={section!r}. Must be a JSON object of {sorted(_field_names(cls))}.")
    unknown = sorted(set(section) - _field_names(cls))
    if unknown:
        raise ValueError(f"Unknown {name} key(s) {unknown}. Allowed: {sorted(_field_names(cls))}.")
    for k, v in section.items():
        if v is None:
            raise ValueError(f"Invalid {name}.{k}=None. Give a value or remove the key.")
    return cls(**dict(section))


@dataclass(frozen=True)
class CheckpointConfig:
    """ds_config section ``"canzona_checkpoint"``: integrity of ``engine.save_checkpoint`` /
    ``engine.load_checkpoint`` on an engine running a Canzona optimizer (docs/checkpoints.md)."""

    #: what load_checkpoint checks against the checkpoint's canzona_manifest.json before loading:
    #: "sha256" (every byte), "size" (files present with their sizes; blind to overwritten
    #: bytes), "off" (nothing, DeepSpeed's own load). save_checkpoint writes the manifest in
    #: every mode
    verify: str = "sha256"
    #: when the requested checkpoint fails verification, load the newest intact tag of the same
    #: directory instead of raising (needs verify "sha256" or "size")
    fallback: bool = False
    #: a parameter whose optimizer role changed since the save (matrix rule <-> AdamW, e.g.
    #: matrix_include changed) is refused by name at load; true re-initialises exactly those
    #: parameters' optimizer state instead (each logged by name), keeping their weights
    reinit_changed_roles: bool = False
    #: load_checkpoint unpickles only data: tensors and the few plain types DeepSpeed's files hold
    #: (a file naming any other type is refused by name before anything is unpickled). true
    #: unpickles anything, as torch.load(weights_only=False) does: a crafted file can then run
    #: code. Only for a checkpoint whose origin you trust (docs/checkpoints.md)
    allow_unsafe_pickle: bool = False

    def __post_init__(self) -> None:
        check_choice("canzona_checkpoint.verify", self.verify, CHECKPOINT_VERIFY)
        check_bool("canzona_checkpoint.fallback", self.fallback)
        check_bool("canzona_checkpoint.reinit_changed_roles", self.reinit_changed_roles)
        check_bool("canzona_checkpoint.allow_unsafe_pickle", self.allow_unsafe_pickle)
        if self.fallback and self.verify == "off":
            raise ValueError("Invalid canzona_checkpoint.fallback=true with verify='off': falling back needs "
                             "verification to tell an intact checkpoint from a corrupt one. Set verify to "
                             "'sha256' or 'size', or fallback to false.")

    @classmethod
    def from_section(cls, section: Any) -> "CheckpointConfig":
        return _from_section(cls, "canzona_checkpoint", section)


@dataclass(frozen=True)
class MetricsConfig:
    """ds_config section ``"canzona_metrics"``: the optimizer's step metrics (``optimizer.metrics()``,
    canzona_ds/step_metrics.py; names, units and definitions in docs/optimizers.md, "Step metrics")."""

    #: record the step metrics (wall times, hosted runtime traffic, QK-clip's figures, skipped
    #: flag) and, when the ds_config enables a DeepSpeed monitor, write them under Train/Canzona/
    enabled: bool = True
    #: every this many steps, one all_gather over the DP group turns each rank's step time into
    #: the busiest and mean rank's (dp_max_step_ms, dp_mean_step_ms); 0 = never (no collective)
    interval: int = 10

    def __post_init__(self) -> None:
        check_bool("canzona_metrics.enabled", self.enabled)
        check_int("canzona_metrics.interval", self.interval, 0, 10**9)

    @classmethod
    def from_section(cls, section: Any) -> "MetricsConfig":
        return _from_section(cls, "canzona_metrics", section)


@dataclass(frozen=True)
class CommonKeys:
    """``optimizer.params`` keys every Canzona optimizer takes."""

    #: learning rate of the matrix rule; also the AdamW half's unless adam_lr is given. In (0, 10];
    #: default per rule (Muon 0.02, Shampoo 1e-3, SOAP 3e-3)
    lr: float | None = None
    #: AdamW learning rate of the non-matrix parameters, in (0, 10]; default lr if given, else per
    #: rule (Muon 3e-4 as DeepSpeed's Muon, Shampoo 1e-3, SOAP 3e-3)
    adam_lr: float | None = None
    #: AdamW betas (b1, b2) of the non-matrix parameters, each in [0, 1)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    #: AdamW epsilon of the non-matrix parameters, in (0, 1]
    adam_eps: float = 1e-10
    #: decoupled weight decay of both halves, in [0, 1]
    weight_decay: float = 0.0
    #: Muon only: orthogonalise attention projections head by head (DeepSpeed's per_head_muon)
    per_head_muon: bool = False
    #: MuonClip's QK-clip, an object {"threshold": tau} (keys below, docs/qk_clip.md); absent: off
    qk_clip: QKClipConfig | None = None


def _field_names(cls) -> set[str]:
    return {f.name for f in fields(cls)}


_COMMON = _field_names(CommonKeys) | _field_names(PlacementConfig)


@dataclass(frozen=True)
class CanzonaConfig:
    """The resolved settings of one Canzona optimizer."""

    rule: MatrixRule
    #: learning rate of the matrix rule
    lr: float
    #: learning rate of the AdamW half
    adam_lr: float
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-10
    weight_decay: float = 0.0
    per_head_muon: bool = False
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    #: QK-clip (None: off)
    qk_clip: QKClipConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rule, MatrixRule):
            raise TypeError(f"CanzonaConfig.rule must be a MatrixRule, got {type(self.rule).__name__}")
        check_number("lr", self.lr, 0.0, MAX_LR, low_open=True)
        check_number("adam_lr", self.adam_lr, 0.0, MAX_LR, low_open=True)
        _check_pair("adam_betas", self.adam_betas)
        object.__setattr__(self, "adam_betas", tuple(float(b) for b in self.adam_betas))
        check_number("adam_eps", self.adam_eps, 0.0, 1.0, low_open=True)
        check_number("weight_decay", self.weight_decay, 0.0, 1.0)
        check_bool("per_head_muon", self.per_head_muon)
        if self.per_head_muon and self.rule.name != "muon":
            raise ValueError(f"per_head_muon=true is a Muon setting; optimizer {self.rule.name!r} has no per-head mode.")
        object.__setattr__(self, "qk_clip", QKClipConfig.from_value(self.qk_clip))

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_ds(cls, optimizer_type: str, params: Any = None, tp_section: Any = None) -> "CanzonaConfig":
        """From ds_config ``optimizer.type``, ``optimizer.params`` and ``canzona_tp``."""
        if optimizer_type not in OPTIMIZER_TYPES:
            raise ValueError(f"Unknown Canzona optimizer type {optimizer_type!r}. Allowed: {sorted(OPTIMIZER_TYPES)}.")
        return cls.from_params(OPTIMIZER_TYPES[optimizer_type], params, tp_section)

    @classmethod
    def from_params(cls, rule_name: str, params: Any = None, tp_section: Any = None) -> "CanzonaConfig":
        rule_cls = rule_class(rule_name)
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise TypeError(f"Invalid optimizer.params={params!r} ({type(params).__name__}). Must be a JSON object "
                            "(key -> value); see docs/config.md.")
        params = dict(params)
        aliases = dict(rule_cls.config_aliases)
        rule_keys = _field_names(rule_cls) - set(aliases)
        allowed = sorted(_COMMON | rule_keys | set(aliases))
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ValueError(f"Unknown {rule_cls.name} optimizer parameter(s) {unknown}. Allowed: {allowed} "
                             "(docs/config.md).")
        # no key may be null (a default comes from leaving the key out), except rule fields whose
        # documented value range includes null
        nullable = {f.name for f in fields(rule_cls) if "None" in str(f.type)}
        for k, v in params.items():
            if v is None and k not in nullable:
                raise ValueError(f"Invalid {k}=None. Give a value or remove the key (its default is documented in "
                                 "docs/config.md).")
        for k in ("lr", "adam_lr", "muon_lr"):
            if k in params:
                check_number(k, params[k], 0.0, MAX_LR, low_open=True)
        # aliases first (named as written), then the canonical keys
        canonical: dict[str, Any] = {}
        written: dict[str, str] = {}
        for k, v in params.items():
            target = aliases.get(k, k)
            if target in canonical:
                raise ValueError(f"{written[target]!r} and {k!r} set the same setting; give one of them.")
            written[target] = k
            if target in ("adam_betas", "betas"):
                v = _as_pair(k, v)
            canonical[target] = v
        if "adam_betas" in canonical:
            _check_pair(_written(params, aliases, "adam_betas"), canonical["adam_betas"])
        if "adam_eps" in canonical:
            check_number(_written(params, aliases, "adam_eps"), canonical["adam_eps"], 0.0, 1.0, low_open=True)
        lr = canonical.pop("lr", None)
        matrix_lr = canonical.pop("lr_matrix", None)
        if matrix_lr is None:
            matrix_lr = lr if lr is not None else rule_cls.default_lr
        adam_lr = canonical.pop("adam_lr", None)
        if adam_lr is None:
            adam_lr = lr if lr is not None else rule_cls.default_adam_lr
        placement_kw = {k: canonical.pop(k) for k in list(canonical) if k in _field_names(PlacementConfig)}
        for k in ("matrix_include", "matrix_exclude", "expert_params"):
            if k in placement_kw:
                placement_kw[k] = _as_strings(k, placement_kw[k])
        common_kw = {k: canonical.pop(k) for k in list(canonical) if k in _field_names(CommonKeys)}
        rule_kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in canonical.items()}
        return cls(rule=rule_cls(**rule_kw), lr=matrix_lr, adam_lr=adam_lr, placement=PlacementConfig(**placement_kw),
                   tp=TPConfig.from_section(tp_section), **common_kw)

    # ------------------------------------------------------------------ meaning
    def is_matrix(self, name: str, shape: tuple[int, ...], use_muon: bool | None = None) -> bool:
        """Matrix rule (True) or AdamW (False): planning.params.is_matrix with this config's lists."""
        return is_matrix(name, shape, self.placement.matrix_include, self.placement.matrix_exclude, use_muon)

    def experts_of(self, name: str, shape: tuple[int, ...], model_num_experts: int | None = None) -> int | None:
        """Experts in a matrix parameter (None: one matrix; planning.params.matrix_experts with
        this config's ``expert_params``/``num_experts``).  ``model_num_experts``: the model
        config's count; ds_config's ``num_experts`` must agree with it when both are given."""
        expected = self.placement.num_experts
        if expected is not None and model_num_experts is not None and expected != model_num_experts:
            raise ValueError(f"Optimizer params num_experts={expected} disagrees with the model config's "
                             f"{model_num_experts} experts.")
        return matrix_experts(name, shape, self.placement.expert_params,
                              expected if expected is not None else model_num_experts)

    @property
    def adam_lr_ratio(self) -> float:
        return self.adam_lr / self.lr

    def describe(self) -> dict[str, Any]:
        """Every resolved setting (JSON-serialisable): logged at start, fingerprinted across ranks."""
        out = {"rule": self.rule.describe(), "lr": self.lr, "adam_lr": self.adam_lr,
               "adam_betas": list(self.adam_betas), "adam_eps": self.adam_eps, "weight_decay": self.weight_decay,
               "per_head_muon": self.per_head_muon}
        if self.qk_clip is not None:  # (absent when off: fingerprints of runs without it unchanged)
            out["qk_clip"] = self.qk_clip.describe()
        for sub in ("placement", "tp"):
            obj = getattr(self, sub)
            out[sub] = {f.name: (list(v) if isinstance(v := getattr(obj, f.name), tuple) else v) for f in fields(obj)}
        return out

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()[:16]


def _written(params: Mapping, aliases: Mapping[str, str], canonical: str) -> str:
    """The key the user wrote for ``canonical`` (for error messages)."""
    return next((k for k in params if aliases.get(k, k) == canonical), canonical)


def _as_pair(key: str, v: Any) -> tuple:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or len(v) != 2:
        raise TypeError(f"Invalid {key}={v!r}. Must be a list of two numbers.")
    return tuple(v)


def _check_pair(key: str, v: Any) -> None:
    for i, b in enumerate(_as_pair(key, v)):
        check_number(f"{key}[{i}]", b, 0.0, 1.0, high_open=True)


def _as_strings(key: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise TypeError(f"Invalid {key}={v!r}. Must be a list of non-empty strings.")
    return tuple(v)


# ---------------------------------------------------------------------- documentation
@dataclass(frozen=True)
class KeyDoc:
    key: str
    default: Any
    doc: str


def field_docs(cls) -> list[KeyDoc]:
    """(field, default, ``#:`` comment) of a config dataclass, from its source."""
    src = inspect.getsource(cls)
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in src.splitlines():
        s = line.strip()
        if s.startswith("#:"):
            pending.append(s[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", s)
        if m and pending:
            docs[m.group(1)] = " ".join(pending)
        pending = [] if not s.startswith("#:") else pending
    out = []
    for f in fields(cls):
        if f.name in docs:
            default = f.default if f.default is not field else None
            if callable(f.default_factory):  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            out.append(KeyDoc(f.name, default, docs[f.name]))
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        v = list(v)
    return json.dumps(v)


def markdown() -> str:
    """docs/config.md: every key of every optimizer type the package ships (generated)."""
    lines = ["# Configuration keys", "",
             "Generated by `python -m canzona_ds.config > docs/config.md` from the dataclasses in",
             "`canzona_ds/config.py` and the rule files; `tests/test_optim_config.py` fails when it is stale.",
             "Every key is optional. Unknown keys, `null` values, wrong types and out-of-range values are errors",
             "that name the key.", "",
             "## `optimizer.params`: keys of every type", "",
             "| key | default | meaning |", "|---|---|---|"]
    for d in field_docs(CommonKeys) + field_docs(PlacementConfig):
        lines.append(f"| `{d.key}` | `{_fmt(d.default)}` | {d.doc} |")
    lines += ["", "### `optimizer.params.qk_clip`: MuonClip's QK-clip (every type; `canzona_ds/optim/qk_clip.py`)", "",
              "| key | default | meaning |", "|---|---|---|"]
    for d in field_docs(QKClipConfig):
        lines.append(f"| `{d.key}` | `{_fmt(d.default)}` | {d.doc} |")
    # the package's own rules only: a rule registered by user code (or a test) is not part of
    # the shipped reference, so the generated file does not depend on what was imported first
    for opt_type, rule_name in sorted(OPTIMIZER_TYPES.items()):
        cls = rule_class(rule_name)
        if not cls.__module__.startswith("canzona_ds.optim."):
            continue
        source = cls.__module__.replace(".", "/") + ".py"
        lines += ["", f"## `\"type\": \"{opt_type}\"`: the {rule_name} rule (`{source}`)", ""]
        if cls.config_aliases:
            lines.append("Aliases (DeepSpeed compatibility): " + ", ".join(
                f"`{a}` = `{'lr (matrix half only)' if t == 'lr_matrix' else t}`"
                for a, t in sorted(cls.config_aliases.items())) + ".")
            lines.append("")
        lines += ["| key | default | meaning |", "|---|---|---|"]
        for d in field_docs(cls):
            lines.append(f"| `{d.key}` | `{_fmt(d.default)}` | {d.doc} |")
    lines += ["", "## `canzona_tp` (top-level ds_config section, the micro-group runtime: tensor parallelism "
              "and ZeRO stage 3)", "",
              "| key | default | meaning |", "|---|---|---|"]
    for d in field_docs(TPConfig):
        lines.append(f"| `{d.key}` | `{_fmt(d.default)}` | {d.doc} |")
    lines += ["", "## `canzona_checkpoint` (top-level ds_config section, checkpoint integrity)", "",
              "| key | default | meaning |", "|---|---|---|"]
    for d in field_docs(CheckpointConfig):
        lines.append(f"| `{d.key}` | `{_fmt(d.default)}` | {d.doc} |")
    lines += ["", "## `canzona_metrics` (top-level ds_config section, the optimizer's step metrics)", "",
              "| key | default | meaning |", "|---|---|---|"]
    for d in field_docs(MetricsConfig):
        lines.append(f"| `{d.key}` | `{_fmt(d.default)}` | {d.doc} |")
    return "\n".join(lines) + "\n"


def all_keys(optimizer_type: str) -> list[str]:
    """Every key ``optimizer.params`` accepts for ``optimizer_type``."""
    cls = rule_class(OPTIMIZER_TYPES[optimizer_type])
    return sorted(_COMMON | (_field_names(cls) - set(cls.config_aliases)) | set(cls.config_aliases))


if __name__ == "__main__":
    print(markdown(), end="")

