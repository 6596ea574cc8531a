"""Argument checks for the Triton launchers: shared helpers and paged attention's checks.

Everything a kernel would silently get wrong (a wrong dtype, a non-unit inner stride, a block
id past the pool) is refused here with an error that names the argument. Shape, dtype and
stride checks read only metadata; the checks on index *values* need one device-to-host copy,
so their verdict is remembered for the exact tensors (same objects, unmodified) that passed:
a model calls a launcher once per layer with the same step metadata and pays that copy once.
Nothing here imports triton.
"""

from __future__ import annotations

import contextlib
import math
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


def on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make the tensor's GPU the current one for a launch: Triton launches on the current."""
    if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


class ValidatedValues:
    """Remembers which index tensors already passed a value check, by identity and version.

    Holding only weak references means a freed tensor can never be mistaken for a new one
    that happens to reuse its id; the version counter catches in-place edits made through
    torch (not writes behind its back, such as through a shared numpy array).
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


_validated_attention_metadata = ValidatedValues()


def check_window_and_softcap(window: int, softcap: float) -> None:
    """Raise naming `window` (keys per query, 0 for none) or `softcap` (0 for off) if invalid."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no window), got {window!r}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) \
            or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")


def check_attention_arguments(query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, block_tables: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              scale: float) -> None:
    """Raise TypeError/ValueError naming the paged-attention argument the kernel cannot take.

    The value checks (ids inside the pool, lengths consistent) cost one device-to-host copy,
    paid once per set of step metadata tensors.
    """
    require_tensor("query", query, 3)
    require_tensor("key_cache", key_cache, 4)
    require_tensor("value_cache", value_cache, 4)
    require_tensor("block_tables", block_tables, 2)
    require_tensor("query_start_loc", query_start_loc, 1)
    require_tensor("seq_lens", seq_lens, 1)
    require_same_device({
        "query": query, "key_cache": key_cache, "value_cache": value_cache,
        "block_tables": block_tables, "query_start_loc": query_start_loc, "seq_lens": seq_lens,
    })

    require_dtype("query", query, FLOAT_DTYPES)
    require_same_dtype("key_cache", key_cache, "query", query)
    require_same_dtype("value_cache", value_cache, "query", query)
    require_dtype("block_tables", block_tables, INDEX_DTYPES)
    require_dtype("query_start_loc", query_start_loc, INDEX_DTYPES)
    require_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) \
            or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")

    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache has shape {tuple(value_cache.shape)} but key_cache has "
                         f"{tuple(key_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, cache_head_dim = key_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"query has head_dim {head_dim} but key_cache has {cache_head_dim}")
    if head_dim > 256:
        raise ValueError(f"query head_dim {head_dim} is larger than the kernel's 256")
    if kv_heads == 0 or num_heads % kv_heads != 0:
        raise ValueError(f"query has {num_heads} heads, not a multiple of key_cache's "
                         f"{kv_heads} KV heads")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"key_cache block_size must be a power of two, got {block_size}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries; "
                         f"seq_lens has {num_seqs} sequences, so it needs {num_seqs + 1}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} "
                         "sequences in seq_lens")

    require_unit_inner_stride("query", query)
    require_contiguous("key_cache", key_cache)
    require_contiguous("value_cache", value_cache)
    require_contiguous("block_tables", block_tables)
    require_contiguous("query_start_loc", query_start_loc)
    require_contiguous("seq_lens", seq_lens)

    def validate() -> None:
        _check_metadata_values(block_tables, query_start_loc, seq_lens, num_tokens,
                               num_blocks, block_size)

    _validated_attention_metadata.check([block_tables, query_start_loc, seq_lens],
                                        (num_tokens, num_blocks, block_size), validate)


def _check_metadata_values(block_tables, query_start_loc, seq_lens, num_tokens, num_blocks,
                           block_size) -> None:
    """All value checks in one device-to-host copy; the slow hunt for details only on failure."""
    if seq_lens.shape[0] == 0:
        if num_tokens != 0:
            raise ValueError(f"query has {num_tokens} tokens but seq_lens holds no sequence")
        return
    starts = query_start_loc.long()
    lengths = seq_lens.long()
    q_lens = starts[1:] - starts[:-1]
    capacity = block_tables.shape[1] * block_size
    blocks_used = (lengths + block_size - 1) // block_size
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = cols[None, :] < blocks_used[:, None]
    ids = block_tables.long()
    bad_ids = used & ((ids < 0) | (ids >= num_blocks))
    flags = torch.stack([
        starts[0] != 0,
        starts[-1] != num_tokens,
        (q_lens < 0).any(),
        (lengths < 0).any(),
        (q_lens > lengths).any(),
        (lengths > capacity).any(),
        bad_ids.any(),
    ]).tolist()
    if not any(flags):
        return

    def first(mask: torch.Tensor) -> int:
        return int(mask.nonzero()[0, 0])

    if flags[0]:
        raise ValueError(f"query_start_loc must start at 0, got {int(starts[0])}")
    if flags[1]:
        raise ValueError(f"query_start_loc must end at the query's {num_tokens} tokens, got "
                         f"{int(starts[-1])}")
    if flags[2]:
        raise ValueError(f"query_start_loc must be non-decreasing; it falls after sequence "
                         f"{first(q_lens < 0)}")
    if flags[3]:
        i = first(lengths < 0)
        raise ValueError(f"seq_lens[{i}] is negative ({int(lengths[i])})")
    if flags[4]:
        i = first(q_lens > lengths)
        raise ValueError(f"sequence {i} has {int(q_lens[i])} query tokens but seq_lens[{i}] "
                         f"is only {int(lengths[i])}")
    if flags[5]:
        i = first(lengths > capacity)
        raise ValueError(f"seq_lens[{i}] = {int(lengths[i])} exceeds the {capacity} tokens "
                         f"block_tables can address ({block_tables.shape[1]} blocks of "
                         f"{block_size})")
    row, col = (int(x) for x in bad_ids.nonzero()[0])
    raise ValueError(f"block_tables[{row}, {col}] = {int(ids[row, col])} is outside the pool "
                     f"of {num_blocks} blocks")
