"""canzona-ds: exact, load-balanced matrix optimizers (Muon) for DeepSpeed ZeRO-1 and
Megatron-style tensor parallelism, after the Canzona paper.

``import canzona_ds`` registers ``"type": "CanzonaMuon"`` for DeepSpeed's ds_config.
Importing is cheap: DeepSpeed itself is imported only when an engine is built.
"""
__version__ = "0.1.0"
