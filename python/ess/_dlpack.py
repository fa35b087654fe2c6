"""DLPack export of any tensor (numpy, torch, CuPy...): the DLTensor pointer the C ABI reads."""
from __future__ import annotations

import ctypes

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Exported:
    """A tensor's DLPack capsule, kept alive with the tensor while the C side holds its pointer.

    The capsule is never consumed (its name stays "dltensor"), so its destructor releases the
    producer's DLManagedTensor when this object goes."""

    __slots__ = ("obj", "capsule", "pointer")

    def __init__(self, obj, capsule, pointer):
        self.obj = obj
        self.capsule = capsule
        self.pointer = pointer


def export(obj, what: str) -> Exported:
    """The DLTensor of `obj` (anything with __dlpack__, or a "dltensor" capsule)."""
    from ._errors import InvalidArgument

    if hasattr(obj, "__dlpack__"):
        try:
            capsule = obj.__dlpack__()
        except (BufferError, TypeError, RuntimeError, ValueError) as e:
            raise InvalidArgument(f"{what}: cannot export it through DLPack: {e}") from None
    elif type(obj).__name__ == "PyCapsule":
        capsule = obj
    else:
        raise InvalidArgument(f"{what}: a {type(obj).__name__} has no __dlpack__ (pass a numpy array, a torch "
                              "tensor or another DLPack producer)")
    if not _is_valid(capsule, b"dltensor"):
        raise InvalidArgument(f"{what}: its DLPack capsule is not an unconsumed 'dltensor'")
    # DLManagedTensor begins with its DLTensor: the same address.
    return Exported(obj, capsule, _get_pointer(capsule, b"dltensor"))


def maybe(obj, what: str):
    return None if obj is None else export(obj, what)
