"""Batched sampling on the device with no host synchronization.

Randomness is counter-based: the uniform draw for (seed, position, vocab id) is a hash of the
three, so a seeded request samples the same tokens whatever batch it shares and however often
it is preempted. Sampling is Gumbel-max over the filtered logits, which draws exactly from the
softmax of those logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M1 = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64 constants as signed int64
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)


STREAM_STRIDE = 0x632BE5AB  # a seed offset per stream: independent uses of one position
# A uniform's bits: the top UNIFORM_BITS of the hash, k, give (k + 0.5) / 2^UNIFORM_BITS,
# exact in float32 and strictly inside (0, 1). (With 24 bits the largest k rounded to 1.0,
# whose Gumbel noise is +inf: one draw in 2^24, a token of a 128k vocabulary in ~0.8% of
# sampled rows picked whatever its probability.)
UNIFORM_BITS = 23


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """Uniform floats in (0, 1), [B, width], a pure function of (seed, counter, column)
    (int64 seeds and counters [B]); on CUDA in one kernel with the same bits
    (kernels/counter_noise.py, imported when first needed: a kernel module)."""
    if seeds.is_cuda:
        from specserve.kernels.counter_noise import uniform_noise

        return uniform_noise(seeds, counters, width)
    return hash_uniform_torch(seeds, counters, width)


def hash_uniform_torch(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """`hash_uniform` in torch ops (the CPU's, and the kernel's reference)."""
    cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _M1 + counters[:, None] * _M3 + cols[None, :] * _M2
    x = x + _M1
    x = (x ^ _shr(x, 30)) * _M2
    x = (x ^ _shr(x, 27)) * _M3
    x = x ^ _shr(x, 31)
    return unit_interval(_shr(x, 64 - UNIFORM_BITS))


def unit_interval(k: torch.Tensor) -> torch.Tensor:
    """(k + 0.5) / 2^UNIFORM_BITS in float32 for integers 0 <= k < 2^UNIFORM_BITS: exact,
    strictly inside (0, 1)."""
    return (k.float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device, built once per step."""

    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, index of the token being drawn
    all_greedy: bool
    any_top_k_or_p: bool
    any_min_p: bool


def filter_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p; removed tokens get -inf.

    The result's softmax is the distribution a sampled row draws from (speculative
    verification uses the same function for both target and draft).
    """
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    logits = logits / temp[:, None]
    if st.any_top_k_or_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, vocab))
        drop = ranks >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= st.top_p[:, None]
        drop[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if st.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def gumbel_noise(st: SamplingTensors, vocab: int, stream: int = 0) -> torch.Tensor:
    """Gumbel(0, 1) noise for each row; `stream` separates independent uses of a position."""
    u = hash_uniform(st.seeds + stream * STREAM_STRIDE, st.positions, vocab)
    return -torch.log(-torch.log(u))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the same indices; on CUDA through the Triton row argmax where it
    applies (kernels/triton_argmax.py, imported when first needed: a kernel module)."""
    if not x.is_cuda:
        return x.argmax(dim=-1)
    from specserve.kernels.triton_argmax import argmax_rows as kernels

    return kernels(x)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """One token per row: argmax for greedy rows, a seeded draw for the others. [B] int64."""
    greedy = argmax_rows(logits)
    if st.all_greedy:
        return greedy
    filtered = filter_logits(logits, st)
    drawn = argmax_rows(filtered + gumbel_noise(st, logits.shape[-1]))
    return torch.where(st.temperature > 0, drawn, greedy)


def build_sampling_tensors(params, seeds, positions, device) -> SamplingTensors:
    """From lists of SamplingParams, seeds and positions (one per row)."""
    temps = [p.temperature for p in params]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    sampled = [t > 0 for t in temps]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return SamplingTensors(
        temperature=tensor(temps, torch.float32),
        top_k=tensor(top_k, torch.int64),
        top_p=tensor(top_p, torch.float32),
        min_p=tensor(min_p, torch.float32),
        seeds=tensor(seeds, torch.int64),
        positions=tensor(positions, torch.int64),
        all_greedy=not any(sampled),
        any_top_k_or_p=any(s and (k > 0 or p < 1.0) for s, k, p in zip(sampled, top_k, top_p)),
        any_min_p=any(s and m > 0 for s, m in zip(sampled, min_p)),
    )
