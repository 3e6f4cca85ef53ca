"""Prompt keys: variants of one source text share its key; a file name may hold '#'."""

from __future__ import annotations

import json

from specserve.train.prompts import PromptItem, load_prompts


def test_only_a_trailing_variant_marker_counts():
    assert (
        PromptItem("stdlib:os.path:12#v2", []).source_key,
        PromptItem("stdlib:os.path:12#v2", []).variant,
    ) == ("stdlib:os.path:12", 2)
    for key in ("chat#2.jsonl:3", "a#vx.jsonl:0"):  # '#' in a JSONL file's name
        assert (PromptItem(key, []).source_key, PromptItem(key, []).variant) == (key, 0)


def test_jsonl_file_with_hash_in_its_name_splits_per_line(tmp_path):
    path = tmp_path / "chat#v2.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(40)))
    train, heldout = load_prompts([str(path)], 0, None, 2)
    # Each line is its own source text: some are held out, the rest train.
    assert len(heldout) >= 2 and len(train) + len(heldout) == 40
    assert len({p.source_key for p in train + heldout}) == 40
