"""The C ABI's status codes as Python exceptions, each carrying the library's message."""
from __future__ import annotations

from ._lib import lib


class EssError(Exception):
    """An ESS call failed; `status` is the C status name, the message says what, where and which value."""

    status = "ESS_ERROR"


class InvalidArgument(EssError, ValueError):
    status = "ESS_ERROR_INVALID_ARGUMENT"


class InvalidType(InvalidArgument, TypeError):
    """An argument of the wrong type (a float, bool or string where an integer is meant, ...): an InvalidArgument
    that is also a TypeError."""


class OutOfMemory(EssError, MemoryError):
    status = "ESS_ERROR_OUT_OF_MEMORY"


class Unavailable(EssError, RuntimeError):
    status = "ESS_ERROR_UNAVAILABLE"


class DeviceError(EssError, RuntimeError):
    status = "ESS_ERROR_DEVICE"


class InternalError(EssError, RuntimeError):
    status = "ESS_ERROR_INTERNAL"


_BY_CODE = {1: InvalidArgument, 2: OutOfMemory, 3: Unavailable, 4: DeviceError, 5: InternalError}


def raise_for(code: int):
    message = lib.ess_last_error().decode("utf-8", "replace")
    raise _BY_CODE.get(code, InternalError)(message)


def check(code: int):
    if code != 0:
        raise_for(code)
