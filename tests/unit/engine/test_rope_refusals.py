"""Rope scalings sluice cannot run as transformers runs them are refused at load, in one line
naming the file, the field and the value, and `sluiced serve` exits before a worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sluice.actors.executor.loader import ModelLoadError, read_model_config

transformers = pytest.importorskip("transformers")

PHI3_YARN = {"factor": 4.0, "original_max_position_embeddings": 64}


def write_config(folder, model_type: str, field: str, rope: dict) -> None:
    raw = dict(model_type=model_type, vocab_size=300, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
    (folder / "config.json").write_text(json.dumps({**raw, field: rope}))
    (folder / "model.safetensors").write_bytes(b"")  # the config is refused before weights


def refusal(folder) -> str:
    with pytest.raises(ModelLoadError) as refused:
        read_model_config(folder)
    message = str(refused.value)
    assert str(folder / "config.json") in message and "\n" not in message
    return message


def test_transformers_reads_a_phi3_yarn_as_longrope() -> None:
    """Why a Phi-3 "yarn" is refused rather than run as the other families' yarn."""
    config = transformers.Phi3Config(rope_scaling={"type": "yarn", "short_factor": [1.0] * 8,
                                                   "long_factor": [2.0] * 8, **PHI3_YARN},
                                     hidden_size=64, num_attention_heads=4,
                                     max_position_embeddings=256)
    assert config.rope_parameters["rope_type"] == "longrope"


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("spelling", ["type", "rope_type"])
def test_a_phi3_rope_type_other_than_longrope_is_refused(tmp_path, field, spelling) -> None:
    write_config(tmp_path, "phi3", field, {spelling: "yarn", **PHI3_YARN})
    message = refusal(tmp_path)
    assert f"{field}.{spelling} 'yarn' is not supported for model_type phi3" in message
    assert "reads a Phi-3 'yarn' as longrope" in message
    for kind in ("linear", "dynamic", "llama3"):  # transformers refuses these for Phi-3
        write_config(tmp_path, "phi3", field, {spelling: kind, "factor": 2.0})
        message = refusal(tmp_path)
        assert f"{field}.{spelling} '{kind}' is not supported for model_type phi3" in message
    write_config(tmp_path, "llama", field, {spelling: "yarn", **PHI3_YARN})
    assert read_model_config(tmp_path).rope_scaling.rope_type == "yarn"  # other families'


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_a_rope_type_not_implemented_names_its_field(tmp_path, field) -> None:
    write_config(tmp_path, "qwen3", field, {"rope_type": "proportional", "factor": 2.0})
    assert (f"rope scaling type 'proportional' ('{field}.rope_type') is not supported"
            in refusal(tmp_path))
    if field == "rope_parameters":  # Gemma 3's, one object per layer type
        write_config(tmp_path, "gemma3_text", field, {
            "full_attention": {"rope_type": "proportional", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        assert ("rope scaling type 'proportional' ('rope_parameters.full_attention.rope_type') "
                "is not supported" in refusal(tmp_path))


def test_sluiced_serve_refuses_it_before_a_worker_starts(tmp_path) -> None:
    """A Phi-3 longrope without its original context, the other refusal this daemon sees
    first: one line on stderr, exit 78 (a configuration error), nothing on stdout."""
    write_config(tmp_path, "phi3", "rope_scaling",
                 {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    done = subprocess.run(
        [sys.executable, "-m", "sluice.daemon.main", "serve", "--model", str(tmp_path),
         "--control", f"ipc://{tmp_path}/control.sock"],
        capture_output=True, text=True, timeout=90,
        env={**os.environ, "SLUICE_LOG_LEVEL": "info"})  # a started actor would log
    assert (done.returncode, done.stdout) == (78, ""), done.stderr[-3000:]
    [line] = done.stderr.splitlines()
    assert line.startswith("sluiced: ") and str(tmp_path / "config.json") in line
    assert "longrope rope scaling needs 'original_max_position_embeddings'" in line
