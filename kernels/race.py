"""The sampler's exponential race over whole rows of the vocabulary, in one pass per row.

For every row the winner is argmax over tokens of (logit / temperature - log(-log U)), U the
counter-based uniform of (row key, token id), among the tokens whose scaled logit reaches the
row's min_p cut (scaled >= row max + log(min_p)); masked (-inf) tokens never race and a row
where nothing races gives token 0. The torch code that defines it, and that these ops must
match token for token, is the sampler's (`sluice.actors.executor.sampler`): it builds the
noise as ~15 int64 tensor passes per hash round over rows x vocab, these fuse it.

`race_masked` is the same race among candidates a caller lists (ids and a keep mask): the
sampler's top-k and top-p rows, their cuts already made in torch. `nucleus_floor` finds
where a top-p nucleus wider than the sampler's candidates ends, by selection instead of the
full sort the sampler's definition does (CPU only).

On CPU the ops are C++ (`csrc/sampling_race_cpu.cpp`, built into one library with the paged
attention op by `cpu_paged`, so they are available exactly when that is). On CUDA they are
a Triton kernel (`race_triton`), which has been checked only under Triton's interpreter and
compiled for sm_90, never run on a GPU: until it has, CUDA runs it only with
`SLUICE_FUSED_RACE=on`. `SLUICE_FUSED_RACE=off` turns the ops off everywhere: the sampler then
runs its torch code.
"""

from __future__ import annotations

import os

import torch

from sluice.kernels import cpu_paged

__all__ = ["DISABLE_ENV", "argmax", "available", "nucleus_floor", "race_full", "race_masked"]

# "off" (or 0/false/no): the sampler races in torch; "on" (or 1/true/yes): on CUDA too
DISABLE_ENV = "SLUICE_FUSED_RACE"


def _env() -> str:
    return os.environ.get(DISABLE_ENV, "").strip().lower()


def available(device: torch.device) -> bool:
    """Whether `race_full` runs on this device (else the sampler's torch code does)."""
    setting = _env()
    if setting in ("off", "0", "false", "no"):
        return False
    if device.type == "cuda":  # not yet run on a GPU: asked for by name only
        return setting in ("on", "1", "true", "yes")
    return device.type == "cpu" and cpu_paged.available()


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: `scores.argmax(-1)` (the first largest; a NaN counts as largest), in one
    vectorised pass per row where the CPU op runs (float32 rows with unit stride along the
    vocabulary), else torch's."""
    if (scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2
            and scores.shape[1] > 0 and scores.stride(1) == 1 and available(scores.device)):
        return torch.ops.sluice_cpu.argmax_rows(scores)
    return scores.argmax(dim=-1)


def race_full(scores: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
              log_min_p: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's winning token id.

    scores: float32 [rows, vocab], unit stride along vocab (raw logits: each row is divided
    by its temperature here); temperature: float32 [rows], > 0; keys: int64 [rows, 2], the
    row's two 32-bit key halves (`sampler.race_keys`); log_min_p: float32 [rows], torch.log
    of each row's min_p (-inf for none)."""
    _check_rows("scores", scores)
    rows = scores.shape[0]
    _check_like("temperature", temperature, torch.float32, (rows,), "scores", scores)
    _check_like("log_min_p", log_min_p, torch.float32, (rows,), "scores", scores)
    _check_like("keys", keys, torch.int64, (rows, 2), "scores", scores)
    if scores.is_cuda:
        from sluice.kernels.race_triton import race_full as launch

        return launch(scores, temperature, keys, log_min_p)
    if not cpu_paged.available():
        raise RuntimeError(f"the CPU race op is unavailable: {cpu_paged.unavailable_reason()}")
    return torch.ops.sluice_cpu.race_full(scores, temperature, keys, log_min_p)


def race_masked(values: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor,
                keep: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the race among listed candidates, cuts already made (top-k, top-p).

    values: float32 [rows, width], scaled logits; ids: int64 [rows, width], the token at each
    position; keep: bool [rows, width], the positions that may race. The winner is the token
    at the first position of the best race; ids[row, 0] where nothing races."""
    _check_rows("values", values)
    _check_like("keys", keys, torch.int64, (values.shape[0], 2), "values", values)
    _check_like("ids", ids, torch.int64, tuple(values.shape), "values", values)
    _check_like("keep", keep, torch.bool, tuple(values.shape), "values", values)
    ids, keep = ids.contiguous(), keep.contiguous()
    if values.is_cuda:
        from sluice.kernels.race_triton import race_masked as launch

        return launch(values, ids, keys, keep)
    if not cpu_paged.available():
        raise RuntimeError(f"the CPU race op is unavailable: {cpu_paged.unavailable_reason()}")
    return torch.ops.sluice_cpu.race_masked(values, ids, keys, keep)


def nucleus_floor(values: torch.Tensor, normalizer: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor | None:
    """float32 [rows]: the lowest scaled logit of each row's top-p nucleus (`values >= floor`
    is the nucleus; -inf where the row's mass never reaches top_p), or None where the CPU op
    does not run (the sampler then sorts). values: float32 [rows, vocab], scaled logits;
    normalizer: float32 [rows], the log of each row's mass; top_p: float32 [rows]."""
    if values.device.type != "cpu" or not available(values.device):
        return None
    _check_rows("values", values)
    rows = values.shape[0]
    _check_like("normalizer", normalizer, torch.float32, (rows,), "values", values)
    _check_like("top_p", top_p, torch.float32, (rows,), "values", values)
    return torch.ops.sluice_cpu.nucleus_floor(values, normalizer, top_p)


def _check_rows(name: str, scores: torch.Tensor) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 [rows, vocab], got {str(scores.dtype)[6:]} "
                         f"{tuple(scores.shape)}")
    if scores.shape[1] == 0:
        raise ValueError(f"{name} must have at least one token per row")
    if scores.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along vocab, got {scores.stride()}")


def _check_like(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple,
                scores_name: str, scores: torch.Tensor) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must be {str(dtype)[6:]} {shape}, got "
                         f"{str(tensor.dtype)[6:]} {tuple(tensor.shape)}")
    if tensor.device != scores.device:
        raise ValueError(f"{name} is on {tensor.device} but {scores_name} on {scores.device}")
