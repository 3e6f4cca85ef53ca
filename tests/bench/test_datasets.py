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
