"""Bench inputs the user got wrong: JSONL records and matrix files of the wrong kinds are
errors naming what to fix, never tracebacks."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "hi", "max_tokens": "abc"}', "max_tokens must be a positive integer"),
        ('{"prompt": "hi", "max_tokens": [3]}', "max_tokens must be a positive integer"),
        ('{"prompt": "hi", "max_tokens": 0}', "max_tokens must be a positive integer"),
        ('{"messages": ["hi"]}', "every message must be an object"),
    ],
)
def test_bad_jsonl_records_are_dataset_errors(tmp_path, line, message):
    """Each was a traceback (or max_tokens 0 silently replaced by --output-len)."""
    from specserve.bench.datasets import DatasetError, jsonl_dataset

    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DatasetError, match=message):
        jsonl_dataset(path, 2, 16)
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match="not UTF-8"):
        jsonl_dataset(path, 2, 16)


@pytest.mark.parametrize(
    "values",
    [{"acceptance": "3.0"}, {"fixed_k": ["2"]}, {"policies": "off"}, {"concurrency": [1.5]}],
)
def test_matrix_files_of_the_wrong_types_are_refused(values):
    from specserve.bench.matrix import MatrixSpec

    with pytest.raises(ValueError, match="must be a list|must hold numbers"):
        MatrixSpec(**values)


def test_each_part_of_a_benchmark_has_prompts_of_its_own(tmp_path):
    """A sweep's points and rounds (and its warm-up) are parts: the same seed and part give
    the same prompts, other parts others, the shared prefix stays (a server's system prompt);
    part 0 is a single run's, as before parts existed. A JSONL file's parts start further
    on in it. Points that replayed earlier prompts hit the server's prefix cache."""
    from specserve.bench.datasets import WARMUP_PART, build_dataset

    def prompts(kind, part, path=None, n=4):
        d = build_dataset(kind, n, 16, 8, 0.0, path, None, 7, shared_prefix_len=5, part=part)
        return [(p.prefix, getattr(p, "prompt", None) or p.questions[0]) for p in d.prompts]

    for kind in ("random", "stdlib", "multi-turn"):
        first, again, other = prompts(kind, 1), prompts(kind, 1), prompts(kind, 2)
        assert first == again and {f[0] for f in first} == {o[0] for o in other}
        assert not {f[1] for f in first} & {o[1] for o in other}, kind
        assert prompts(kind, WARMUP_PART) != first
    from specserve.bench.datasets import random_dataset

    single = [p.prompt for p in random_dataset(4, 16, 8, 0.0, None, 7).prompts]
    assert [p for _, p in prompts("random", 0)] == single
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}"}}\n' for i in range(10)))
    assert [p for _, p in prompts("jsonl", 0, path)] == ["q0", "q1", "q2", "q3"]
    assert [p for _, p in prompts("jsonl", 2, path)] == ["q8", "q9", "q0", "q1"]
