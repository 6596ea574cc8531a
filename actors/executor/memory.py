"""How many KV blocks the worker's pool gets: memory it may still use, less what its largest
step needs, times `kv_memory_fraction`.

The memory a process may use on the host is read from text (`/proc/meminfo`, the cgroup v2
files of the process's cgroup and its ancestors, `/proc/self/status`) by plain functions
that take that text, so they are tested with made-up files; `read_*` do the reading. The
profiled forward itself is the runner's; this module only turns measurements into blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_KV_MEMORY_FRACTION = 0.9  # of what remains after the weights and the profiled forward
# On CPU the pool is capped at 1 GiB unless `kv_max_bytes` says otherwise: host memory is
# shared with the daemon, the page cache and every other process, MemAvailable moves under
# us, and `torch.zeros` touches every page of the pool at start. 1 GiB holds 40k tokens of
# the embedded model's KV in float32, far more than a CPU can compute in useful time.
DEFAULT_CPU_KV_MAX_BYTES = 1 << 30

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class KVSizing:
    """What the pool was sized from, for the worker's log line."""

    available_bytes: int  # memory the process could still use before the profiled forward
    profile_peak_bytes: int  # what the profiled forward took at its peak
    kv_bytes: int  # what the pool may take: fraction * (available - peak), capped
    bytes_per_block: int
    num_blocks: int


def size_kv_pool(available_bytes: int, profile_peak_bytes: int, bytes_per_block: int, *,
                 fraction: float, max_bytes: int | None) -> KVSizing:
    """Blocks for `fraction` of what remains once the largest step has its memory."""
    remaining = max(0, available_bytes - profile_peak_bytes)
    kv_bytes = int(fraction * remaining)
    if max_bytes is not None:
        kv_bytes = min(kv_bytes, max_bytes)
    num_blocks = kv_bytes // bytes_per_block
    if num_blocks < 2:
        raise MemoryError(
            f"no room for a KV pool: {available_bytes} bytes available, the largest step "
            f"takes {profile_peak_bytes}, a block needs {bytes_per_block}; lower the "
            "scheduler's token_budget or set [worker] num_blocks")
    return KVSizing(available_bytes, profile_peak_bytes, kv_bytes, bytes_per_block, num_blocks)


# -- host memory ------------------------------------------------------------------------------


def meminfo_available(meminfo: str) -> int | None:
    """MemAvailable of a `/proc/meminfo` text, in bytes; None when it does not say."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # the kernel writes kB (KiB)
    return None


def cgroup_room(memory_max: str, memory_current: str) -> int | None:
    """What one cgroup v2 level leaves: `memory.max` minus `memory.current`; None without
    a limit ("max")."""
    limit = memory_max.strip()
    if limit == "max":
        return None
    return max(0, int(limit) - int(memory_current.strip()))


def host_available_bytes(meminfo: str, cgroup_levels: list[tuple[str, str]]) -> int:
    """What this process may still take: the tightest of its cgroups' limits (each level as
    its `memory.max` and `memory.current` texts) and the machine's MemAvailable — a limit
    above the memory the machine has free does not make more of it."""
    rooms = [room for level in cgroup_levels if (room := cgroup_room(*level)) is not None]
    available = meminfo_available(meminfo)
    if available is not None:
        rooms.append(available)
    if not rooms:
        raise MemoryError("cannot tell the memory available: no MemAvailable, no cgroup limit")
    return min(rooms)


def status_bytes(status: str, field: str) -> int:
    """A kB field of `/proc/self/status` (VmRSS, VmHWM), in bytes; 0 when absent."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    return 0


def _cgroup_dirs(proc_cgroup: str, root: Path) -> list[Path]:
    """This process's cgroup v2 directory and its ancestors (each may hold a limit)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            path = root / line[3:].strip().lstrip("/")
            return [path, *(p for p in path.parents if p.is_relative_to(root))]
    return [root]


def read_host_available(root: Path = CGROUP_ROOT) -> int:
    levels = []
    try:
        dirs = _cgroup_dirs(Path("/proc/self/cgroup").read_text(), root)
    except OSError:
        dirs = []
    for folder in dirs:
        try:
            levels.append(((folder / "memory.max").read_text(),
                           (folder / "memory.current").read_text()))
        except OSError:
            continue  # the root has no memory.max; a level may hide its files
    return host_available_bytes(Path("/proc/meminfo").read_text(), levels)


def read_status() -> str:
    return Path("/proc/self/status").read_text()


def reset_peak_rss() -> bool:
    """Restart VmHWM (the peak RSS) from the current RSS; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
