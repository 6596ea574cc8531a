"""How many KV blocks the worker's pool gets: memory it may still use, less what its largest
step needs, times `kv_memory_fraction`.

The memory a process may use on the host is read from text (`/proc/meminfo`, the memory
files of the process's cgroup and its ancestors — cgroup v2's `memory.max` and
`memory.current`, or v1's `memory.limit_in_bytes` and `memory.usage_in_bytes` —,
`/proc/self/status`) by plain functions
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
# cgroup v1 writes "no limit" as the largest page-aligned counter (2^63 - 4096 on x86-64)
_V1_UNLIMITED = 1 << 62


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
    """What one cgroup level leaves: its limit (v2 `memory.max`, v1 `memory.limit_in_bytes`)
    minus its use (`memory.current`, `memory.usage_in_bytes`); None without a limit (v2's
    "max", v1's huge number)."""
    limit = memory_max.strip()
    if limit == "max" or int(limit) >= _V1_UNLIMITED:
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
            return _with_ancestors(root / line[3:].strip().lstrip("/"), root)
    return [root]


def _cgroup_v1_dirs(proc_cgroup: str, root: Path) -> list[Path]:
    """This process's cgroup v1 memory directory and its ancestors; [] without one."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)  # hierarchy id, controllers, path
        if len(parts) == 3 and "memory" in parts[1].split(","):
            mount = root / "memory"
            folder = mount / parts[2].strip().lstrip("/")
            # in a cgroup namespace the mount shows the process's own group as its root
            return _with_ancestors(folder if folder.is_dir() else mount, mount)
    return []


def _with_ancestors(path: Path, root: Path) -> list[Path]:
    return [path, *(p for p in path.parents if p.is_relative_to(root))]


_LEVEL_FILES = (("memory.max", "memory.current"),  # v2
                ("memory.limit_in_bytes", "memory.usage_in_bytes"))  # v1


def read_host_available(root: Path = CGROUP_ROOT) -> int:
    levels = []
    try:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        proc_cgroup = ""
    for folder in [*_cgroup_dirs(proc_cgroup, root), *_cgroup_v1_dirs(proc_cgroup, root)]:
        for limit, usage in _LEVEL_FILES:
            try:
                levels.append(((folder / limit).read_text(), (folder / usage).read_text()))
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
