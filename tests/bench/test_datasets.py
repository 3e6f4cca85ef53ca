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
    part 0 is a single run's, as before parts existed. Points that replayed earlier prompts
    hit the server's prefix cache."""
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


def test_jsonl_parts_take_the_records_after_the_last_parts(tmp_path):
    """A JSONL file's parts of different sizes (a sweep's levels) took records from
    part x n on: round 2's points resent round 1's into servers that had cached them, and
    the warm-up's record (the last) was a point's. Now the warm-up has record 0 and each
    part the records after the parts before it; where the file runs out, the records taken
    again are counted and said."""
    from specserve.bench.datasets import WARMUP_PART, RecordCursor, build_dataset

    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}"}}\n' for i in range(40)))
    records = RecordCursor()

    def part(n, number):
        start = records.start(number, n)
        d = build_dataset("jsonl", n, 16, 8, 0, str(path), None, 0, part=number, record_start=start)
        return d, [int(p.prompt[1:]) for p in d.prompts]

    warm, warm_ids = part(1, WARMUP_PART)
    sizes = [4, 8, 16, 4, 8]  # (levels 1, 4, 8 at 2 requests each, num_prompts 4; 2 rounds)
    made = [part(n, number) for number, n in enumerate(sizes, 1)]
    assert warm_ids == [0] and part(1, WARMUP_PART)[1] == [0]  # (every server's warm-up)
    sent = [i for _, ids in made[:4] for i in ids]
    assert sent == list(range(1, 33)) and all(d.reused_prompts == 0 for d, _ in made[:4])
    last, ids = made[4]  # records 33..40 of 40: 33..39, then record 0 again
    assert ids == [33, 34, 35, 36, 37, 38, 39, 0] and last.reused_prompts == 1
    assert "1 of these 8 are records reused" in last.notes[0] and not warm.notes
    single = build_dataset("jsonl", 42, 16, 8, 0.0, str(path), None, 0)
    assert single.reused_prompts == 2 and "this run sends 42" in single.notes[0]
