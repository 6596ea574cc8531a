"""Fixed-order attention (the deterministic mode's): the CPU op in its fixed-order mode and
the reference's per-token fallback match the reference, and give every query row the same
bits however its sequence was chunked and whatever else shares the call."""

import pytest
import torch

from sluice import kernels
from sluice.kernels import cpu_paged, reference
from sluice.kernels.testing import BatchShape, mixed_shape, random_paged_batch

FP32_ATOL = 2e-5
SHAPES = [mixed_shape((6, 2)), mixed_shape((8, 1), 32)]  # decodes and chunks
OPTIONS = [{}, {"window": 20}, {"softcap": 30.0}]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the per-token fallback is many tiny ops: a second thread only waits on the first
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["cpu", "torch"])
def backend(request):
    if request.param == "cpu" and not cpu_paged.available():
        pytest.skip(f"the CPU op is unavailable: {cpu_paged.unavailable_reason()}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLUICE_ATTENTION", request.param)
        yield request.param


def fixed(args, **options):
    return kernels.paged_attention(*args, fixed_order=True, **options)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_matches_the_reference(backend, shape, options):
    batch = random_paged_batch(shape, seed=11)
    torch.testing.assert_close(fixed(batch.attention_args(), **options),
                               reference.paged_attention(*batch.attention_args(), **options),
                               atol=FP32_ATOL, rtol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_a_row_gets_the_same_bits_in_any_chunk_or_batch(backend, dtype, options):
    # one 50-token sequence beside two others; its rows computed whole, in uneven chunks,
    # alone or batched must be bitwise equal
    batch = random_paged_batch(BatchShape((50, 30, 9), (50, 1, 9), 6, 2), dtype=dtype, seed=4)
    q, k, v, tables, _, _, scale = batch.attention_args()
    whole = fixed((q[:50], k, v, tables[:1], torch.tensor([0, 50], dtype=torch.int32),
                   torch.tensor([50], dtype=torch.int32), scale), **options)
    batched = fixed(batch.attention_args(), **options)[:50]
    pieces = []
    for start, end in ((0, 17), (17, 34), (34, 37), (37, 38), (38, 50)):
        pieces.append(fixed((q[start:end], k, v, tables[:1],
                             torch.tensor([0, end - start], dtype=torch.int32),
                             torch.tensor([end], dtype=torch.int32), scale), **options))
    assert torch.equal(batched, whole)
    assert torch.equal(torch.cat(pieces), whole)
