"""Matrix optimizers as rules, one file each, and the registry that names them.

    muon.py      MuonRule      "CanzonaMuon"
    shampoo.py   ShampooRule   "CanzonaShampoo"
    soap.py      SOAPRule      "CanzonaSOAP"

Adding one: write ``myrule.py`` with a :class:`~canzona_ds.optim.rule.MatrixRule`
subclass and add a ``register_rule(MyRule, "CanzonaMy")`` line below.  Nothing else in
the package changes: the config parser reads the rule's dataclass fields, the planners
its cost methods, and the DP and TP runtimes only call ``init_state``/``direction``/
``scales`` (tests/test_optim_interface.py runs a toy rule defined in the test file).
"""
from __future__ import annotations

from .rule import MatrixInfo, MatrixRule, apply_rule_update, apply_update, rule_step

#: rule name -> rule class
RULES: dict[str, type[MatrixRule]] = {}
#: ds_config ``optimizer.type`` -> rule name
OPTIMIZER_TYPES: dict[str, str] = {}


def register_rule(cls: type[MatrixRule], optimizer_type: str | None = None) -> type[MatrixRule]:
    """Make ``cls`` available by its ``name`` (and as ds_config ``"type": optimizer_type``)."""
    if not (isinstance(cls, type) and issubclass(cls, MatrixRule)):
        raise TypeError(f"register_rule needs a MatrixRule subclass, got {cls!r}")
    RULES[cls.name] = cls
    if optimizer_type is not None:
        OPTIMIZER_TYPES[optimizer_type] = cls.name
    return cls


def rule_class(name: str) -> type[MatrixRule]:
    if name not in RULES:
        raise ValueError(f"Unknown matrix optimizer {name!r}. Allowed: {sorted(RULES)}.")
    return RULES[name]


def rule_from_description(description: dict) -> MatrixRule:
    """The rule ``MatrixRule.describe()`` described (e.g. read back from a checkpoint)."""
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in description.items() if k != "rule"}
    return rule_class(description["rule"])(**params)


def cost_model(name: str, **hyper_parameters) -> MatrixRule:
    """A rule with the given hyper-parameters (defaults otherwise), used as a cost model."""
    return rule_class(name)(**hyper_parameters)


from .muon import MuonRule  # noqa: E402
from .shampoo import ShampooRule  # noqa: E402
from .soap import SOAPRule  # noqa: E402

register_rule(MuonRule, "CanzonaMuon")
register_rule(ShampooRule, "CanzonaShampoo")
register_rule(SOAPRule, "CanzonaSOAP")

__all__ = ["MatrixInfo", "MatrixRule", "MuonRule", "OPTIMIZER_TYPES", "RULES", "SOAPRule", "ShampooRule",
           "apply_rule_update", "apply_update", "cost_model", "rule_step", "register_rule", "rule_class", "rule_from_description"]
