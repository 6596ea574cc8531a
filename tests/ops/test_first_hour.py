"""What a newcomer meets in the first commands: `sluice generate` asks the local daemon unless
told `--offline` (and says at once, naming the address, when no daemon runs there); the
offline form says it loads the model, and when it is done; `sluice bench`'s default load
generates its full length; `--help` gives defaults; `--version` gives the version."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from sluice.daemon import version
from sluice.daemon.cli import build_parser
from sluice.daemon.commands.generate import DEFAULT_CONNECT

pytestmark = pytest.mark.timeout(300)


def sluice(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice.daemon.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def _listening(address: str) -> bool:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_generate_asks_the_local_daemon_by_default_and_says_none_runs_there() -> None:
    if _listening(DEFAULT_CONNECT):
        pytest.skip(f"something listens at {DEFAULT_CONNECT} on this machine")
    result = sluice("generate", "--prompt", "hi", timeout=30)
    assert result.returncode == 2, result.stderr
    assert f"no daemon at {DEFAULT_CONNECT}" in result.stderr
    assert "--offline" in result.stderr and "Traceback" not in result.stderr


def test_generate_names_a_missing_ipc_socket(tmp_path) -> None:
    address = f"ipc://{tmp_path}/nobody.sock"
    result = sluice("generate", "--connect", address, "--prompt", "hi", timeout=30)
    assert result.returncode == 2, result.stderr
    assert f"no daemon at {address}" in result.stderr and "--offline" in result.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm_tokenizer):
    """A one-layer random-weight Llama folder as transformers writes one, with the embedded
    model's tokenizer: it loads in a moment."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("tiny-model")
    config = transformers.LlamaConfig(
        vocab_size=smollm_tokenizer.backend.get_vocab_size(), hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    smollm_tokenizer.backend.save(str(folder / "tokenizer.json"))
    return folder


def test_offline_generate_says_it_loads_the_model_and_when_it_is_done(tiny_model) -> None:
    result = sluice("generate", "--offline", "--model", str(tiny_model), "--prompt-ids",
                    "1,2,3", "--max-tokens", "2", "--ignore-eos", "--json", timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    loading = [line for line in lines if line.startswith("loading model")]
    assert loading and tiny_model.name in loading[0] and "MB)" in loading[0], lines
    done = [line for line in lines if line.startswith("model loaded in")]
    assert done and lines.index(done[0]) > lines.index(loading[0]), lines
    assert '"token_ids"' in result.stdout  # the answer alone on stdout


def test_bench_generates_its_full_length_unless_told_otherwise() -> None:
    parser = build_parser("bench")
    assert parser.parse_args(["bench"]).ignore_eos is True
    assert parser.parse_args(["bench", "--no-ignore-eos"]).ignore_eos is False
    assert "--no-ignore-eos" in sluice("bench", "--help").stdout


def test_help_gives_the_defaults() -> None:
    text = " ".join(sluice("generate", "--help").stdout.split())
    assert "--max-tokens MAX_TOKENS (default: 128)" in text
    assert "--temperature TEMPERATURE (default: 0.0)" in text
    assert DEFAULT_CONNECT in text


@pytest.mark.parametrize("module, prog", [("sluice.daemon.cli", "sluice"),
                                          ("sluice.daemon.main", "sluiced")])
def test_version_prints_the_package_version(module, prog) -> None:
    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{prog} {version()}" and version()
