"""The few array operations the adapters need, for numpy arrays and torch tensors alike (torch is
used only when the engine hands torch tensors in; it is never imported otherwise)."""
from __future__ import annotations

import numpy as np


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def empty_int32(shape, like):
    """An int32 array of `shape` of the same kind and device as `like`."""
    if is_torch(like):
        import torch
        return torch.empty(shape, dtype=torch.int32, device=like.device)
    return np.empty(shape, dtype=np.int32)


def arange_int32(n, like):
    if is_torch(like):
        import torch
        return torch.arange(n, dtype=torch.int32, device=like.device)
    return np.arange(n, dtype=np.int32)


def copy_into(dst, src):
    """dst[...] = src with an integer cast (int64 -> int32: the values are checked by the library)."""
    if is_torch(dst):
        if is_torch(src):
            dst.copy_(src.reshape(dst.shape))
        else:
            import torch
            dst.copy_(torch.as_tensor(np.asarray(src)).reshape(dst.shape))
    else:
        src = src.cpu().numpy() if is_torch(src) else np.asarray(src)
        np.copyto(dst, src.reshape(dst.shape), casting="unsafe")


def mask_from(rows, arange, count):
    """rows[i] = -1 for i >= count (count an int, or a one-element array/tensor on the rows' device)."""
    if isinstance(count, (int, np.integer)):
        rows[int(count):] = -1
    elif is_torch(rows):
        rows.masked_fill_(arange[: rows.shape[0]] >= count.reshape(()), -1)
    else:
        rows[int(np.asarray(count).reshape(())):] = -1


def replace_value(a, value, by):
    """a[a == value] = by, in place."""
    if is_torch(a):
        a.masked_fill_(a == value, by)
    else:
        a[a == value] = by


def host_ints(x):
    """A host numpy copy of an integer array or tensor."""
    if is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def same_memory(a, b) -> bool:
    if a is b:
        return True
    if is_torch(a) and is_torch(b):
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
                and a.dtype == b.dtype)
    return False
