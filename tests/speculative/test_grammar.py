"""Structured output (SamplingParams.grammar): greedy output equals transformers' generate
with xgrammar's own logits processor (its HF integration, not ours) for JSON, a JSON schema and
a regular expression; with speculation (a draft model, n-gram, EAGLE-3; fixed and random K;
both loops) it equals plain constrained decoding; sampled output, plain and speculative, is
always legal; bad grammars are refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specserve import LLM, Grammar, SamplingParams
from specserve.core.errors import InvalidRequestError
from tests.support.overlap_cases import SPECULATION_PATHS, generate, make_models, prompts_for

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
GRAMMARS = {
    "json": Grammar("json"),
    "schema": Grammar("json_schema", json.dumps(SCHEMA)),
    "regex": Grammar("regex", r"(ab|c){1,4}-[0-9]{2,3}"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


def _params(name: str, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 16), grammar=GRAMMARS[name], **kw)


def _hf_greedy(folder, prompts, grammar: Grammar, eos: list[int], max_new: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(folder),
        vocab_size=model.config.vocab_size,
        stop_token_ids=eos,
    )
    compiler = xgr.GrammarCompiler(info)
    if grammar.kind == "json":
        compiled = compiler.compile_builtin_json_grammar()
    elif grammar.kind == "json_schema":
        compiled = compiler.compile_json_schema(grammar.source, any_whitespace=False)
    else:
        compiled = compiler.compile_regex(grammar.source)
    out = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            do_sample=False,
            logits_processor=[LogitsProcessor(compiled)],
            eos_token_id=eos,
            pad_token_id=0,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_output_equals_transformers_with_xgrammar(models, name):
    prompts = prompts_for()[:5]
    llm = LLM(models["target"])
    outs = llm.generate(prompts, _params(name, max_tokens=48))
    eos = sorted(llm.engine.eos_token_ids)
    assert [o.token_ids for o in outs] == _hf_greedy(
        models["target"], prompts, GRAMMARS[name], eos, 48
    )
    finished = [o for o in outs if o.finish_reason == "stop"]
    if name != "json":  # (bounded grammars: the outputs end)
        assert len(finished) == len(outs)
    for o in finished:  # complete outputs are what the grammar describes
        if name == "schema":
            value = json.loads(o.text)
            assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
        elif name == "json":
            json.loads(o.text)
        else:
            assert re.fullmatch(GRAMMARS[name].source, o.text), o.text
    unconstrained = llm.generate(prompts, SamplingParams(max_tokens=48))
    assert [o.token_ids for o in outs] != [o.token_ids for o in unconstrained]


def _every_grammar() -> tuple[list, list, list[str]]:
    """Every prompt under each grammar, in one batch: prompts, parameters, grammar names."""
    names = [name for name in GRAMMARS for _ in prompts_for()]
    return prompts_for() * len(GRAMMARS), [_params(name) for name in names], names


@pytest.fixture(scope="module")
def plain(models):
    prompts, params, _ = _every_grammar()
    return generate(models, prompts, params, "off")[1]


@pytest.mark.parametrize(("drafter", "overlap", "random_k"), SPECULATION_PATHS)
def test_speculation_keeps_plain_constrained_output(models, plain, drafter, overlap, random_k):
    prompts, params, names = _every_grammar()
    llm, outs = generate(models, prompts, params, overlap, drafter, random_k=random_k)
    assert outs == plain, sorted({n for n, a, b in zip(names, outs, plain) if a != b})
    waits = llm.engine.stats()["loop_wait_reasons"]
    if overlap == "on" and drafter == "eagle3" and not random_k:
        # steps built on the step in flight (drafts on the device): the masks follow its
        # tokens, read once the step's forward is queued (host drafters wait before it)
        assert waits.get("grammar_before_sampling", 0) > 0


def _legal(llm, grammar: Grammar, tokens: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(llm.engine.runner.grammars.compile(grammar))
    return all(matcher.is_terminated() or matcher.accept_token(t) for t in tokens)


@pytest.fixture(scope="module")
def plain_sampled(models):
    llm, prompts = LLM(models["target"]), prompts_for()
    return {
        name: [
            o.token_ids
            for o in llm.generate(
                prompts, [_params(name, temperature=1.5, seed=i, max_tokens=20) for i in range(8)]
            )
        ]
        for name in GRAMMARS
    }


@pytest.mark.parametrize("drafter", [None, "random", "eagle3"])
def test_sampled_output_is_always_legal(models, plain_sampled, drafter):
    """Sampled at temperature 1.5 with and without speculation (drafts accepted where they
    equal the target's draw from the masked distribution): every token of every output is
    one the grammar allows, and speculation's output is plain sampling's."""
    prompts = prompts_for()
    llm = LLM(models["target"], **(_spec(models, drafter)))
    for name in GRAMMARS:
        params = [_params(name, temperature=1.5, seed=i, max_tokens=20) for i in range(8)]
        outs = llm.generate(prompts, params)
        assert all(_legal(llm, GRAMMARS[name], o.token_ids) for o in outs), name
        assert len({tuple(o.token_ids) for o in outs}) > 4  # sampled, not one answer
        assert [o.token_ids for o in outs] == plain_sampled[name], name


def _spec(models, drafter):
    from tests.support.overlap_cases import spec_kwargs

    return spec_kwargs(models, drafter)


def test_bad_grammars_are_refused(models):
    llm = LLM(models["target"])
    with pytest.raises(InvalidRequestError, match="the JSON schema is not JSON") as e:
        llm.engine.add_request([5, 6], SamplingParams(grammar=Grammar("json_schema", "{oops")))
    assert e.value.field == "grammar"
    impossible = {"type": "array", "prefixItems": [], "items": False, "minItems": 2}
    with pytest.raises(InvalidRequestError, match="json_schema grammar cannot be used"):
        llm.engine.add_request(
            [5, 6], SamplingParams(grammar=Grammar("json_schema", json.dumps(impossible)))
        )
    with pytest.raises(InvalidRequestError, match="regex grammar cannot be used"):
        llm.engine.add_request([5, 6], SamplingParams(grammar=Grammar("regex", "(unclosed")))
    with pytest.raises(InvalidRequestError, match="grammar kind must be one of"):
        Grammar("yaml", "x")
    with pytest.raises(InvalidRequestError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, grammar=Grammar("json"))
    assert not llm.engine.requests and llm.engine.kv.allocator.num_used == 0


def test_schema_features_it_cannot_enforce_are_named():
    """xgrammar compiles these but lets instances violating them through (checked here with
    one such instance each, so the list stays honest): they are refused by name."""
    from specserve.runtime.schema_checks import unsupported_schema_features

    unenforced = {
        "not": ({"properties": {"a": {"not": {"type": "string"}}}}, {"a": "x"}),
        "uniqueItems": (
            {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            ["a", "a"],
        ),
        "allOf": ({"allOf": [{"required": ["a"]}, {"required": ["b"]}]}, {"a": 1}),
        "format 'iri'": ({"type": "string", "format": "iri"}, "%"),
    }
    tok = _tokenizer()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, stop_token_ids=[2]))
    for name, (schema, instance) in unenforced.items():
        assert unsupported_schema_features(schema) == [name]
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        text = json.dumps(instance)
        assert all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
    nested = {
        "type": "object",
        "properties": {"if": {"type": "string"}, "b": {"$ref": "https://x.org/s.json"}},
        "$defs": {"d": {"type": "string", "dependentRequired": {"a": ["b"]}, "format": "date"}},
    }
    assert unsupported_schema_features(nested) == [
        "$ref 'https://x.org/s.json' (only references within the schema)",
        "dependentRequired",
    ]
    assert unsupported_schema_features(SCHEMA) == []


def _rejected(matcher: xgr.GrammarMatcher, vocab: int) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    return set(xgr.testing._get_masked_tokens_from_bitmask(bitmask, vocab))


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_no_grammar_allows_a_special_token_but_the_stop_token_ends_one(kind):
    """The tokenizer's special tokens other than the stop tokens are special to xgrammar:
    its own tables read `<|im_start|>` as its text, which then filled a JSON string and was
    dropped from the returned text (the detokenizer skips special tokens). Every other
    token's mask is xgrammar's own, and the stop token still ends a finished grammar."""
    from specserve.runtime.grammar import GrammarCompiler
    from specserve.runtime.grammar_sources import schema_grammar
    from tests.support.tiny_models import VOCAB, make_sentencepiece_tokenizer

    tok = _tokenizer() if kind == "byte-level" else make_sentencepiece_tokenizer()
    stop = tok.eos_token_id
    special = set(tok.all_special_ids) | {
        i for i, token in tok.added_tokens_decoder.items() if token.special
    }
    special.discard(stop)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[stop])
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}})
    ours = GrammarCompiler(tok, VOCAB, [stop]).compile(Grammar("json_schema", schema))
    theirs = xgr.GrammarCompiler(info).compile_grammar(schema_grammar(schema))
    ours, theirs = xgr.GrammarMatcher(ours), xgr.GrammarMatcher(theirs)
    for i, text in enumerate(['{"s": "', "ab", '"', "}"]):
        assert ours.accept_string(text) and theirs.accept_string(text)
        rejected = _rejected(theirs, VOCAB)
        if i < 2:  # inside the string, xgrammar alone allows them
            assert special - rejected
        assert _rejected(ours, VOCAB) == rejected | special
    assert stop not in _rejected(ours, VOCAB) and ours.accept_token(stop)
    assert ours.is_terminated()


def _tokenizer():
    import tempfile
    from pathlib import Path

    from tests.support.tiny_models import make_tokenizer

    return make_tokenizer(Path(tempfile.mkdtemp()))


@pytest.mark.parametrize("drafter", ["copy", "eagle3"])
def test_past_the_grammars_end_under_ignore_eos(models, drafter):
    """ignore_eos runs past a bounded grammar's end: every row there is free, as plain
    decoding's are, also the rows after a draft that ends the grammar."""
    params = _params("regex", ignore_eos=True, max_tokens=24)
    plain = generate(models, prompts_for(), params, "off")[1]
    assert all(len(tokens) == 24 for tokens, _, _ in plain)
    assert _run_spec(models, params, drafter) == plain


def _run_spec(models, params, drafter):
    return generate(models, prompts_for(), params, "on", drafter)[1]


def test_rows_after_a_draft_that_ends_the_grammar_are_free():
    """The row after a drafted EOS that ends the grammar is verified under ignore_eos: its
    mask allows every token, as plain decoding's row after a committed EOS does (rows after
    an illegal draft repeat the mask before it: never read)."""
    from specserve.runtime.grammar import BatchFill, GrammarCompiler, GrammarState, fill_masks

    tok = _tokenizer()
    compiler = GrammarCompiler(tok, 384, [2])
    state = GrammarState(xgr.GrammarMatcher(compiler.compile(Grammar("regex", "ab"))))
    state.follow(tok.encode("ab", add_special_tokens=False))
    bitmask = xgr.allocate_token_bitmask(4, 384)
    fill_masks(bitmask, [(state.matcher, 0, [2, 7, 9])], BatchFill())  # EOS, then anything
    assert (bitmask[1:] == -1).all()  # free past the end
    assert (bitmask[0] != -1).any()  # only EOS before it
    assert not state.matcher.is_terminated()  # rolled back
    state = GrammarState(xgr.GrammarMatcher(compiler.compile(Grammar("regex", "ab"))))
    bitmask = xgr.allocate_token_bitmask(3, 384)
    fill_masks(bitmask, [(state.matcher, 0, [2, 7])], BatchFill())  # an illegal first draft
    assert (bitmask[1] == bitmask[0]).all() and (bitmask[2] == bitmask[0]).all()


class _HostWrites(TorchDispatchMode):
    """Records the torch operators that write a host int32 tensor of `size` elements or more
    (views and uninitialized allocations aside: the allocations are counted by address)."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.seen = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.overloadpacket is not torch.ops.aten.empty:
            for t in tree_leaves(out):
                big = isinstance(t, torch.Tensor) and t.numel() >= self.size
                if big and t.dtype == torch.int32 and t.device.type == "cpu":
                    self.seen.append(func)
        return out


def test_a_steps_masks_reuse_host_memory_and_no_torch_op_fills_them(models, monkeypatch):
    """A step's bitmask is host memory kept for the engine's life (two buffers in turn,
    reset with numpy: runtime/grammar.py MaskBuffer), never a fresh tensor filled by torch:
    on a GPU that was a pinned allocation a step, and a torch fill of a 64-row mask (98k
    integers) woke torch's intra-op threads, which on a loaded host held the step for
    milliseconds. Greedy output is unchanged (the tests above)."""
    from specserve.runtime import logit_shaping

    llm = LLM(models["target"], overlap_schedule="on")
    words = xgr.get_bitmask_shape(1, llm.engine.runner.grammars.vocab_size)[1]
    bitmasks, writes = [], []
    apply, mask = xgr.apply_token_bitmask_inplace, logit_shaping.mask_grammars

    def applied(logits, bitmask, **kw):
        bitmasks.append(bitmask)  # (kept alive: a fresh tensor a step would not share memory)
        apply(logits, bitmask, **kw)

    def masked(out, step, compiler):
        with _HostWrites(out.shape[0] * words) as mode:
            mask(out, step, compiler)
        writes.extend(mode.seen)

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", applied)
    monkeypatch.setattr(logit_shaping, "mask_grammars", masked)
    llm.generate(prompts_for(), _params("schema", max_tokens=12))
    assert len(bitmasks) > 10
    assert len({b.untyped_storage().data_ptr() for b in bitmasks}) <= 2
    assert writes == []


def test_matchers_follow_output_and_unprocessed_tokens_apart():
    """A matcher takes a request's output and the tokens of the step not yet processed
    without their lists joined (a copy of the whole output each step), and the same tokens
    once processing moved them into the output are not taken twice."""
    from specserve.runtime.grammar import GrammarCompiler, GrammarState

    tok = _tokenizer()
    compiler = GrammarCompiler(tok, 384, [2])
    text = tok.encode("ababc-12", add_special_tokens=False)
    compiled = compiler.compile(Grammar("regex", r"(ab|c){1,4}-[0-9]{2,3}"))
    state = GrammarState(xgr.GrammarMatcher(compiled))
    state.follow(text[:2], text[2:4])
    state.follow(text[:4], [])  # processed: the same tokens, now output
    state.follow(text[:4], text[4:])
    whole = xgr.GrammarMatcher(compiled)
    assert all(whole.accept_token(t) for t in text)
    assert state.num_taken == len(text)
    assert state.matcher.accept_token(2) and whole.accept_token(2)  # both at the end


def test_the_mask_kernel_is_warmed_for_each_specialization(monkeypatch):
    """At start-up on a device whose mask kernel compiles on first use (Triton on a GPU:
    one compilation per row count that is 1, divisible by 16 or neither, and per logits
    dtype), it runs once for each, every token allowed; on a CPU (a C++ kernel) not at all."""
    from specserve.runtime.grammar import GrammarCompiler

    calls = []

    def spy(logits, bitmask, *, vocab_size):
        calls.append((logits.shape[0], logits.dtype, logits.device.type, vocab_size))
        assert logits.shape == (logits.shape[0], vocab_size)
        assert bitmask.shape == xgr.get_bitmask_shape(logits.shape[0], vocab_size)

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", spy)
    tok = _tokenizer()
    compiler = GrammarCompiler(tok, len(tok), [])
    compiler.warm_up(torch.device("cpu"), torch.bfloat16)
    assert calls == []
    compiler.warm_up(torch.device("meta"), torch.bfloat16)
    rows = {r for r, _, _, _ in calls}
    assert any(r == 1 for r in rows) and any(r % 16 == 0 for r in rows)
    assert any(r > 1 and r % 16 for r in rows)
    assert {(r, d) for r, d, _, _ in calls} == {
        (r, d) for r in rows for d in (torch.float32, torch.bfloat16)
    }
    assert {v for *_, v in calls} == {len(tok)}
