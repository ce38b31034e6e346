"""Merging per-rank attention states with their log-sum-exp (semantics doc, section 6).

Rank ``r`` computed ``O_r`` (attention over its own keys) and ``lse_r`` (the log of its
softmax denominator). Over the union of the keys::

    m   = max_r lse_r            (NaN and +inf count as -inf; m = -inf -> 0)
    lse = m + log(sum_r exp(lse_r - m))
    O   = sum_r exp(lse_r - lse) * O_r

A shard whose factor is 0 (an empty shard, ``lse_r = -inf``) contributes exactly 0, even
if its output holds NaN. Base-2 LSEs (``base="2"``) use exp2/log2 throughout. Pure torch;
shapes: ``outputs [W, ..., D]``, ``lses [W, ...]``.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def _exp_log(base: str):
    if base == "e":
        return torch.exp, torch.log
    if base == "2":
        return torch.exp2, torch.log2
    raise ValueError(f"lse base must be 'e' or '2', got {base!r}")


def sanitize_lse(lses: torch.Tensor) -> torch.Tensor:
    """NaN and +inf count as -inf (a shard that reports garbage contributes nothing)."""
    bad = torch.isnan(lses) | (lses == float("inf"))
    return torch.where(bad, torch.full_like(lses, _NEG_INF), lses)


def merge_lse(lses: torch.Tensor, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, factors)``: the merged LSE ``[...]`` and each shard's weight ``[W, ...]``."""
    exp, log = _exp_log(base)
    clean = sanitize_lse(lses)
    m = clean.amax(dim=0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # only -inf is possible here
    lse = m + log(exp(clean - m).sum(dim=0))  # log(0) = -inf when every shard is empty
    empty = clean == _NEG_INF
    # exp(-inf - lse) is 0, but exp(-inf - (-inf)) is NaN: empty shards get 0 explicitly
    factors = torch.where(empty, torch.zeros_like(clean), exp(clean - lse))
    return lse, factors


def scale_output(output: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``factor[..., None] * output``, with exactly 0 where the factor is 0 (never NaN * 0)."""
    f = factor.unsqueeze(-1)
    return torch.where(f == 0, torch.zeros_like(output), f * output)


def merge_attention_states(outputs: torch.Tensor, lses: torch.Tensor, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``W`` partial attention states into ``(O [..., D], lse [...])``."""
    if outputs.shape[:-1] != lses.shape:
        raise ValueError(f"outputs {tuple(outputs.shape)} and lses {tuple(lses.shape)} do not match")
    lse, factors = merge_lse(lses, base)
    return scale_output(outputs, factors).sum(dim=0), lse
