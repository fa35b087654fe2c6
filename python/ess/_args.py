"""Argument checks before anything reaches ctypes (which would cut an int down to the C type's width,
truncate a float, take a bool as 1 or raise its own ArgumentError): each refusal names the parameter and
is an ess exception, InvalidType (a TypeError) for a wrong type, InvalidArgument (a ValueError) for a
value out of range."""
from __future__ import annotations

import math
import numbers
import operator
from os import PathLike

from ._errors import InvalidArgument, InvalidType

I32 = (-2**31, 2**31 - 1)
I64 = (-2**63, 2**63 - 1)
U64 = (0, 2**64 - 1)


def integer(name: str, value, lo: int, hi: int) -> int:
    """`value` as a Python int in [lo, hi]: an int or numpy integer, never a bool, float or string."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise InvalidType(f"{name} = {value!r}: a bool where an integer is meant")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidType(f"{name} = {value!r}: an integer is expected, not {type(value).__name__}") from None
    if not lo <= v <= hi:
        raise InvalidArgument(f"{name} = {v}: an integer in [{lo}, {hi}] is expected")
    return v


def i32(**values):
    for name, value in values.items():
        integer(name, value, *I32)


def i64(**values):
    for name, value in values.items():
        integer(name, value, *I64)


def real(name: str, value, finite: bool = True) -> float:
    """A real number (int or float, numpy's too; not a bool or a string)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_" or not isinstance(value, numbers.Real):
        raise InvalidType(f"{name} = {value!r}: a number is expected, not {type(value).__name__}")
    v = float(value)
    if finite and not math.isfinite(v):
        raise InvalidArgument(f"{name} = {v}: a finite number is expected")
    return v


def flag(name: str, value) -> bool:
    """A bool (Python's or numpy's): 'false', 0.0 or None are not flags."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise InvalidType(f"{name} = {value!r}: True or False is expected, not {type(value).__name__}")


def text(name: str, value, path: bool = False) -> str:
    if isinstance(value, str):
        return value
    if path and isinstance(value, PathLike):
        return str(value)
    raise InvalidType(f"{name} = {value!r}: a string{' or path' if path else ''} is expected, "
                      f"not {type(value).__name__}")


def choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise (InvalidArgument if isinstance(value, str) else InvalidType)(
            f"{name} = {value!r}: one of {sorted(choices)}")
    return value


def handle(name: str, value, attrs=("cuda_stream", "ptr", "handle")):
    """A CUDA stream or event as an address: None, an int, or an object carrying one in `attrs`
    (torch.cuda.Stream.cuda_stream, CuPy's .ptr, torch.cuda.Event.cuda_event)."""
    if value is None:
        return None
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise InvalidType(f"{name} = {value!r}: a bool is not a CUDA stream or event")
    if not isinstance(value, numbers.Integral):
        for attr in attrs:
            inner = getattr(value, attr, None)
            if isinstance(inner, numbers.Integral) and not isinstance(inner, bool):
                value = inner
                break
        else:
            raise InvalidType(f"{name}: {type(value).__name__} is not a CUDA stream or event (an int, "
                              "torch.cuda.Stream / Event or CuPy stream)")
    return integer(name, value, *U64) or None
