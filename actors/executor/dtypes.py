"""Which dtypes the weights and the KV pool use: the names users give, and what `auto` means.

`auto` (the default everywhere: daemon, `sluice generate`, `Engine`) picks bfloat16 where the
hardware multiplies it natively — a CPU with AVX512-BF16 or AMX-BF16 (or Arm BF16) on which
a bf16 matmul, measured once at start, is at least as fast as an fp32 one; a CUDA GPU with
bf16 support — float16 on older CUDA GPUs, and float32 elsewhere. It detects and measures;
it never guesses from the vendor. The KV pool follows the weights unless `kv_dtype` says
otherwise. Nothing here loads a model.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
_CPUINFO = Path("/proc/cpuinfo")
# x86 flags of the native bf16 dot-product / tile instructions; Arm lists "bf16" in Features
_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A concrete dtype by name (`auto` is resolved by `resolve_dtypes`, not here)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}") from None


def resolve_dtypes(dtype: str | torch.dtype, kv_dtype: str | torch.dtype | None,
                   device: str | torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(weights dtype, KV dtype) for `device`; `auto` and None mean the default above."""
    weights = auto_dtype(device) if dtype == "auto" else parse_dtype(dtype)
    kv = weights if kv_dtype in (None, "auto") else parse_dtype(kv_dtype)
    return weights, kv


def auto_dtype(device: str | torch.device) -> torch.dtype:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu_has_native_bf16() and cpu_bf16_matmul_pays():
        return torch.bfloat16
    return torch.float32


@functools.cache
def cpu_has_native_bf16() -> bool:
    flags = _cpu_flags()
    if flags is not None:
        return bool(flags & _BF16_CPU_FLAGS)
    return _bf16_matmul_is_faster()  # no /proc/cpuinfo (macOS, sandboxes): measure instead


def _cpu_flags() -> set[str] | None:
    try:
        text = _CPUINFO.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


@functools.cache
def cpu_bf16_matmul_pays() -> bool:
    """Whether torch's bf16 matmul on this CPU is at least as fast as its fp32 one. A CPU can
    list the bf16 instructions while the matmul library still runs bf16 slower than fp32
    (measured on one such machine: 175 against 345 GFLOP/s at 2048^3, and the offline
    workload 23% slower in bf16); then bf16 would only cost precision."""
    return _bf16_matmul_is_faster(n=1024)


def _bf16_matmul_is_faster(n: int = 512, repeats: int = 3) -> bool:
    """Best-of-N square matmul: emulated bf16 is slower than fp32, native is faster."""
    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warm up (allocations, kernel choice)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - started)
        return min(times)

    return best(torch.bfloat16) < best(torch.float32)
