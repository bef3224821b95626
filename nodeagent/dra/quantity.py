"""Kubernetes resource quantities (``30Gi``, ``32212254720``, ``1.5G``, ``500m``, ``1e3``) as exact numbers (pure).

The API serialises every ``resource.Quantity`` as such a string; the DRA driver reads the capacity an
allocation consumed (``consumedCapacity``) and writes capacities and request policies in them.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY_RE = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")
MAX_LEN = 64

MIB = 1 << 20


def parse_quantity(text: str) -> Fraction:
    """The exact value of a quantity string; ValueError naming it when it is not one."""
    s = text.strip() if isinstance(text, str) else ""
    m = _QUANTITY_RE.match(s) if len(s) <= MAX_LEN else None
    if m is None:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    number, exponent, suffix = Fraction(m.group(1)), m.group(2), m.group(3) or ""
    if exponent:
        e = int(exponent[1:])
        if abs(e) > 30:
            raise ValueError(f"quantity exponent out of range: {text!r}")
        return number * Fraction(10) ** e
    if suffix in _BINARY:
        return number * Fraction(1 << (10 * _BINARY[suffix]))
    return number * Fraction(10) ** _DECIMAL[suffix]


def quantity_int(text: str) -> int:
    """The quantity rounded up to a whole number (as the API's ``Value()``)."""
    return math.ceil(parse_quantity(text))


def mebibytes(n_bytes: int) -> str:
    """A byte count of whole MiB as a quantity (``31457280`` → ``30Mi``); other counts as plain bytes."""
    return f"{n_bytes // MIB}Mi" if n_bytes % MIB == 0 else str(n_bytes)
