"""One-off probe (GPU): offline throughput of plain decoding through the LLM API, all
requests submitted at once (prefill included), with mixed steps' attention split (decode rows
through the decode kernel) and as before (one launch, prefill tiles for every row)."""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

from specserve import LLM, SamplingParams
from specserve.layers.attention.triton_attn import TritonAttentionBackend


def run(llm, prompts, out_len):
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    return {"s": round(dt, 2), "out_tok_s": round(toks / dt, 1),
            "steps": llm.engine.num_steps}


def main():
    n, in_len, out_len = (int(a) for a in sys.argv[1:4])
    t0 = time.perf_counter()
    llm = LLM("llama-3.1-8b", load_format="dummy")
    build_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 128000) for _ in range(in_len)] for _ in range(n)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True))  # warm
    res = {"build_s": round(build_s, 1), "n": n, "in": in_len, "out": out_len}
    res["split"] = run(llm, prompts, out_len)
    short_prefix = TritonAttentionBackend.short_prefix
    TritonAttentionBackend.short_prefix = lambda self, meta, group: 0
    res["one_launch"] = run(llm, prompts, out_len)
    TritonAttentionBackend.short_prefix = short_prefix
    res["split_again"] = run(llm, prompts, out_len)
    print(json.dumps(res))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "offline_ab.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
