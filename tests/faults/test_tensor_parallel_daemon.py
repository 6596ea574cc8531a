"""A daemon whose worker is a tensor-parallel group (`[worker] tensor_parallel = 2`, CPU,
gloo) serves the embedded model's float32 greedy tokens as one process does, and fails as
one worker: a rank killed, or stopped inside a collective past the step deadline, brings the
whole group down and back, every in-flight request finishes once with the same tokens, no KV
is left held and no rank of the old group survives. A rank may also run as its own process
and join over TCP with CURVE; a key the daemon does not list is refused."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
import trio
import zmq

from sluice.actors.engine import Engine
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import SamplingParams

pytestmark = pytest.mark.timeout(400)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small",
           "The three primary colours are"]
NEW_TOKENS = 24


def config_text(step_timeout: float = 300.0, threads: int = 2) -> str:
    return f"""
[worker]
tensor_parallel = 2
dtype = "float32"
num_blocks = 128
threads = {threads}
backoff_initial = 0.05
step_timeout = {step_timeout}
"""


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """One process's float32 greedy tokens for PROMPTS (the in-process engine)."""
    engine = Engine(dtype="float32", num_blocks=128)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = [c.token_ids for c in engine.generate(PROMPTS, params)]
    engine.scheduler.check_invariants()
    return tokens


def gone(pid: int) -> bool:
    """No such process, or only its unreaped exit status."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def wait_gone(pids, seconds: float = 10.0) -> None:
    with trio.fail_after(seconds):
        while not all(gone(p) for p in pids):
            await trio.sleep(0.05)


def start(daemon_process, tmp_path, step_timeout: float = 300.0):
    config = tmp_path / "sluiced.toml"
    config.write_text(config_text(step_timeout))
    _, listen, control = daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    return listen, control


async def generate_while(listen: str, fault) -> list:
    """PROMPTS generated concurrently; `fault()` runs once every request has a token."""
    async with AsyncClient(listen, daemon_timeout=240) as client:
        generations = [await client.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                             ignore_eos=True) for p in PROMPTS]
        for generation in generations:
            async for _ in generation:
                break
        fault()
        return [await g.collect() for g in generations]


async def test_a_two_rank_group_serves_one_process_tokens_and_a_killed_rank_recomputes(
    daemon_process, drained_and_consistent, expected, tmp_path
) -> None:
    listen, control = start(daemon_process, tmp_path)
    first = await fetch_status(control)
    ranks = first.worker.rank_pids
    assert len(ranks) == 2 and ranks[0] == first.worker.pid and len(set(ranks)) == 2
    shown = subprocess.run([sys.executable, "-m", "sluice.daemon.cli", "status",
                            "--connect-control", control], capture_output=True, text=True,
                           timeout=60)
    assert f"tensor parallel 2 ranks   pids {ranks[0]} {ranks[1]}" in shown.stdout, shown
    with trio.fail_after(300):
        async with AsyncClient(listen, daemon_timeout=240) as client:
            calm = [await (await client.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                                 ignore_eos=True)).collect() for p in PROMPTS]
        assert [r.token_ids for r in calm] == expected
        results = await generate_while(listen, lambda: os.kill(ranks[1], signal.SIGKILL))
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    assert [r.token_ids for r in results] == expected
    after = await fetch_status(control)
    assert after.worker.restarts == first.worker.restarts + 1
    assert after.worker.state == "ready" and not set(after.worker.rank_pids) & set(ranks)
    await wait_gone(ranks)  # the old group's rank 0 went with its rank 1
    await drained_and_consistent(control)


async def test_a_rank_stopped_inside_a_step_brings_the_group_down_at_the_step_deadline(
    daemon_process, drained_and_consistent, expected, tmp_path
) -> None:
    listen, control = start(daemon_process, tmp_path, step_timeout=3.0)
    first = await fetch_status(control)
    ranks = first.worker.rank_pids
    with trio.fail_after(300):
        # rank 1 stopped: rank 0 waits in the step's collective until the deadline
        results = await generate_while(listen, lambda: os.kill(ranks[1], signal.SIGSTOP))
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    assert [r.token_ids for r in results] == expected
    after = await fetch_status(control)
    assert after.worker.restarts >= first.worker.restarts + 1
    await wait_gone(ranks)  # the stopped rank was killed with its group, not left behind
    await drained_and_consistent(control)


# -- a rank on another host: its own process, joining over TCP with CURVE -------------------

def key_file(folder, name: str, secret: str):
    path = folder / name
    path.write_text(secret)
    path.chmod(0o600)
    return path


def free_tcp_port() -> int:
    """A port free now and below the ephemeral range, as an operator's join_listen would be:
    one the kernel hands out may be taken again by any process's next connection or bind
    (a rank's retries, the group's store) before the worker binds it."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for port in random.sample(range(max(1024, low - 8000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def start_rank(address: str, server_public: str, secret_file, log, *extra: str):
    return subprocess.Popen(
        [sys.executable, "-m", "sluice.daemon.main", "worker", "--join", address, "--rank", "1",
         "--server-key", server_public, "--secret-key-file", str(secret_file), "--threads", "1",
         *extra], stdout=log, stderr=subprocess.STDOUT)


async def test_a_rank_joining_over_tcp_serves_with_the_group_and_a_stranger_is_refused(
    daemon_process, drained_and_consistent, expected, tmp_path
) -> None:
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    rank_public, rank_secret = (k.decode() for k in zmq.curve_keypair())
    _, stranger_secret = (k.decode() for k in zmq.curve_keypair())
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    rank_log = open(tmp_path / "rank.log", "wb")
    ranks = [start_rank(address, server_public, key_file(tmp_path, "rank.key", rank_secret),
                        rank_log)]
    try:
        config = tmp_path / "sluiced.toml"
        config.write_text(config_text(threads=1) + f"""startup_timeout = 120
join_hosts = ["127.0.0.1"]
join_listen = "{address}"
join_secret_key_file = "{key_file(tmp_path, 'worker.key', server_secret)}"
join_public_keys = ["{rank_public}"]
""")
        _, listen, control = daemon_process(
            ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
             "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
        first = await fetch_status(control)
        assert first.worker.rank_pids == (first.worker.pid, 0)  # rank 1: another host's
        with trio.fail_after(300):
            async with AsyncClient(listen, daemon_timeout=240) as client:
                calm = [await (await client.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                                     ignore_eos=True)).collect()
                        for p in PROMPTS]
            assert [r.token_ids for r in calm] == expected
            # a stranger's key is refused at the handshake; the group serves on
            stranger = subprocess.run(
                [sys.executable, "-m", "sluice.daemon.main", "worker", "--join", address,
                 "--rank", "1", "--server-key", server_public, "--secret-key-file",
                 str(key_file(tmp_path, "stranger.key", stranger_secret)), "--once"],
                capture_output=True, text=True, timeout=120)
            assert stranger.returncode == 77, stranger.stderr[-2000:]
            assert "refused" in stranger.stderr
            # the joined rank killed under load: the group goes down; a rank started again
            # (as its service manager would) joins the next group, and every request
            # finishes once with the same tokens
            def kill_and_restart() -> None:
                ranks[0].kill()
                ranks.append(start_rank(address, server_public, tmp_path / "rank.key",
                                        rank_log))

            results = await generate_while(listen, kill_and_restart)
        assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
        assert [r.token_ids for r in results] == expected
        after = await fetch_status(control)
        assert after.worker.restarts >= first.worker.restarts + 1
        await drained_and_consistent(control)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
        rank_log.close()


def test_offline_generate_on_two_ranks_prints_one_process_tokens(expected) -> None:
    """`sluice generate --offline --tensor-parallel 2`: the embedded model on a group of two
    processes in float32, the same greedy tokens; no rank left when it returns."""
    done = subprocess.Popen(
        [sys.executable, "-m", "sluice.daemon.cli", "generate", "--offline", "--tensor-parallel",
         "2", "--dtype", "float32", "--prompt", PROMPTS[0], "--max-tokens", str(NEW_TOKENS),
         "--ignore-eos", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # its session id is its pid: every rank it started has it
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-2000:]
    assert json.loads(out)["token_ids"] == expected[0]  # the report alone on stdout
    deadline = time.monotonic() + 10
    while in_session(done.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = in_session(done.pid)
    assert not left, [open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in left]


def in_session(session: int) -> list[int]:
    """Live processes of a session."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] not in ("Z", "X"):
                found.append(int(entry))
    return found
