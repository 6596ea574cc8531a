"""A real `sluiced` on the embedded model, with a real worker process, over real sockets.

After every test the fixture waits for the daemon to have no live request and checks the KV
invariant with no block left in use.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import trio

from sluice.ipc.client import AsyncClient

PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "The sky is",
    "My favourite food is", "In 1492,", "Water boils at", "The best way to learn is",
]


def prompt_ids(offline_greedy, i: int) -> list[int]:
    return offline_greedy.tokenizer.encode(f"{PROMPTS[i % len(PROMPTS)]} ({i})")


async def stream_one(address: str, ids: list[int], max_tokens: int, results: dict, key) -> None:
    async with AsyncClient(address, credit_window=4, daemon_timeout=60) as client:
        generation = await client.generate(prompt_ids=ids, max_tokens=max_tokens, temperature=0)
        streamed = []
        async for chunk in generation:
            streamed.extend(chunk.token_ids)
        assert streamed == generation.result.token_ids
        results[key] = generation.result


async def test_32_concurrent_clients_match_offline_greedy(model_daemon, offline_greedy) -> None:
    results: dict = {}
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            for i in range(32):
                nursery.start_soon(stream_one, model_daemon.listen, prompt_ids(offline_greedy, i),
                                   8, results, i)
    expected = offline_greedy.batch([prompt_ids(offline_greedy, i) for i in range(32)], 8)
    for i in range(32):
        assert results[i].token_ids == expected[i], i
        assert results[i].finish_reason in ("length", "stop")


async def test_cancel_mid_stream_releases_kv_at_once(model_daemon) -> None:
    with trio.fail_after(120):
        async with AsyncClient(model_daemon.listen, credit_window=1) as client:
            before = (await model_daemon.status()).counters.cancelled
            generation = await client.generate("Count from one to a hundred:", max_tokens=200,
                                               temperature=0, ignore_eos=True)
            async for _ in generation:
                break
            await generation.cancel()
            rest = [chunk async for chunk in generation]
            assert generation.result.finish_reason == "cancelled"
            assert len(rest) < 200
            report = await model_daemon.status()
            assert report.kv.used_blocks == 0
            assert report.counters.cancelled == before + 1


CLIENT_SCRIPT = textwrap.dedent("""
    import sys
    from sluice.ipc.client import Client
    with Client(sys.argv[1], heartbeat_interval=0.5) as client:
        for chunk in client.generate("Write a long story about a dragon.", max_tokens=400,
                                      ignore_eos=True):
            print("chunk", flush=True)
""")


async def test_killed_client_is_released_and_others_unaffected(model_daemon, offline_greedy) -> None:
    before = await model_daemon.status()
    victim = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, model_daemon.listen],
                              stdout=subprocess.PIPE, text=True)
    results: dict = {}
    try:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_one, model_daemon.listen, prompt_ids(offline_greedy, 1),
                                   16, results, "other")
                line = await trio.to_thread.run_sync(victim.stdout.readline)
                assert line.startswith("chunk")
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                # released within the heartbeat timeout (2 s here), plus a scheduling tick
                with trio.fail_after(10):
                    while True:
                        report = await model_daemon.status()
                        if report.counters.cancelled > before.counters.cancelled:
                            break
                        await trio.sleep(0.1)
    finally:
        victim.kill()
    assert results["other"].token_ids == offline_greedy(prompt_ids(offline_greedy, 1), 16)


async def test_slow_client_is_paused_then_timed_out(model_daemon, offline_greedy) -> None:
    results: dict = {}
    with trio.fail_after(120):
        async with AsyncClient(model_daemon.listen, credit_window=1) as slow:
            generation = await slow.generate("Tell me about the ocean.", max_tokens=300,
                                             temperature=0, ignore_eos=True)
            async for _ in generation:
                break  # and then stop reading
            with trio.fail_after(30):
                while (await model_daemon.status()).requests.paused == 0:
                    await trio.sleep(0.05)
            async with trio.open_nursery() as nursery:  # others keep streaming meanwhile
                nursery.start_soon(stream_one, model_daemon.listen, prompt_ids(offline_greedy, 2),
                                   8, results, "other")
            with trio.fail_after(30):  # pause_timeout is 2 s here
                while (await model_daemon.status()).requests.paused:
                    await trio.sleep(0.1)
            async for _ in generation:
                pass
    result = generation.result
    assert result.finish_reason == "timeout"
    # decoding stopped near the high watermark (4 buffered chunks), far from max_tokens
    assert result.usage.completion_tokens <= 16
    assert results["other"].token_ids == offline_greedy(prompt_ids(offline_greedy, 2), 8)


async def test_worker_killed_mid_decode_loses_nothing(model_daemon, offline_greedy) -> None:
    before = await model_daemon.status()
    results: dict = {}
    chunks_seen = trio.Event()

    async def watched(i: int) -> None:
        async with AsyncClient(model_daemon.listen, credit_window=4) as client:
            generation = await client.generate(prompt_ids=prompt_ids(offline_greedy, i),
                                               max_tokens=16, temperature=0)
            async for chunk in generation:
                if chunk.token_ids and i == 0:
                    chunks_seen.set()
            results[i] = generation.result

    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(watched, i)
            await chunks_seen.wait()
            os.kill(before.worker.pid, signal.SIGKILL)
    expected = offline_greedy.batch([prompt_ids(offline_greedy, i) for i in range(6)], 16)
    for i in range(6):
        assert results[i].token_ids == expected[i], i
    after = await model_daemon.status()
    assert after.worker.restarts == before.worker.restarts + 1
    assert after.worker.pid != before.worker.pid and after.worker.state == "ready"
    assert sum(r.usage.recomputed_tokens for r in results.values()) > 0
    with trio.fail_after(60):  # and it keeps serving
        await stream_one(model_daemon.listen, prompt_ids(offline_greedy, 7), 4, results, "later")
