"""The CUDA-graph path's padding, run eagerly on the CPU: decode and verify steps with mixed
draft lengths are padded to one length per request and to a batch bucket, and greedy output
stays identical to plain decoding."""

from __future__ import annotations

import random

from specserve import LLM, SamplingParams
from specserve.spec.policy import PerRequestPolicy
from tests.model_cases import install_padded_runner
from tests.tiny_models import VOCAB


def test_padded_graph_steps_keep_greedy_output(tiny_llama):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9, 14, 30, 5)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_llama)).generate(prompts, params)]

    llm = LLM(str(tiny_llama), speculative_algorithm="draft",
              speculative_draft_model_path=str(tiny_llama), speculative_num_steps=4,
              speculative_policy="fixed", page_size=4)
    calls = install_padded_runner(llm, tokens_per_request=(1, 2, 3, 4, 5))
    pick = random.Random(9)
    llm.engine.spec.policy = PerRequestPolicy(4, lambda req: pick.choice([0, 1, 2, 4]))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert calls["graph"] > 5  # decode/verify steps went through the padded graph path
    assert llm.engine.kv.allocator.num_used == 0
