"""Phi-3's long-context rope (`longrope`, once `su`) runs as transformers runs it, and rotary
tables cover only the positions a runner serves.

A tiny random-weight Phi-3 with an original context of 64 and a max of 256: a runner serving
sequences past 64 takes the long factors for every position, which is what transformers
computes for any sequence longer than 64 (it encodes the whole sequence again with them when
one grows past it); a runner serving at most 64 takes the short ones, as transformers does for
every sequence that short. Its config.json and the GGUF file llama.cpp's converter would write
of it both load."""

from __future__ import annotations

import json

import pytest
import torch

from sluice.actors.executor.config import ModelConfig
from sluice.actors.executor.loader import ModelLoadError, read_model_config
from sluice.actors.executor.model import LlamaModel
from sluice.actors.executor.rotary import rotary_tables, table_bytes
from sluice.actors.executor.runner import ModelRunner

from support import families
from support.families import SHAPE, VOCAB, save

transformers = pytest.importorskip("transformers")

ORIGINAL, MAX_POSITIONS, NEW_TOKENS = 64, 256, 24
HEAD_PAIRS = SHAPE["hidden_size"] // SHAPE["num_attention_heads"] // 2
# far apart, so that the wrong set (or none) changes the greedy tokens
SHORT_FACTOR = [1.0 + 0.25 * i for i in range(HEAD_PAIRS)]
LONG_FACTOR = [1.0 + 4.0 * i for i in range(HEAD_PAIRS)]
LONG_PROMPT = [(7 * i + 3) % VOCAB for i in range(80)]  # past the original context
SHORT_PROMPTS = [[(11 * i + 5) % VOCAB for i in range(9)],
                 [(13 * i + 1) % VOCAB for i in range(23)],
                 [(17 * i + 2) % VOCAB for i in range(33)]]  # 33 + 24 stays within 64


def phi3(short_factor: list[float], rope_type: str = "longrope"):
    config = transformers.Phi3Config(
        max_position_embeddings=MAX_POSITIONS, original_max_position_embeddings=ORIGINAL,
        rope_scaling={"type": rope_type, "short_factor": short_factor,
                      "long_factor": LONG_FACTOR},
        rope_theta=5000.0, pad_token_id=0, eos_token_id=None, **SHAPE)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():  # sharp attention: the rope factors decide the greedy tokens
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def phi3_128k(tmp_path_factory):
    """(transformers' model, its folder, the same weights with the long factors for every
    length: what transformers computes for a sequence past the original context)."""
    reference = phi3(SHORT_FACTOR)
    folder = tmp_path_factory.mktemp("phi3-longrope")
    save(reference, folder)
    long_only = phi3(LONG_FACTOR)
    long_only.load_state_dict(reference.state_dict())
    return reference, folder, long_only


def test_longrope_config_reads_as_transformers_does(phi3_128k):
    _, folder, _ = phi3_128k
    scaling = read_model_config(folder).rope_scaling
    assert scaling.rope_type == "longrope"
    assert scaling.original_max_position_embeddings == ORIGINAL
    assert scaling.factor == MAX_POSITIONS / ORIGINAL  # what the attention factor comes from
    assert (list(scaling.short_factor), list(scaling.long_factor)) == (SHORT_FACTOR, LONG_FACTOR)


def test_a_runner_serving_past_the_original_context_matches_transformers(phi3_128k,
                                                                          smollm_tokenizer):
    reference, folder, long_only = phi3_128k
    prompts = [LONG_PROMPT, *SHORT_PROMPTS[:2]]
    # all of them as transformers computes a sequence past 64 (logits of the long prompt too)
    families.assert_matches_transformers(long_only, folder, smollm_tokenizer, prompts,
                                         new_tokens=NEW_TOKENS, chunk=16, logits_of=1)
    # and the long prompt is one: transformers' own model, unchanged, takes the long factors
    runner = ModelRunner(folder, dtype="float32", num_blocks=16, block_size=16)
    with torch.no_grad():
        torch.testing.assert_close(families.forward_logits(runner.model, LONG_PROMPT),
                                   reference(torch.tensor([LONG_PROMPT])).logits[0],
                                   atol=1e-4, rtol=1e-4)


def test_the_factors_decide_the_tokens(phi3_128k):
    """The two runners' tests tell the factor sets apart: on each short prompt the short and
    the long factors make another greedy choice after some prefix."""
    reference, _, long_only = phi3_128k
    for prompt in SHORT_PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ours, theirs = (m(ids).logits[0].argmax(-1) for m in (reference, long_only))
        assert not torch.equal(ours, theirs)


def test_a_runner_serving_the_original_context_takes_the_short_factors(phi3_128k,
                                                                        smollm_tokenizer):
    reference, folder, _ = phi3_128k
    families.assert_matches_transformers(reference, folder, smollm_tokenizer, SHORT_PROMPTS,
                                         new_tokens=NEW_TOKENS, chunk=16, logits_of=1,
                                         max_model_len=ORIGINAL)


def test_the_su_spelling_reads_the_same(phi3_128k, tmp_path):
    _, folder, _ = phi3_128k
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=5000.0, rope_scaling={"type": "su", "short_factor": SHORT_FACTOR,
                                                "long_factor": LONG_FACTOR})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes(b"")  # read for its config alone
    assert read_model_config(tmp_path) == read_model_config(folder)


def test_a_gguf_file_of_it_matches_transformers(phi3_128k, tmp_path):
    """llama.cpp's Phi-3 128k: the factors as rope_factors_short/long tensors, the attention
    factor and original context in the metadata; read back, the same choice by max_model_len."""
    from test_families_more import write_family_gguf

    reference, folder, _ = phi3_128k
    path = tmp_path / "phi3-128k.gguf"
    write_family_gguf(folder, path, "phi3")
    scaling = read_model_config(path).rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("longrope", ORIGINAL)
    for served, prompt in ((MAX_POSITIONS, LONG_PROMPT), (ORIGINAL, SHORT_PROMPTS[2])):
        runner = ModelRunner(path, dtype="float32", num_blocks=8, block_size=16,
                             max_model_len=served)
        with torch.no_grad():
            torch.testing.assert_close(families.forward_logits(runner.model, prompt),
                                       reference(torch.tensor([prompt])).logits[0],
                                       atol=1e-4, rtol=1e-4)


def write_phi3_config(folder, rope: dict, **top) -> None:
    raw = dict(model_type="phi3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
               rope_scaling=rope, **top)
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "model.safetensors").write_bytes(b"")  # the config is refused before weights


@pytest.mark.parametrize("rope, top, message", [
    ({"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}, {},
     r"longrope rope scaling needs 'original_max_position_embeddings'"),
    ({"type": "su", "long_factor": [2.0] * 8}, dict(original_max_position_embeddings=64),
     r"longrope rope scaling needs 'short_factor' as a list of numbers, got None"),
    ({"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7},
     dict(original_max_position_embeddings=64),
     r"longrope short_factor has 8 values, long_factor 7"),
    ({"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
     dict(original_max_position_embeddings=64),
     r"longrope short_factor has 4 values: it needs one per rotary frequency, 8 \(head_dim 16\)"),
    ({"type": "longrope", "short_factor": [1.0] * 7 + [0], "long_factor": [2.0] * 8},
     dict(original_max_position_embeddings=64),
     r"a longrope short_factor value is 0: it must be a positive number"),
])
def test_a_longrope_config_that_cannot_load_is_refused(tmp_path, rope, top, message):
    write_phi3_config(tmp_path, rope, **top)
    with pytest.raises(ModelLoadError, match=message) as refused:
        read_model_config(tmp_path)
    assert "config.json" in str(refused.value) and "\n" not in str(refused.value)


# ---- rotary tables sized to what is served ---------------------------------------------------

GEMMA3_CONTEXT, SERVED = 131_072, 4096


def test_gemma3_rotary_tables_cover_the_served_length_not_its_whole_context():
    """Gemma 3 (head size 256, two rope bases, 131,072 positions): a runner serving 4096 builds
    16 MiB of tables, where the model's whole context would take 512 MiB."""
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=1, num_kv_heads=1, head_dim=256, rope_theta=1_000_000.0,
                         max_position_embeddings=GEMMA3_CONTEXT, sliding_window=16,
                         layer_types=("sliding_attention", "full_attention"),
                         local_rope_theta=10_000.0, norm_plus_one=True)
    model = LlamaModel.random(config)
    assert model.rotary_positions == GEMMA3_CONTEXT and model._rotary_tables is None
    runner = ModelRunner(model=model, num_blocks=8, block_size=16, max_model_len=SERVED)
    tables = runner.model.rotary_tables
    built = sum(t.nbytes for pair in tables for t in pair)
    whole = len(tables) * table_bytes(config.head_dim, GEMMA3_CONTEXT)
    assert built == len(tables) * table_bytes(config.head_dim, SERVED) == 16 * 2 ** 20
    assert whole == 512 * 2 ** 20
    # the rows served are the rows a longer table has: only the length differs
    longer = rotary_tables(256, 1_000_000.0, GEMMA3_CONTEXT, None, "cpu", rows=SERVED + 100)
    assert all(torch.equal(ours, theirs[:SERVED]) for ours, theirs in zip(tables[0], longer))
    hidden = families.forward_logits(runner.model, list(range(40)))
    assert torch.isfinite(hidden).all()
    with pytest.raises(ValueError, match=r"positions served must be from 1 to the model's "
                                         r"context \(131072\), got 131073"):
        model.limit_positions(GEMMA3_CONTEXT + 1)
