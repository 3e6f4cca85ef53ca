"""CPU benchmark of a step's grammar masks (runtime/grammar.py: fill_masks) on SmolLM2's
tokenizer and a seven-field JSON schema: per batch size and draft count, the microseconds of
one step's fill as the engine does it (`default`: FILL_THREADS threads from THREADED_MIN_ROWS
rows at a position), and at each thread count at every size (1: on the calling thread).
Every request sits at its own point of a valid instance and drafts its next tokens (all
legal: every row is filled, the most work a step can bring).

    python benchmarks/cpu_grammar_masks.py [--tokenizer DIR] [--threads 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import xgrammar as xgr

from specserve import Grammar
from specserve.runtime import grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["street", "city", "zip"],
        },
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "active", "role"],
}
INSTANCE = {
    "name": "Alice Johnson",
    "age": 34,
    "email": "alice.johnson@example.com",
    "tags": ["dev", "ops", "ml"],
    "address": {"street": "12 Baker Street", "city": "London", "zip": "12345"},
    "active": True,
    "role": "admin",
}


def load_tokenizer(folder: str | None):
    from transformers import AutoTokenizer

    if folder is not None:
        return AutoTokenizer.from_pretrained(folder)
    from specserve.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


def step_us(spans, bitmask, batch_fill, reps: int) -> float:
    """Median microseconds of one step's fill."""
    grammar.fill_masks(bitmask, spans, batch_fill)  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        grammar.fill_masks(bitmask, spans, batch_fill)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


class Forced(grammar.BatchFill):
    """`threads` threads from 2 rows on."""

    def __call__(self, matchers, bitmask, rows) -> None:
        if len(matchers) == 1:
            super().__call__(matchers, bitmask, rows)
        else:
            self.threaded.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a saved Hugging Face tokenizer (default: SmolLM2's)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    vocab_size = len(tok)  # (SmolLM2's model has exactly its tokenizer's 49,152)
    compiler = grammar.GrammarCompiler(tok, vocab_size, [tok.eos_token_id])
    compiled = compiler.compile(Grammar("json_schema", json.dumps(SCHEMA)))
    tokens = tok.encode(json.dumps(INSTANCE), add_special_tokens=False)
    print(
        f"{os.cpu_count()} cores, {len(tokens)}-token instance, vocabulary {vocab_size}; "
        f"default: {grammar.FILL_THREADS} threads from {grammar.THREADED_MIN_ROWS} rows"
    )
    print("batch drafts default_us " + " ".join(f"{t:>2}thr_us" for t in args.threads))
    for num_drafts in args.drafts:
        for size in args.batch_sizes:
            spans = []
            for i in range(size):
                at = (i * 7) % (len(tokens) - num_drafts)
                matcher = xgr.GrammarMatcher(compiled)
                assert all(matcher.accept_token(t) for t in tokens[:at])
                spans.append((matcher, i * (num_drafts + 1), tokens[at : at + num_drafts]))
            bitmask = xgr.allocate_token_bitmask(size * (num_drafts + 1), vocab_size)
            default = grammar.BatchFill(grammar.FILL_THREADS)
            row = [step_us(spans, bitmask, default, args.reps)]
            row += [step_us(spans, bitmask, Forced(t), args.reps) for t in args.threads]
            print(f"{size:5} {num_drafts:6} " + " ".join(f"{t:9.0f}" for t in row))


if __name__ == "__main__":
    main()
