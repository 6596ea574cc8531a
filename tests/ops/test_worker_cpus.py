"""`[worker] cpus` pins the model worker, every thread of it, to the CPUs named, and serves;
a list that names no CPU of the machine is refused when the config is read, naming the key."""

from __future__ import annotations

import os

import pytest
import trio

from sluice.daemon.config import load_config
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("value, says", [
    ("[]", "non-empty list"),
    ('["0"]', "non-empty list"),
    ("[-1]", "non-empty list"),
    ("0", "non-empty list"),
    ("[100000]", "no CPU 100000"),
])
def test_cpus_that_name_no_cpu_are_refused(tmp_path, value, says) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(f"[worker]\ncpus = {value}\n")
    with pytest.raises(ValueError, match=f"worker.cpus: .*{says}"):
        load_config(config)


def test_cpus_are_kept_sorted_and_once(tmp_path) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text("[worker]\ncpus = [0, 0]\n")
    assert load_config(config).worker.cpus == (0,)


async def test_the_worker_and_all_its_threads_run_on_the_cpus_named(
    daemon_process, tmp_path
) -> None:
    cpu = max(os.sched_getaffinity(0))  # one this test may use, whatever the machine
    config = tmp_path / "sluiced.toml"
    config.write_text(f"[worker]\nnum_blocks = 64\ncpus = [{cpu}]\n")
    _, listen, control = daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"])
    worker = (await fetch_status(control)).worker.pid
    with trio.fail_after(120):
        async with AsyncClient(listen, daemon_timeout=60) as client:
            result = await (await client.generate(prompt="Hello", max_tokens=4,
                                                  temperature=0)).collect()
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    threads = [int(t) for t in os.listdir(f"/proc/{worker}/task")]
    assert len(threads) > 1  # torch's pools, the parent watch: all of them are pinned
    assert {tid: os.sched_getaffinity(tid) for tid in threads} == \
        {tid: {cpu} for tid in threads}
