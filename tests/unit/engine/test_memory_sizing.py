"""The KV pool is sized from the memory the process may still use, less what its largest
step takes: read from made-up cgroup and meminfo texts here, and profiled with the real
model once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.actors.executor.memory import (
    DEFAULT_CPU_KV_MAX_BYTES,
    _cgroup_v1_dirs,
    cgroup_room,
    host_available_bytes,
    size_kv_pool,
    status_bytes,
)

MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:   16000000 kB
Buffers:          100000 kB
"""
GIB = 1 << 30


def test_without_a_cgroup_limit_the_host_has_what_meminfo_calls_available():
    assert host_available_bytes(MEMINFO, []) == 16000000 * 1024
    assert host_available_bytes(MEMINFO, [("max\n", "123456\n")]) == 16000000 * 1024


def test_a_cgroup_limit_leaves_its_room_and_the_tightest_level_counts():
    assert cgroup_room(f"{4 * GIB}\n", f"{GIB}\n") == 3 * GIB
    levels = [("max\n", "5\n"), (f"{8 * GIB}\n", f"{6 * GIB}\n"), (f"{4 * GIB}\n", f"{GIB}\n")]
    assert host_available_bytes(MEMINFO, levels) == 2 * GIB
    # a limit above what the machine has free does not make more of it
    assert host_available_bytes(MEMINFO, [(f"{64 * GIB}\n", "0\n")]) == 16000000 * 1024
    assert cgroup_room(f"{GIB}\n", f"{2 * GIB}\n") == 0  # over its limit: nothing left


def test_a_cgroup_v1_limit_counts_and_its_no_limit_number_does_not(tmp_path):
    unlimited = "9223372036854771712\n"  # what v1 writes for "no limit"
    assert cgroup_room(unlimited, f"{GIB}\n") is None
    levels = [(unlimited, "7\n"), (f"{4 * GIB}\n", f"{3 * GIB}\n")]
    assert host_available_bytes(MEMINFO, levels) == GIB
    # the memory controller's line names the group under the v1 mount, with its ancestors
    group = tmp_path / "memory" / "jobs" / "one"
    group.mkdir(parents=True)
    text = "9:pids:/jobs/one\n4:cpuacct,memory:/jobs/one\n0::/\n"
    assert _cgroup_v1_dirs(text, tmp_path) == [group, group.parent, tmp_path / "memory"]
    # in a cgroup namespace the group's path is not under the mount: the mount is the group
    assert _cgroup_v1_dirs("4:memory:/elsewhere\n", tmp_path) == [tmp_path / "memory"]
    assert _cgroup_v1_dirs("0::/user.slice\n", tmp_path) == []  # a v2-only machine


def test_with_no_meminfo_field_a_cgroup_limit_still_answers():
    assert host_available_bytes("MemTotal: 1 kB\n", [(f"{2 * GIB}\n", f"{GIB}\n")]) == GIB
    with pytest.raises(MemoryError):
        host_available_bytes("MemTotal: 1 kB\n", [("max\n", "0\n")])


def test_status_fields_are_read_in_bytes():
    status = "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n"
    assert status_bytes(status, "VmRSS") == 100 * (1 << 20)
    assert status_bytes(status, "VmHWM") == 200 * (1 << 20)
    assert status_bytes(status, "VmSwap") == 0


def test_the_pool_gets_the_fraction_of_what_the_largest_step_leaves_up_to_its_cap():
    sizing = size_kv_pool(10 * GIB, 2 * GIB, 1 << 20, fraction=0.5, max_bytes=None)
    assert sizing.kv_bytes == 4 * GIB and sizing.num_blocks == 4096
    capped = size_kv_pool(10 * GIB, 2 * GIB, 1 << 20, fraction=0.5, max_bytes=GIB)
    assert capped.num_blocks == 1024
    with pytest.raises(MemoryError, match="no room for a KV pool"):
        size_kv_pool(GIB, 2 * GIB, 1 << 20, fraction=0.9, max_bytes=None)


def test_an_unsized_pool_is_profiled_on_the_real_model(smollm_model, smollm_path):
    from sluice.actors.executor.runner import ModelRunner

    runner = ModelRunner(model=smollm_model, model_path=smollm_path, profile_tokens=64)
    sizing = runner.kv_sizing
    # in this long-lived process the allocator may serve the step from pages it already
    # holds, so the growth of the peak RSS can be 0 here (a worker is a fresh process: below)
    assert sizing is not None and sizing.profile_peak_bytes >= 0
    assert sizing.kv_bytes <= DEFAULT_CPU_KV_MAX_BYTES  # the CPU cap
    assert runner.num_blocks == sizing.kv_bytes // runner.bytes_per_block
    small = ModelRunner(model=smollm_model, model_path=smollm_path, profile_tokens=64,
                        kv_memory_fraction=0.5, kv_max_bytes=64 * runner.bytes_per_block)
    assert small.num_blocks == 64
    explicit = ModelRunner(model=smollm_model, model_path=smollm_path, num_blocks=8)
    assert explicit.num_blocks == 8 and explicit.kv_sizing is None  # num_blocks wins


def test_a_fresh_process_sees_its_largest_step_take_memory(smollm_path):
    """What a worker measures at its start: the profiled step's peak above what it held."""
    script = (
        "from sluice.actors.executor.runner import ModelRunner;"
        f"r = ModelRunner({str(smollm_path)!r}, profile_tokens=256);"
        "print(r.kv_sizing.profile_peak_bytes, r.kv_sizing.available_bytes, r.num_blocks)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    peak, available, blocks = map(int, done.stdout.split()[-3:])
    assert 0 < peak < available and blocks >= 2
