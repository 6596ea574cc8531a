"""The CPU attention backend that reads the paged KV pool in place (`csrc/paged_attention_cpu.cpp`).

Same signature as `reference.paged_attention`, which stays the definition it is tested
against. The C++ op is compiled at first use with torch's extension tooling and cached under
`TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), one build per CPU kind,
checkout and source, so only the first start of a checkout (or of a changed source) on a
machine pays for the build. Where it cannot be built (no compiler, no ninja, a failed build)
or `SLUICE_CPU_PAGED=off` says so, `available()` is False, the reason is logged once and the
dispatch in `sluice.kernels` runs the reference instead.

What runs where was decided by measurement (one core, SmolLM2 shapes: 9 heads, 3 kv heads,
head_dim 64): decodes, and chunks of up to `MAX_IN_PLACE_QUERY` tokens, read the pool in place
(a decode over a 300-token context: several times faster than gather + SDPA). Longer prefill
chunks keep the reference's gather + SDPA: SDPA's tiled GEMMs beat this per-row loop by 2-3x
there, and a chunk's gather is paid once for all its query tokens, not once per token as a
decode's is.

`fixed_order=True` (the engine's deterministic mode) sends every chunk, however long, through
the op and has it sum every row's scores the same way: a query row's output then depends only
on its own query and the keys it sees, not on the batch, the chunk it came in or whether its
prefix was cached.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import structlog
import torch

from sluice.kernels import checks, reference

__all__ = ["available", "unavailable_reason", "paged_attention", "reshape_and_cache",
           "threads_used", "DISABLE_ENV", "MAX_IN_PLACE_QUERY"]

log = structlog.get_logger("sluice.kernels")

DISABLE_ENV = "SLUICE_CPU_PAGED"  # "off" (or 0/false/no): behave as if the build failed
# query tokens up to which a chunk reads the pool in place; past about 8 gather + SDPA wins
MAX_IN_PLACE_QUERY = 4
FIXED_ORDER_ALL_IN_PLACE = 1 << 30  # max_in_place_query of `fixed_order`: every chunk
STALE_LOCK_SECONDS = 600.0  # a build takes well under a minute; ten is a dead builder
SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
# built into the same library: the sampler's full-vocabulary race (`sluice.kernels.race`) and
# the decoder's fused elementwise steps (`sluice.kernels.elementwise`)
SOURCES = (SOURCE, SOURCE.with_name("sampling_race_cpu.cpp"), SOURCE.with_name("fused_cpu.cpp"))
# compile flags per ISA that torch itself detected on this CPU; the ISA is part of the
# extension's name, so a cache shared between machines never loads a build for another CPU
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}

_lock = threading.Lock()
_op = None  # the loaded torch op, once built
_reason: str | None = None  # why it is unavailable, once tried and failed


def _disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("off", "0", "false", "no")


def _registered_op():
    """The op if this process already loaded its library, else None."""
    try:
        return torch.ops.sluice_cpu.paged_attention_into
    except (AttributeError, RuntimeError):
        return None


def _build():
    from torch.utils import cpp_extension

    # a process loads the library once: a second copy (another cache dir, a version torch's
    # extension tooling bumped) registers the op's namespace again, and that aborts
    loaded = _registered_op()
    if loaded is not None:
        return loaded

    # a `pip install ninja` lands beside this interpreter, which is not on PATH when the
    # daemon is started as .venv/bin/sluiced without activating the virtualenv
    scripts = os.path.dirname(sys.executable)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + scripts
    cpp_extension.verify_ninja_availability()
    capability = torch.backends.cpu.get_cpu_capability()
    isa = capability if capability in _ISA_FLAGS else "DEFAULT"
    # and the checkout: torch rebuilds whenever the build file's source path changes, so two
    # checkouts sharing one cache would rebuild (and block on each other's lock) in turn
    checkout = hashlib.sha256(str(SOURCE.resolve()).encode()).hexdigest()[:8]
    # OpenMP: at::parallel_for is compiled into the op, and without it runs every work item on
    # the calling thread whatever torch's thread count (the op shares torch's libgomp). No
    # contraction of a product and a sum into one FMA where the source does not ask for one:
    # the fused elementwise ops round as torch's separate ops do
    cflags = ["-O3", "-fopenmp", "-ffp-contract=off", *_ISA_FLAGS.get(isa, [])]
    # and the source itself and its flags: a changed op (its schema too) is always a fresh
    # build, never a cached library of the old source that ninja's timestamps took for up to
    # date
    source = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES)
                            + " ".join(cflags).encode()).hexdigest()[:8]
    name = f"sluice_paged_attention_cpu_{isa.lower()}_{checkout}_{source}"
    _clear_stale_lock(Path(cpp_extension._get_build_directory(name, False)) / "lock")
    cpp_extension.load(
        name=name,
        sources=[str(s) for s in SOURCES],
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.sluice_cpu.paged_attention_into


def _clear_stale_lock(lock: Path) -> None:
    """torch waits forever on the lock file of a build whose process was killed mid-way (a
    worker stopped during its first start): a lock older than any build can be is removed."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
            log.warning("removed a stale torch extension build lock", path=str(lock))
    except FileNotFoundError:
        pass


def _load():
    """The op, building it on first call; None (and the reason logged once) if unavailable."""
    global _op, _reason
    if _op is not None or _reason is not None:
        return _op
    with _lock:
        if _op is not None or _reason is not None:
            return _op
        if _disabled_by_env():
            _reason = f"{DISABLE_ENV} turns it off"
        else:
            started = time.perf_counter()
            try:
                _op = _build()
            except Exception as exc:  # any build or load failure: the reference still serves
                # a compiler's error sits at the end of its output
                _reason = f"build failed: {type(exc).__name__}: ...{str(exc)[-300:]}"
            else:
                log.info("cpu paged attention ready",
                         seconds=round(time.perf_counter() - started, 2))
        if _reason is not None:
            log.warning("cpu paged attention unavailable, using the torch reference",
                        reason=_reason)
    return _op


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _reason


def _forget() -> None:
    """Tests only: try loading again at the next call, as a fresh process would."""
    global _op, _reason
    with _lock:
        _op, _reason = None, None


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`reference.reshape_and_cache` as one copy per token, for key, value and caches of one
    dtype (rows of key and value may lie apart, as views into the qkv projection do); a slot
    outside the pool is an error before anything is written. Needs `available()`."""
    if key.stride(-1) != 1 or key.stride(-2) != key.shape[-1]:
        key = key.contiguous()
    if value.stride(-1) != 1 or value.stride(-2) != value.shape[-1]:
        value = value.contiguous()
    torch.ops.sluice_cpu.reshape_and_cache_into(key_cache, value_cache, key, value,
                                                slot_mapping.to(torch.int64))


def threads_used(items: int = 64) -> int:
    """How many threads the ops' `at::parallel_for` runs `items` work items on at torch's
    current thread count (1 would mean a build without OpenMP: every op on one thread).
    Needs `available()`."""
    return int(torch.ops.sluice_cpu.threads_used(items))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float,
                    max_in_place_query: int = MAX_IN_PLACE_QUERY, *, window: int = 0,
                    softcap: float = 0.0, fixed_order: bool = False) -> torch.Tensor:
    """`reference.paged_attention`, reading the pool in place for every sequence with at most
    `max_in_place_query` query tokens; needs `available()`. With a `window` the op visits
    only the blocks inside it: a windowed decode costs O(window), whatever its context.
    `fixed_order`: every sequence in place, each row reduced in one order (see above)."""
    checks.check_window_and_softcap(window, softcap)
    op = _load()
    if op is None:
        raise RuntimeError(f"cpu paged attention is unavailable: {_reason}")
    if fixed_order:
        max_in_place_query = FIXED_ORDER_ALL_IN_PLACE
        if query.dtype != key_cache.dtype:
            # the op reads one dtype: the query in the pool's, as the reference's SDPA takes it
            return paged_attention(query.to(key_cache.dtype), key_cache, value_cache,
                                   block_tables, query_start_loc, seq_lens, scale,
                                   window=window, softcap=softcap,
                                   fixed_order=True).to(query.dtype)
    if not query.dtype == key_cache.dtype == value_cache.dtype:
        # the op reads one dtype; a mixed call is rare enough to leave to the reference
        return reference.paged_attention(query, key_cache, value_cache, block_tables,
                                          query_start_loc, seq_lens, scale, window=window,
                                          softcap=softcap)
    query = query.contiguous()
    out = torch.empty_like(query)
    op(out, query, key_cache, value_cache, block_tables.to(torch.int32).contiguous(),
       query_start_loc.to(torch.int32), seq_lens.to(torch.int32), float(scale), int(window),
       float(softcap), int(max_in_place_query), bool(fixed_order))
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    block_size = key_cache.shape[1]
    for i, ctx_len in enumerate(lengths):
        q_len = starts[i + 1] - starts[i]
        if q_len > max_in_place_query:
            # the reference's own chunk path, so long chunks stay exactly what they were
            reference._attend_chunk(query, key_cache, value_cache, block_tables[i], starts[i],
                                    q_len, ctx_len, block_size, scale, out, window, softcap)
    return out
