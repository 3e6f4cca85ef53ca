"""The minimal greedy decode driver gpu_bench.py runs (the engine cannot take a prebuilt
model yet): a model with random weights built on the device from a ModelConfig; all prompts
prefilled in one packed forward, then decode steps that advance positions, KV slots and
seq_lens on the device, so the decode loop never waits for the host; a step eager or
replayed from CUDA graphs; greedy agreement between two runs."""

from __future__ import annotations

import time

import torch

from specserve.engine.kv_cache import KVCache
from specserve.layers.attention import AttentionMetadata
from specserve.model.hf_config import ModelConfig
from specserve.model.llama import LlamaForCausalLM
from specserve.runtime.cuda_graphs import CudaGraphRunner


def build_model(cfg: ModelConfig, dtype, device) -> LlamaForCausalLM:
    """Random weights initialized in place on the device (default nn init)."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.rotary.materialize(torch.device(device))
    return model.eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def generate(model, kv: KVCache, step_fn, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Greedy-decode `new_tokens` for `batch` random prompts; step_fn(ids, meta) -> hidden."""
    device, ps, cfg = kv.pool.device, kv.page_size, model.config
    pages = -(-(prompt_len + new_tokens) // ps)
    owned = [kv.allocator.allocate(pages) for _ in range(batch)]
    try:
        tables = torch.tensor(owned, dtype=torch.int64, device=device)
        gen = torch.Generator(device=device).manual_seed(1234 + batch)
        prompts = torch.randint(cfg.vocab_size, (batch * prompt_len,), generator=gen,
                                device=device)  # fmt: skip
        rows = torch.arange(batch, device=device)
        pos = torch.arange(prompt_len, device=device).repeat(batch)
        req = rows.repeat_interleave(prompt_len)
        meta = AttentionMetadata(
            positions=pos, slot_mapping=tables[req, pos // ps] * ps + pos % ps,
            query_start_loc=torch.arange(batch + 1, device=device) * prompt_len,
            seq_lens=torch.full((batch,), prompt_len, device=device), block_tables=tables,
            max_query_len=prompt_len, max_seq_len=prompt_len,
        )  # fmt: skip
        sync(device)
        t0 = time.perf_counter()
        hidden, _ = model(prompts, meta, kv.layers, step_fn.backend)
        last_hidden = hidden[meta.query_start_loc[1:] - 1]
        tok = model.compute_logits(last_hidden).argmax(-1)
        out = torch.empty(new_tokens, batch, dtype=torch.int64, device=device)
        out[0] = tok
        sync(device)
        t1 = time.perf_counter()
        pos = torch.full((batch,), prompt_len, device=device)
        qsl = torch.arange(batch + 1, device=device)
        for i in range(1, new_tokens):
            meta = AttentionMetadata(
                positions=pos, slot_mapping=tables[rows, pos // ps] * ps + pos % ps,
                query_start_loc=qsl, seq_lens=pos + 1, block_tables=tables, max_query_len=1,
                max_seq_len=prompt_len + i,
            )  # fmt: skip
            tok = model.compute_logits(step_fn(tok, meta)).argmax(-1)
            out[i] = tok
            pos = pos + 1
        sync(device)
        t2 = time.perf_counter()
    finally:
        for pages_of_request in owned:
            kv.allocator.free(pages_of_request)
    steps = new_tokens - 1
    return dict(
        batch=batch, prefill_s=t1 - t0, decode_s=t2 - t1,
        step_ms=1e3 * (t2 - t1) / steps,
        decode_tok_s=batch * steps / (t2 - t1),
        e2e_tok_s=batch * new_tokens / (t2 - t0),
        tokens=out.T.cpu(), prefill_hidden=last_hidden.float().cpu(),
    )  # fmt: skip


class EagerStep:
    """One decode forward through the model (eager)."""

    def __init__(self, model, kv, backend):
        self.model, self.kv, self.backend = model, kv, backend

    def __call__(self, ids, meta):
        return self.model(ids, meta, self.kv.layers, self.backend)[0]


class GraphStep:
    """One decode forward replayed from the runner's graphs."""

    def __init__(self, runner: CudaGraphRunner):
        self.runner, self.backend = runner, runner.backend

    def __call__(self, ids, meta):
        assert self.runner.can_run(meta, ids.shape[0])
        return self.runner.run(ids, meta)[0]


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over requests of the fraction of the greedy sequence before the first mismatch."""
    same = (a == b).int().cumprod(dim=1)
    return same.sum(dim=1).float().mean().item() / a.shape[1]
