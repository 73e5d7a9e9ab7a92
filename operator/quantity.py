"""Kubernetes resource quantities ("500m", "1.5Gi", "1e3") as exact numbers, so desired and live objects compare
by value.

The API server stores quantities in canonical form ("0.5" becomes "500m", "1000m" becomes "1", "4096Mi"
becomes "4Gi"), so a string comparison of what the operator wants with what it reads back never settles.
The grammar is apimachinery's ``resource.Quantity``: a signed decimal number, then a binary suffix (Ki..Ei),
a decimal one (n, u, m, k, M..E) or a decimal exponent (e3, E-2). Values finer than a nano are rounded up to
one, as the API server does.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation, localcontext

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_PATTERN = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+|[numkMGTPE]?)$")
_NANO = Decimal("1e-9")


def parse(value: str | int | float) -> Decimal:
    """The quantity's exact value; ValueError when it is not a Kubernetes quantity."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        value = repr(value)
    match = _PATTERN.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a quantity (e.g. 500m, 2, 1.5Gi, 1e3)")
    number, suffix = match.groups()
    try:
        amount = Decimal(number)
    except InvalidOperation:  # the pattern admits only decimals; kept for safety
        raise ValueError(f"{value!r} is not a quantity") from None
    if suffix in _BINARY:
        amount *= Decimal(1024) ** _BINARY[suffix]
    elif suffix[:1] in ("e", "E") and len(suffix) > 1:
        amount = amount.scaleb(int(suffix[1:]))
    else:
        amount = amount.scaleb(_DECIMAL[suffix])
    exponent = amount.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -9:
        with localcontext() as ctx:
            ctx.prec = 80  # exact for every quantity the grammar allows up to 10^36 (a few E)
            amount = amount.quantize(_NANO, rounding=ROUND_CEILING)
    return amount


def equal(a: object, b: object) -> bool:
    """Whether two quantities have the same value (values that are not quantities: when their text is equal)."""
    if a == b or str(a) == str(b):
        return True
    if not isinstance(a, (str, int, float)) or not isinstance(b, (str, int, float)):
        return False
    try:
        return parse(a) == parse(b)
    except ValueError:
        return False
