"""Invalid optimizer settings, generated from the config dataclasses themselves.

For every key every Canzona optimizer type accepts (``optimizer.params`` and the
``canzona_tp`` section), :func:`invalid_settings` yields values of the wrong type, ``null``,
non-finite numbers, values outside the documented range, and misspelt keys, plus malformed
sections.  Each case names the key a clear error must name.  ``tests/test_config_fuzz.py``
asserts every case is refused that way; ``benchmarks/config_fuzz.py`` counts them for the
bad-input table in docs/benchmarks.md.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Any, Iterator

from canzona_ds.optim import OPTIMIZER_TYPES, rule_class
from canzona_ds.config import CommonKeys, PlacementConfig, TPConfig


@dataclass(frozen=True)
class Case:
    optimizer_type: str
    params: Any
    tp_section: Any
    #: text the error message must contain (the key as written)
    names: str
    what: str


#: values outside every numeric key's documented range (all ranges are finite and >= -100)
OUT_OF_RANGE = (-1e30, 1e30)
NON_FINITE = (float("nan"), float("inf"), -float("inf"))


def _field_type(cls, f) -> Any:
    return typing.get_type_hints(cls)[f.name]


def _bad_values(hint) -> list[tuple[Any, str]]:
    """(value, description) pairs invalid for a field annotated ``hint``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    optional = type(None) in args
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        hint = inner[0] if inner else hint
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    out: list[tuple[Any, str]] = []
    if not optional:
        out.append((None, "null"))
    if hint is bool:
        out += [("yes", "string for a bool"), (1, "int for a bool")]
    elif hint is int:
        out += [(2.5, "fractional count"), (-1, "negative count"), (10**12, "count beyond the limit"),
                ("3", "string for an int"), (True, "bool for an int")]
    elif hint is float:
        out += [("0.1", "string for a number"), ([0.1], "list for a number"), (True, "bool for a number")]
        out += [(v, f"non-finite {v}") for v in NON_FINITE]
        out += [(v, f"out of range {v:g}") for v in OUT_OF_RANGE]
    elif hint is str:
        out += [("no-such-choice", "unknown choice"), (3, "number for a string")]
    elif origin is tuple and args and args[-1] is Ellipsis:  # list of strings
        out += [("embed", "string for a list"), ([1], "number in a list of names"), ([""], "empty name")]
    elif origin is tuple:  # fixed-length tuple of numbers
        n = len(args)
        out += [(0.5, "number for a list"), ([0.5] * (n + 1), f"{n + 1} values for {n}"),
                (["a"] * n, "strings for numbers"), ([1e30] * n, "out-of-range values"),
                ([float("nan")] * n, "non-finite values")]
    return out


def _keys_of(opt_type: str) -> list[tuple[str, Any]]:
    """(key as written in optimizer.params, its type) for every key of ``opt_type``."""
    rule = rule_class(OPTIMIZER_TYPES[opt_type])
    aliases = dict(rule.config_aliases)
    out = []
    for cls in (CommonKeys, PlacementConfig):
        for f in fields(cls):
            out.append((f.name, _field_type(cls, f)))
    for f in fields(rule):
        if f.name not in aliases:
            out.append((f.name, _field_type(rule, f)))
    for alias, target in aliases.items():
        hint = float if target in ("lr_matrix", "adam_eps") else tuple[float, float]
        out.append((alias, hint))
    return out


def invalid_settings() -> Iterator[Case]:
    for opt_type in sorted(OPTIMIZER_TYPES):
        for key, hint in _keys_of(opt_type):
            if key == "per_head_muon" and opt_type != "CanzonaMuon":
                yield Case(opt_type, {key: True}, None, key, "per_head_muon on a non-Muon rule")
                continue
            if key == "qk_clip":  # a section: {"threshold": tau}
                for value, what in ((3, "number for a section"), ({"threshold": -1.0}, "negative threshold"),
                                    ({"threshold": float("nan")}, "non-finite threshold"),
                                    ({"threshold": "a"}, "string threshold"), ({"thresholdx": 1.0}, "misspelt key")):
                    yield Case(opt_type, {key: value}, None, key, what)
                yield Case(opt_type, {key + "x": 1}, None, key + "x", "misspelt key")
                continue
            for value, what in _bad_values(hint):
                yield Case(opt_type, {key: value}, None, key, what)
            yield Case(opt_type, {key + "x": 1}, None, key + "x", "misspelt key")
        for params, what in (([0.02], "params as a list"), ("lr=0.02", "params as a string"), (3, "params as a number")):
            yield Case(opt_type, params, None, "optimizer.params", what)
    for f in fields(TPConfig):
        for value, what in _bad_values(_field_type(TPConfig, f)):
            if f.name == "c_max" and value in (None, 1e30):
                continue  # null = the default; any finite c_max > 0 is valid (one micro-group)
            yield Case("CanzonaMuon", {}, {f.name: value}, f"canzona_tp.{f.name}", what)
    yield Case("CanzonaMuon", {}, {"strategy": "sc"}, "canzona_tp.strategy", "removed key")
    yield Case("CanzonaMuon", {}, {"c_mx": 5}, "c_mx", "misspelt key")
    yield Case("CanzonaMuon", {}, [1], "canzona_tp", "section not an object")


def check(case: Case) -> tuple[bool, str]:
    """(refused with a message naming the key, the message)."""
    from canzona_ds.config import CanzonaConfig

    try:
        CanzonaConfig.from_ds(case.optimizer_type, case.params, case.tp_section)
    except (ValueError, TypeError) as err:
        msg = str(err)
        return case.names in msg, msg
    return False, "accepted"
