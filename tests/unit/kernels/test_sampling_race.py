"""The fused full-vocabulary race (C++ on CPU, Triton in its interpreter here) picks exactly the
tokens of the sampler's torch code, its definition: across temperatures, seeds, min_p,
masked tokens, rows of every length, near-ties decided by the last bit of a log, exact ties,
and the rows where nothing can race; and the sampler on the real model draws the tokens it
drew before the op existed."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from support.triton_compile import compiled_output

from sluice.actors.executor.sampler import _race, exponential_noise, race_whole_vocabulary
from sluice.ipc.vocabulary import SamplingParams
from sluice.kernels import cpu_paged, race
from sluice.kernels.race_triton import race_full as triton_race
from sluice.kernels.race_triton import race_masked as triton_race_masked

NEG_INF = float("-inf")


@pytest.fixture(scope="module", autouse=True)
def _op_built():
    cpu_paged._forget()  # a verdict recorded under another test's environment does not count
    saved = {k: os.environ.pop(k) for k in (cpu_paged.DISABLE_ENV, race.DISABLE_ENV)
             if k in os.environ}
    if not cpu_paged.available():
        pytest.fail(f"the CPU op did not build: {cpu_paged.unavailable_reason()}")
    yield
    os.environ.update(saved)
    cpu_paged._forget()


def random_rows(rows: int, vocab: int, seed: int):
    """Logits of every spread, some tokens masked, per-row temperature, min_p (half the rows
    none) and keys."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * (0.2 + 6 * torch.rand(rows, 1, generator=g))
    logits[torch.rand(rows, vocab, generator=g) < 0.2] = NEG_INF
    temperature = 0.05 + 2 * torch.rand(rows, generator=g)
    min_p = torch.where(torch.rand(rows, generator=g) < 0.5, torch.zeros(rows),
                        0.3 * torch.rand(rows, generator=g))
    keys = torch.randint(0, 1 << 32, (rows, 2), generator=g)
    return logits, temperature, keys, min_p


def torch_race(logits, temperature, keys, min_p):
    return race_whole_vocabulary(logits, temperature, keys, min_p, fused=False)


def cpu_race(logits, temperature, keys, min_p):
    return race.race_full(logits, temperature, keys, torch.log(min_p))


@pytest.mark.parametrize("vocab, rows", [(49152, 24), (4097, 64), (3001, 64), (5, 200), (1, 4)])
def test_cpu_op_picks_the_torch_tokens(vocab, rows):
    for seed in range(3):
        args = random_rows(rows, vocab, seed=vocab + seed)
        assert torch.equal(cpu_race(*args), torch_race(*args))


def test_cpu_op_reads_rows_of_a_wider_tensor():
    logits, temperature, keys, min_p = random_rows(16, 3000, seed=5)
    wide = torch.full((16, 3100), 50.0)
    wide[:, :3000] = logits
    view = wide[:, :3000]  # row stride 3100
    assert torch.equal(cpu_race(view, temperature, keys, min_p),
                       torch_race(logits, temperature, keys, min_p))


def near_ties(rows: int, vocab: int, seed: int):
    """Rows whose two best tokens race within a few ulps of each other, every other token far
    behind: which wins depends on the last bit of the logs (which differ between libraries on
    about one input in seven), so only the exact race gets them all right."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 1 << 32, (rows, 2), generator=g)
    log_noise = exponential_noise(keys, torch.arange(vocab)[None].expand(rows, vocab)).log()
    logits = torch.full((rows, vocab), -30.0)
    pair = torch.stack([torch.randperm(vocab, generator=g)[:2] for _ in range(rows)])
    a, b = pair[:, 0], pair[:, 1]
    rows_i = torch.arange(rows)
    base = 3.0 + torch.rand(rows, generator=g)
    logits[rows_i, a] = base + log_noise[rows_i, a]
    race_a = logits[rows_i, a] - log_noise[rows_i, a]
    # b's race lands on a's, give or take a few ulps
    steps = torch.randint(-3, 4, (rows,), generator=g).float()
    target = race_a + steps * torch.finfo(torch.float32).eps * race_a.abs()
    logits[rows_i, b] = target + log_noise[rows_i, b]
    temperature = torch.ones(rows)  # logits / 1 are the logits: the ties survive scaling
    return logits, temperature, keys, torch.zeros(rows)


def test_cpu_op_decides_near_ties_and_exact_ties_as_torch_does():
    # (on the machine this was written on, SLEEF's logs alone pick another token in 21 of
    # these rows)
    rows, vocab = 4000, 256
    logits, temperature, keys, min_p = near_ties(rows, vocab, seed=7)
    expected = torch_race(logits, temperature, keys, min_p)
    assert torch.equal(cpu_race(logits, temperature, keys, min_p), expected)
    # the rows really were close: their best two races within a few ulps
    ids = torch.arange(vocab)[None].expand(rows, vocab)
    top = (logits - exponential_noise(keys, ids).log()).topk(2, dim=-1).values
    gap = (top[:, 0] - top[:, 1]) / top[:, 0].abs()
    assert (gap < 1e-6).all()
    assert (gap == 0).sum() > 100  # exact ties: the first token wins


def test_rows_where_nothing_races_give_token_0_and_an_infinite_race_wins():
    vocab = 1024
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(3))
    logits[0] = NEG_INF  # everything masked
    logits[1, 17] = float("nan")  # a NaN max: the min_p sum is NaN, nothing races
    logits[2, 400] = float("inf")  # a +inf max without min_p: the same
    logits[3, 400] = float("inf")  # with min_p: only the +inf token races
    logits[4, 1:] = NEG_INF  # only token 0 is left
    logits[6, 9] = float("nan")  # a NaN max with min_p: nothing races
    temperature = torch.tensor([0.7, 1.0, 1.0, 1.0, 1.3, 1e-30, 1.0])  # row 5 overflows
    min_p = torch.tensor([0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.2])
    keys = torch.randint(0, 1 << 32, (7, 2), generator=torch.Generator().manual_seed(4))
    expected = torch_race(logits, temperature, keys, min_p)
    assert expected[:5].tolist() == [0, 0, 0, 400, 0] and expected[6] == 0
    assert torch.equal(cpu_race(logits, temperature, keys, min_p), expected)
    # key (1395, 12345) hashes token 763 to a uniform of exactly 1: noise 0, race +inf
    keys = torch.tensor([[1395, 12345]])
    row = torch.zeros(1, vocab)
    row[0, 5] = 80.0  # far ahead on its logit, yet the infinite race wins
    assert exponential_noise(keys, torch.tensor([[763]])).item() == 0.0
    one = (row, torch.ones(1), keys, torch.zeros(1))
    assert torch_race(*one).tolist() == [763]
    assert cpu_race(*one).tolist() == [763]


def listed_candidates(rows: int, width: int, vocab: int, seed: int):
    """Candidates as the sampler's top-k/top-p rows list them: values sorted best first, the
    ids of any tokens, a keep mask (some rows keep nothing at all)."""
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(rows, width, generator=g) * 3).sort(-1, descending=True).values
    values[torch.rand(rows, width, generator=g) < 0.05] = NEG_INF
    ids = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(rows)])
    keep = torch.rand(rows, width, generator=g) < torch.rand(rows, 1, generator=g)
    keep[:3] = False
    keys = torch.randint(0, 1 << 32, (rows, 2), generator=g)
    return values, ids, keys, keep


def torch_race_masked(values, ids, keys, keep):
    # no min_p (log 0 = -inf keeps all), no top_p: the race among the kept candidates only
    return _race(values.masked_fill(~keep, NEG_INF), ids, keys, torch.zeros(len(values), 1),
                 None, None, fused=False)


@pytest.mark.parametrize("width, rows", [(256, 64), (49152, 4), (7, 50)])
def test_masked_op_picks_the_torch_tokens(width, rows):
    args = listed_candidates(rows, width, vocab=max(width, 50000), seed=width)
    expected = torch_race_masked(*args)
    assert expected[:3].tolist() == args[1][:3, 0].tolist()  # nothing kept: the first id
    assert torch.equal(race.race_masked(*args), expected)
    if width < 49152:
        assert torch.equal(triton_race_masked(*args), expected)


def test_the_op_names_a_wrong_argument():
    logits, temperature, keys, min_p = random_rows(4, 100, seed=1)
    log_min_p = torch.log(min_p)
    with pytest.raises(ValueError, match="temperature"):
        race.race_full(logits, temperature[:3], keys, log_min_p)
    with pytest.raises(ValueError, match="keys"):
        race.race_full(logits, temperature, keys.int(), log_min_p)
    with pytest.raises(ValueError, match="scores"):
        race.race_full(logits.double(), temperature, keys, log_min_p)
    with pytest.raises(ValueError, match="unit stride"):
        race.race_full(logits.t().contiguous().t(), temperature, keys, log_min_p)
    ids = torch.arange(100).expand(4, 100)
    keep = torch.ones(4, 100, dtype=torch.bool)
    with pytest.raises(ValueError, match="ids"):
        race.race_masked(logits, ids[:, :50], keys, keep)
    with pytest.raises(ValueError, match="keep"):
        race.race_masked(logits, ids, keys, keep.int())


@pytest.mark.parametrize("vocab, rows", [(49152, 6), (3001, 24), (5, 8)])
def test_triton_kernel_picks_the_torch_tokens_in_the_interpreter(vocab, rows):
    args = random_rows(rows, vocab, seed=11 + vocab)
    logits, temperature, keys, min_p = args
    assert torch.equal(triton_race(logits, temperature, keys, torch.log(min_p)),
                       torch_race(*args))
    nothing = random_rows(3, vocab, seed=2)
    nothing[0][0] = NEG_INF
    nothing[0][1, 0] = float("nan")
    assert triton_race(nothing[0], nothing[1], nothing[2], torch.log(nothing[3]))[:2].tolist() \
        == [0, 0]


COMPILE = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sluice.kernels import race_triton

    signature = dict(Scores="*fp32", Temperature="*fp32", Keys="*i64", Threshold="*fp32",
                     Ids="*i64", Keep="*i1", ChunkBest="*fp32", ChunkToken="*i64",
                     vocab="i32", stride_row="i32", num_chunks="i32", BLOCK="constexpr",
                     MASKED="constexpr")
    for masked in (False, True):
        compiled = triton.compile(ASTSource(race_triton._race_kernel, signature,
                                            dict(BLOCK=race_triton.BLOCK, MASKED=masked)),
                                  target=GPUTarget("cuda", 90, 32))
        assert "cubin" in compiled.asm
        print(compiled.asm["ptx"])
""")


def test_triton_kernel_compiles_for_sm90_with_torchs_float_operations():
    ptx = compiled_output(COMPILE)
    # torch's CUDA kernels divide correctly rounded and take libdevice's logf: so does this
    assert "div.rn.f32" in ptx and "__nv_logf" in ptx
    for approximate in ("div.full", "div.approx", "lg2.approx", "ex2.approx"):
        assert approximate not in ptx


# tokens the sampler drew on the embedded model (float32) with its torch race, before the
# fused op existed: random-token prompts, so every row is flat
PINNED = [[465, 102, 8241, 24886, 40019, 1348, 314, 787],
          [81, 28, 527, 314, 253, 27479, 29, 2542],
          [8486, 216, 33, 33, 33, 198, 302, 369],
          [283, 1815, 38166, 35023, 37103, 94, 16577, 388]]


@pytest.mark.slow
def test_the_real_model_samples_the_tokens_it_sampled_before(make_engine):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (12 + 3 * i,), generator=g).tolist() for i in range(4)]
    settings = [
        SamplingParams(max_tokens=6, temperature=0.8, seed=21, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, min_p=0.05, seed=22, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, seed=23, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.3, seed=24, ignore_eos=True,
                       presence_penalty=0.5),
    ]
    assert race.available(torch.device("cpu"))
    fused = make_engine(num_blocks=64).generate(prompts, settings)
    assert [c.token_ids for c in fused] == [tokens[:6] for tokens in PINNED]


def test_the_gpu_race_runs_only_when_asked_for_until_it_has_run_on_a_gpu(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv(race.DISABLE_ENV, raising=False)
    assert not race.available(cuda)  # the sampler's torch code races on CUDA by default
    monkeypatch.setenv(race.DISABLE_ENV, "on")
    assert race.available(cuda)
    monkeypatch.setenv(race.DISABLE_ENV, "off")
    assert not race.available(cuda) and not race.available(torch.device("cpu"))


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (7, 1000), (64, 49152), (3, 5)])
def test_greedy_argmax_picks_torchs_token_ties_and_nans_included(rows, vocab):
    assert race.available(torch.device("cpu")), cpu_paged.unavailable_reason()  # the op runs
    g = torch.Generator().manual_seed(rows * vocab)
    scores = torch.randn(rows, vocab, generator=g)
    scores[:, vocab // 2] = 9.0  # a tie with a later token: the first is picked
    scores[:, -1] = 9.0
    if rows > 1:
        scores[1, 3] = float("nan")  # a NaN counts as largest, as in torch
        scores[1, 4] = float("nan")
        scores[-1] = float("-inf")  # a row with nothing left picks its first token
    assert torch.equal(race.argmax(scores), scores.argmax(dim=-1))
    view = scores[:, 1:]  # rows apart, unit stride along the vocabulary
    assert torch.equal(race.argmax(view), view.argmax(dim=-1))


@pytest.mark.parametrize("vocab, rows", [(49152, 16), (3001, 64), (300, 64)])
def test_wide_nuclei_are_found_by_selection_as_the_full_sort_finds_them(vocab, rows):
    """`nucleus_floor` keeps exactly the tokens the sorted definition keeps (a prefix whose
    mass before each token is below top_p), masked tokens and repeated values included, and
    the sampler's wide-nucleus race with it picks the sorted race's tokens."""
    from sluice.actors.executor.sampler import _race_wide_nuclei

    logits, temperature, keys, min_p = random_rows(rows, vocab, seed=vocab)
    logits[:, : vocab // 3] = logits[:, : vocab // 3].round()  # many exact ties
    scaled = logits / temperature[:, None]
    normalizer = scaled.logsumexp(-1, keepdim=True)
    g = torch.Generator().manual_seed(rows)
    top_p = (0.05 + 0.94 * torch.rand(rows, 1, generator=g))
    floor = race.nucleus_floor(scaled, normalizer[:, 0], top_p[:, 0])
    values, ids = scaled.sort(dim=-1, descending=True)
    probs = (values - normalizer).exp()
    sorted_keep = (probs.cumsum(-1) - probs) < top_p
    for r in range(rows):
        kept = set(ids[r][sorted_keep[r]].tolist())
        ours = set((scaled[r] >= floor[r]).nonzero()[:, 0].tolist())
        # the same set, but for the other tokens tied with the last kept one
        assert kept <= ours and all(scaled[r, t] == floor[r] for t in ours - kept), r
    min_p = min_p[:, None]
    expected = _race(values, ids, keys, min_p, top_p, normalizer, fused=False)
    assert torch.equal(_race_wide_nuclei(scaled, keys, min_p, top_p, normalizer), expected)
