"""The worker's command line: a replacement worker gets what the first one settled."""

from __future__ import annotations

from sluice.actors.runtime.base import Outbox
from sluice.actors.executor.actor import Executor, WorkerSpec
from sluice.actors.runtime.reports import WorkerFacts


def _flags(cmd: list[str]) -> dict[str, str]:
    return {flag: value for flag, value in zip(cmd, cmd[1:]) if flag.startswith("--")}


def test_a_replacement_worker_keeps_the_first_one_s_dtypes_and_pool(tmp_path) -> None:
    executor = Executor(WorkerSpec(runtime_dir=str(tmp_path)), scheduler=Outbox("inproc://x"))
    first = _flags(executor._command("ipc://w"))
    # the first resolves `auto` itself (it measures) and sizes its pool from memory
    assert (first["--dtype"], first["--kv-dtype"]) == ("auto", "auto")
    assert "--num-blocks" not in first
    executor.facts = WorkerFacts(num_blocks=1456, block_size=16, max_model_len=8192,
                                 vocab_size=49152, dtype="float32", kv_dtype="float32")
    again = _flags(executor._command("ipc://w"))
    assert (again["--dtype"], again["--kv-dtype"], again["--num-blocks"]) == (
        "float32", "float32", "1456")
    executor.close()
