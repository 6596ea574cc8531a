"""The daemon process never runs a model, so it never loads torch: the model's files are read
without it and only the worker process loads it. Read from the running processes' memory
maps, after the daemon served a request on both fronts."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import trio

from sluice.ipc.client import AsyncClient


def mapped_libraries(pid: int) -> set[str]:
    names = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6:
            names.add(Path(parts[5]).name)
    return names


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def loads_torch(pid: int) -> bool:
    return any(name.startswith("libtorch") for name in mapped_libraries(pid))


async def test_only_the_worker_process_loads_torch(model_daemon) -> None:
    async with AsyncClient(model_daemon.listen) as client:
        generation = await client.generate("The capital of France is", max_tokens=2)
        assert (await generation.collect()).finish_reason == "length"
    base = f"http://{model_daemon.http}/v1"
    models = await trio.to_thread.run_sync(lambda: urllib.request.urlopen(f"{base}/models"))
    body = json.dumps({"model": json.load(models)["data"][0]["id"], "max_tokens": 2,
                       "prompt": "The capital of France is"}).encode()
    request = urllib.request.Request(f"{base}/completions", body,
                                     {"Content-Type": "application/json"})
    answer = await trio.to_thread.run_sync(lambda: urllib.request.urlopen(request, timeout=60))
    assert json.load(answer)["choices"][0]["finish_reason"] == "length"
    daemon = model_daemon.process.pid
    workers = [pid for pid in children(daemon) if loads_torch(pid)]
    assert workers, "no worker process with torch loaded: the check could not see it"
    assert not loads_torch(daemon)
