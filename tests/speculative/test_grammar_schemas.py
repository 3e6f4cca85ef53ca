"""Structured output at breadth and in distribution: 50 generated JSON schemas (nested
objects, arrays with bounds, enums, integers with ranges, required and optional fields) on a
tiny random model, every finished output valid under `jsonschema` (an implementation no one
here wrote) and, for 20 of them, greedy outputs identical with each proposer and under each
of fixed, goodput and random K; and sampled constrained decoding with speculation drawing
from the masked target distribution computed from transformers' logits (fails when drafts'
rows go unmasked)."""

from __future__ import annotations

import json
import random
from collections import Counter

import jsonschema
import pytest
import torch

from specserve import LLM, Grammar, SamplingParams
from tests.support.overlap_cases import make_models, random_draft_lens, spec_kwargs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


def _leaf(rng: random.Random) -> dict:
    kind = rng.randrange(5)
    if kind == 0:
        low = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randrange(1, 500)}
    if kind == 1:
        return {"type": "string", "maxLength": rng.randrange(1, 5)}
    if kind == 2:
        return {"enum": rng.sample(["red", "green", "blue", 3, 7, True, None], rng.randrange(2, 5))}
    if kind == 3:
        return {"type": "boolean"}
    return {"type": "array", "items": _leaf(rng), "minItems": 1, "maxItems": rng.randrange(1, 4)}


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["a", "bb", "c_d", "id", "x", "yes", "zz"], rng.randrange(1, 4))
    properties = {
        n: _object(rng, depth + 1) if depth < 1 and rng.random() < 0.3 else _leaf(rng)
        for n in names
    }
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


SCHEMAS = [_object(random.Random(i), 0) for i in range(50)]
# The ones also decoded with speculation: every other one of the first 40, which have every
# feature of the 50 between them (nested objects, optional fields, arrays of enums and of
# arrays, enums with true and null, integer ranges, bounded strings, booleans).
SPECULATED = range(0, 40, 2)


def _generate(llm, indices=None, k_mode=None):
    """Schema i's output from prompt i, for each i of `indices` (all by default)."""
    indices = range(len(SCHEMAS)) if indices is None else indices
    if k_mode == "random":
        random_draft_lens(llm)
    params = [
        SamplingParams(max_tokens=160, grammar=Grammar("json_schema", json.dumps(SCHEMAS[i])))
        for i in indices
    ]
    prompts = [[5 + i % 40, 9, 11 + i % 7] for i in indices]
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(models):
    return _generate(LLM(models["target"]))


def test_fifty_schemas_validate(plain):
    finished = [(text, s) for (_, text, reason), s in zip(plain, SCHEMAS) if reason == "stop"]
    assert len(finished) >= 45  # (bounded schemas end within the cap)
    for text, schema in finished:
        # strict JSON: no unescaped control character in a string (xgrammar let them into
        # strings with a length bound: runtime/grammar_sources.py)
        jsonschema.validate(json.loads(text), schema)


# Each proposer and each K policy at least once, in the overlapped loop (test_grammar.py
# runs every proposer in both loops): n-gram under goodput, a draft model at a fixed K,
# EAGLE-3 at a random K per request (mixed draft lengths in a step) and at a fixed K.
@pytest.mark.parametrize(
    ("drafter", "k_mode"),
    [("ngram", "goodput"), ("copy", "fixed"), ("eagle3", "random"), ("eagle3", "fixed")],
)
def test_schemas_identical_under_speculation(models, plain, drafter, k_mode):
    spec = spec_kwargs(models, drafter)
    if k_mode == "goodput":
        spec["speculative_policy"] = "goodput"
    llm = LLM(models["target"], overlap_schedule="on", **spec)
    assert _generate(llm, SPECULATED, k_mode) == [plain[i] for i in SPECULATED]


GRAMMAR = Grammar("regex", "[a-e][a-e][a-e]")


EOS = 2  # the tiny models' <|im_end|>


def _cell(tokens: tuple) -> tuple:
    """Three tokens as counted: those after an EOS pooled."""
    if EOS in tokens[:2]:
        return tokens[: tokens.index(EOS) + 1] + ("free",) * (2 - tokens.index(EOS))
    return tokens


def _masked_joint(folder: str, prompt: list[int], compiled) -> dict[tuple, float]:
    """P(three tokens) under transformers' softmax with xgrammar's mask at each position
    (after a multi-letter token, fewer letters remain; after the last, only EOS)."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    matcher = xgr.GrammarMatcher(compiled)
    vocab = model.config.vocab_size

    def masked(ids) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        probs = logits[0].softmax(-1)
        return {t: p for t, p in enumerate(probs.tolist()) if p > 0}

    joint = {}

    def walk(taken: tuple, p: float) -> None:
        if len(taken) == 3 or matcher.is_terminated():  # (past its end under ignore_eos:
            joint[_cell(taken)] = p  # any token, one pooled cell)
            return
        for token, q in masked(prompt + list(taken)).items():
            assert matcher.accept_token(token)
            walk(taken + (token,), p * q)
            matcher.rollback(1)

    walk((), 1.0)
    return joint


@pytest.mark.parametrize("drafter", [None, "random"])
def test_sampled_speculation_draws_from_the_masked_distribution(models, drafter):
    """1,200 seeded samples of three grammar-constrained tokens (with a draft model, the
    second and third verified from draft rows): a chi-square test against the masked
    distribution of transformers' logits (p > 0.001)."""
    llm = LLM(models["target"], **spec_kwargs(models, drafter))
    prompt = [5, 9, 11, 40]
    n = 1200
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, seed=s, grammar=GRAMMAR, ignore_eos=True)
        for s in range(n)
    ]
    counts = Counter(_cell(tuple(o.token_ids)) for o in llm.generate([prompt] * n, params))
    compiled = llm.engine.runner.grammars.compile(GRAMMAR)
    expected = _masked_joint(models["target"], prompt, compiled)
    assert set(counts) <= set(expected)  # only legal pairs
    # cells expected fewer than 5 times are pooled
    big = [cell for cell, p in expected.items() if p * n >= 5]
    cells = [(counts[c], expected[c] * n) for c in big]
    small = sum(counts[c] for c in expected if c not in big)
    small_expected = n - sum(e for _, e in cells)
    if small_expected > 0:
        cells.append((small, small_expected))
    chi2 = sum((obs - exp) ** 2 / exp for obs, exp in cells)
    dof = len(cells) - 1
    assert chi2 < _chi2_critical(dof), (chi2, dof)
    if drafter:
        assert sum(llm.engine.stats()["spec_position_accepted"]) > 0  # drafts were taken


def _chi2_critical(dof: int) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty's approximation)."""
    z = 3.0902  # the standard normal's 0.999 quantile
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
