"""Quantization formats: how many bits each keeps, which formats a routing name stands for, and
which ones lose precision against the weights a model ships in.

Stage 01's precision policy and stage 02's pricing of the endpoints routing may pick both read
these, so that "fp4" means the same endpoints to both.
"""

from __future__ import annotations

BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "mxfp8": 8, "int8": 8, "fp6": 6,
        "int4": 4, "fp4": 4, "mxfp4": 4, "nvfp4": 4}

# OpenRouter's `quantizations` routing filter: a family name also lets its variants through
FAMILIES = {"fp4": {"fp4", "mxfp4", "nvfp4"}, "fp8": {"fp8", "mxfp8"}}


def below_native(quantization: str, native: str) -> bool:
    """True when serving at `quantization` loses precision against `native` weights: fewer bits,
    or as many bits in another format (int4 QAT weights re-quantized to fp4/nvfp4 lose accuracy)."""
    if quantization == native or quantization not in BITS:
        return False
    return BITS[quantization] <= BITS[native]


def routed(quantizations) -> set[str]:
    """The formats a `quantizations` routing list lets serve, its families' variants included."""
    names = set(quantizations)
    for family, members in FAMILIES.items():
        if family in names:
            names |= members
    return names
