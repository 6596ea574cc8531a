"""Argument checks shared by the Triton launchers.

Everything a kernel would silently get wrong (a wrong dtype, a non-unit inner stride, a block
id past the pool) is refused here with an error that names the argument. Shape, dtype and
stride checks read only metadata; the checks on index *values* need one device-to-host copy,
so their verdict is remembered for the exact tensors (same objects, unmodified) that passed:
a model calls a launcher once per layer with the same step metadata and pays that copy once.
Nothing here imports triton.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def require_tensor(name: str, value: object, ndim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def require_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype {names}; got {str(tensor.dtype)[6:]}")


def require_same_dtype(name: str, tensor: torch.Tensor, other_name: str,
                       other: torch.Tensor) -> None:
    if tensor.dtype != other.dtype:
        raise TypeError(f"{name} has dtype {str(tensor.dtype)[6:]} but {other_name} has "
                        f"{str(other.dtype)[6:]}; they must match")


def require_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {tensor.stride()} for shape "
                         f"{tuple(tensor.shape)}); call .contiguous() first")


def require_unit_inner_stride(name: str, tensor: torch.Tensor) -> None:
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 along head_dim, got strides "
                         f"{tensor.stride()}; call .contiguous() first")


def require_same_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {first_name} is on {first}; "
                             "all arguments must be on one device")
    if first.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors, got {first_name} on {first} "
                         "(use the torch reference on CPU, or set TRITON_INTERPRET=1 before "
                         "importing triton)")
    return first


class ValidatedValues:
    """Remembers which index tensors already passed a value check, by identity and version.

    Holding only weak references means a freed tensor can never be mistaken for a new one
    that happens to reuse its id; the version counter catches in-place edits.
    """

    def __init__(self) -> None:
        self._refs: tuple[weakref.ref, ...] = ()
        self._versions: tuple[int, ...] = ()
        self._extra: tuple = ()

    def check(self, tensors: Sequence[torch.Tensor], extra: tuple,
              validate: Callable[[], None]) -> None:
        """Run `validate()` unless these same tensors with these `extra` facts passed last time."""
        if any(t.is_inference() for t in tensors):
            validate()  # inference tensors keep no version counter: edits would go unseen
            return
        versions = tuple(t._version for t in tensors)
        if (
            len(self._refs) == len(tensors)
            and all(ref() is t for ref, t in zip(self._refs, tensors))
            and self._versions == versions
            and self._extra == extra
        ):
            return
        self._refs = ()
        validate()
        self._refs = tuple(weakref.ref(t) for t in tensors)
        self._versions = versions
        self._extra = extra
