"""DeepSpeed integration: the only package that knows DeepSpeed internals (pinned version).

``install()`` registers ``"type": "CanzonaMuon"`` with DeepSpeed's engine; ``import
canzona_ds`` arranges for it to run as soon as ``deepspeed`` is imported.
"""
from __future__ import annotations


def install() -> None:
    """Register CanzonaMuon with DeepSpeed now (imports deepspeed)."""
    from canzona_ds.integration.deepspeed_zero1 import install as _install

    _install()
