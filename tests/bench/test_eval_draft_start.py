"""`specserve eval-draft` starts its engine with cuBLAS and no CUDA graphs (it measures
acceptance, not speed; choosing GEMV kernels and capturing graphs took longer than the
evaluation itself on the H200), unless --serving-kernels asks for the server's set-up."""

from __future__ import annotations

import json

import pytest

from specserve.cli import main


class _Stop(Exception):
    pass


@pytest.mark.parametrize("serving", [False, True])
def test_engine_options(tmp_path, monkeypatch, serving):
    import specserve.llm as llm

    seen = {}

    def capture(self, model=None, progress=False, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(llm.LLM, "__init__", capture)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(4)))
    argv = ["eval-draft", "--data", str(data), "--split", "all", "--num-prompts", "4", "--k", "2"]
    with pytest.raises(_Stop):
        main(argv + (["--serving-kernels"] if serving else []))
    assert seen["speculative_num_steps"] == 2
    # 4 requests at once, each K + 1 verify tokens beside a prefill chunk: no step's
    # drafts are cut below K by the token budget
    assert seen["max_num_seqs"] == 4 and seen["max_num_batched_tokens"] == 4 * 3 + 2048
    if serving:
        assert "disable_gemv" not in seen and "disable_cuda_graph" not in seen
    else:
        assert seen["disable_gemv"] is True and seen["disable_cuda_graph"] is True
