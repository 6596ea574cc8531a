"""SIGTERM drains everything the daemon holds before it exits: prompts still tokenizing get
their answer, and a slow reader's stream still sends every chunk and its Finished."""

from __future__ import annotations

import signal

import trio

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import DrainingError

# ~36k tokens, tokenized off the trio thread in a few tenths of a second each
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 4000
CONFIG = """
[null]
max_model_len = 40000
"""


async def _answer_of(client: AsyncClient, prompt: str, answers: list) -> None:
    try:
        generation = await client.generate(prompt, max_tokens=4)
    except DrainingError:
        answers.append("draining")
        return
    answers.append((await generation.collect()).finish_reason)


async def test_sigterm_waits_for_tokenizing_prompts_and_a_slow_readers_finished(
    tmp_path, daemon_process, drained_and_consistent,
) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    process, listen, control = daemon_process(
        ["--config", str(config), "--executor", "null", "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock", "--drain-deadline", "60",
         "--pause-timeout", "60"],
        log=tmp_path / "sluiced.log",
    )
    with trio.fail_after(60):
        async with AsyncClient(listen, credit_window=1, daemon_timeout=5.0) as client:
            # fewer chunks than the high watermark (32): it is never paused, it ends
            slow = await client.generate("hi", max_tokens=30)
            async for _ in slow:
                break  # the rest, and its Finished, wait in the stream for our credits
            while (await fetch_status(control)).counters.finished < 1:
                await trio.sleep(0.02)  # the scheduler is done with it: nothing runs

            answers: list = []
            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(_answer_of, client, LONG_PROMPT, answers)
                # one long prompt is through the tokenizer and admitted, the rest are still
                # being tokenized (each takes tenths of a second) when the drain begins
                while (await fetch_status(control)).counters.accepted < 2:
                    await trio.sleep(0.02)
                process.send_signal(signal.SIGTERM)
                # the daemon is still up for us (it holds our Finished): check its KV now,
                # then come back late, as a slow reader does
                await drained_and_consistent(control)
                await trio.sleep(1.0)
                async for _ in slow:
                    await trio.sleep(0.05)
            assert slow.result.finish_reason == "length"
            assert len(slow.result.token_ids) == 30
            # each tokenizing prompt got a clear answer: served once admitted before the drain,
            # else refused as draining — never dropped, and not all refused
            assert len(answers) == 6
            assert set(answers) <= {"length", "draining"}
            assert "length" in answers, answers
        code = await trio.to_thread.run_sync(process.wait)
    assert code == 0
