"""Byte counts, shared by the cache planner (`mla_jax.capacity`) and the weights planner (`mla_jax.weights_plan`):
exact integer arithmetic and binary-unit printing (KiB = 1024 B, MiB = 1024**2 B, GiB = 1024**3 B)."""

from __future__ import annotations

import numbers
from decimal import ROUND_DOWN, Decimal


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers, exactly."""
    return -(-a // b)


def positive_int(name: str, value: object) -> int:
    """`value` as an int when it is a positive integer (not a bool); else a one-line ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
_MAX_DECIMALS = 6


def format_bytes(n: int) -> str:
    """A byte count in binary units: 1023 -> "1023 B", 1536 -> "1.5 KiB", 9059696640 -> "8.4375 GiB",
    685082400000 -> "638.03 GiB".

    The largest unit not above `n`: exact where six decimals hold the value (8.4375 GiB), else cut to two
    decimals (never up to the next unit: 1024**2 - 1 -> "1023.99 KiB"), trailing zeros trimmed.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"n must be a non-negative integer number of bytes, got {n!r}")
    n = int(n)
    if n < 1024:
        return f"{n} B"
    exp = 1
    while exp < len(_UNITS) and n >= 1024 ** (exp + 1):
        exp += 1
    # Decimal division of an integer by a power of two is exact at this precision.
    value = Decimal(n) / Decimal(1024**exp)
    exact = value.quantize(Decimal(1).scaleb(-_MAX_DECIMALS))
    text = f"{exact if exact == value else value.quantize(Decimal('0.01'), ROUND_DOWN):f}".rstrip("0").rstrip(".")
    return f"{text} {_UNITS[exp - 1]}"
