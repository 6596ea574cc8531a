"""bfloat16 is selectable end to end: weights, KV pool and a sensible answer; `auto` picks
it only where the hardware multiplies bf16 natively."""

from __future__ import annotations

import pytest
import torch

from sluice.actors.engine import Engine
from sluice.actors.executor.dtypes import auto_dtype, resolve_dtypes
from sluice.ipc.vocabulary import SamplingParams


def test_bfloat16_engine_answers_the_capital_question(smollm_tokenizer):
    engine = Engine(dtype="bfloat16", num_blocks=64, tokenizer=smollm_tokenizer)
    assert engine.runner.model.embed.dtype == torch.bfloat16
    assert engine.runner.kv_pool[0][0].dtype == torch.bfloat16
    # A raw prompt whose answer wins by a wide margin: the chat form of the question starts
    # with a near tie ("The" and "L" 0.08 apart in float32, equal in bfloat16 on an AVX2 CPU),
    # so which token bf16 picks there depends on the CPU's rounding, not on the engine.
    [answer] = engine.generate(["The capital of France is"],
                               SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
    assert answer.text.startswith(" Paris"), answer.text
    best, second = answer.logprobs[0].top
    assert best.logprob - second.logprob > 1.0  # far from a tie a rounding could flip
    engine.scheduler.check_invariants()


# -- what `auto` picks ------------------------------------------------------------------------


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """cpuinfo(text): make the dtype detection read `text` as /proc/cpuinfo."""
    from sluice.actors.executor import dtypes

    def use(text: str | None) -> None:
        path = tmp_path / "cpuinfo"
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(text)
        monkeypatch.setattr(dtypes, "_CPUINFO", path)
        dtypes.cpu_has_native_bf16.cache_clear()

    # the flags decide here; whether bf16 pays on this machine has a test of its own
    monkeypatch.setattr(dtypes, "cpu_bf16_matmul_pays", lambda: True)
    yield use
    dtypes.cpu_has_native_bf16.cache_clear()


X86_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni"


def test_auto_is_bfloat16_only_on_a_cpu_with_native_bf16(cpuinfo):
    cpuinfo(X86_FLAGS + "\n")
    assert resolve_dtypes("auto", None, "cpu") == (torch.float32, torch.float32)
    cpuinfo(X86_FLAGS + " avx512_bf16\n")
    assert resolve_dtypes("auto", None, "cpu") == (torch.bfloat16, torch.bfloat16)
    cpuinfo("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # an Arm core with BF16
    assert resolve_dtypes("auto", "auto", "cpu") == (torch.bfloat16, torch.bfloat16)


def test_a_cpu_whose_bf16_matmul_is_slower_stays_in_float32(cpuinfo, monkeypatch):
    from sluice.actors.executor import dtypes

    cpuinfo(X86_FLAGS + " avx512_bf16\n")
    monkeypatch.setattr(dtypes, "cpu_bf16_matmul_pays", lambda: False)
    assert resolve_dtypes("auto", None, "cpu") == (torch.float32, torch.float32)
    assert resolve_dtypes("bfloat16", None, "cpu") == (torch.bfloat16, torch.bfloat16)


def test_explicit_dtypes_win_and_the_kv_pool_may_differ(cpuinfo):
    cpuinfo(X86_FLAGS + " amx_bf16\n")
    assert resolve_dtypes("float32", None, "cpu") == (torch.float32, torch.float32)
    assert resolve_dtypes("auto", "float32", "cpu") == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_dtypes("fp8", None, "cpu")


def test_without_cpuinfo_the_choice_comes_from_measuring(cpuinfo):
    cpuinfo(None)
    assert resolve_dtypes("auto", None, "cpu")[0] in (torch.bfloat16, torch.float32)


def test_engine_default_is_auto_and_kv_dtype_is_separate(smollm_tokenizer):
    engine = Engine(kv_dtype="float32", num_blocks=8, tokenizer=smollm_tokenizer)
    assert engine.runner.model.dtype == auto_dtype("cpu")
    assert engine.runner.kv_pool[0][0].dtype == torch.float32
    # A raw prompt whose answer wins by a wide margin: the chat form of the question starts
    # with a near tie ("The" and "L" 0.08 apart in float32, equal in bfloat16 on an AVX2 CPU),
    # so which token bf16 picks there depends on the CPU's rounding, not on the engine.
    [answer] = engine.generate(["The capital of France is"],
                               SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
    assert answer.text.startswith(" Paris"), answer.text
    best, second = answer.logprobs[0].top
    assert best.logprob - second.logprob > 1.0  # far from a tie a rounding could flip
    engine.scheduler.check_invariants()
