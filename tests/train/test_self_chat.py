"""--data self-chat: the target writes user turns from the chat template's user-turn prefix
(the Magpie recipe); kept turns ended at end-of-turn, are long enough, hold no template text
and are new; a share grows into two-turn conversations; everything repeats under a seed."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from specserve.core.sampling_params import SamplingParams
from specserve.train.prompts import PromptSourceError, load_prompts, read_source
from specserve.train.self_chat import (
    OPENERS,
    SELF_CHAT,
    SelfChatConfig,
    SelfChatError,
    SelfChatReport,
    draw_opener,
    draw_seed,
    engine_generate,
    openers_tag,
    self_chat_prompts,
    special_texts,
    user_turn_prefix,
)
from tests.support.train_cases import make_target, train_config, write_prompt_file


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("self_chat_target"))


@pytest.fixture(scope="module")
def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target))


def test_the_user_turn_prefix_is_the_template_up_to_the_users_text(tokenizer):
    first = user_turn_prefix(tokenizer, [])
    assert tokenizer.decode(first) == "<|im_start|>user\n"
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    second = tokenizer.decode(user_turn_prefix(tokenizer, history))
    assert second == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\n"
    )
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(special_texts(tokenizer))


def test_a_template_that_changes_the_users_text_is_refused(tokenizer):
    import copy

    upper = copy.deepcopy(tokenizer)
    upper.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}"
        "<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(SelfChatError, match="does not copy a user message's text"):
        user_turn_prefix(upper, [])


class Scripted:
    """A stand-in for the target: each candidate's turn follows from its sampling seed, so a
    run repeats itself under a seed; answers (greedy) are one sentence."""

    TURNS = [
        ("How do I keep basil alive on a windowsill?", "stop"),
        ("", "stop"),  # empty
        ("What is <|im_start|>assistant a list?", "stop"),  # the template leaking in
        ("Why?", "stop"),  # too short
        ("how do i keep basil   alive on a windowsill", "stop"),  # a duplicate
        ("Tell me about the history of the bicycle and", "length"),  # unfinished
    ]

    def __init__(self, tokenizer, seed: int = 0):
        self.tok = tokenizer
        self.first = user_turn_prefix(tokenizer, [])
        self.prompts: list[list[int]] = []
        # candidate i of a run of `seed` draws with draw_seed(seed, i): its script by i
        self.index = {draw_seed(seed, i): i for i in range(4096)}

    def __call__(self, prompts, params):
        self.prompts += prompts
        out = []
        for prompt, p in zip(prompts, params):
            if p.temperature == 0:  # an answer
                text, reason = "Water it twice a week.", "stop"
            elif p.seed not in self.index:  # a second turn: new unless its seed says otherwise
                text, reason = f"And in winter, case {p.seed % 4}?", "stop"
            elif prompt != self.first:  # after an opener: what follows it
                text, reason = f" case {self.index[p.seed]} of an opened turn?", "stop"
            else:
                i = self.index[p.seed]
                text, reason = self.TURNS[i % len(self.TURNS)]
                if i % len(self.TURNS) == 0 and i >= len(self.TURNS):
                    text = f"Question {i}: how do I keep basil alive on a windowsill?"
            out.append((self.tok.encode(text, add_special_tokens=False), reason))
        return out


def _first_turns(report: dict | SelfChatReport) -> int:
    """Candidates accounted for: first turns kept, and those dropped (second turns apart)."""
    kept, dropped = (
        (report.kept, report.dropped)
        if isinstance(report, SelfChatReport)
        else (report["prompts"], report["dropped"])
    )
    return kept + sum(n for why, n in dropped.items() if not why.startswith(("second", "answer")))


def _run(tokenizer, seed, count=5, **kw):
    report = SelfChatReport()
    cfg = SelfChatConfig(count, seed=seed, batch=4, multi_turn_share=0.5, **kw)
    items = self_chat_prompts(tokenizer, Scripted(tokenizer, seed), cfg, report)
    return items, report


def test_turns_are_filtered_deduplicated_and_repeat_under_a_seed(tokenizer):
    items, report = _run(tokenizer, seed=0)
    assert len(items) == report.kept == 5 and _first_turns(report) == report.attempts
    again, _ = _run(tokenizer, seed=0)
    assert [(p.key, p.messages) for p in items] == [(p.key, p.messages) for p in again]
    other, _ = _run(tokenizer, seed=1)
    assert [p.messages for p in other] != [p.messages for p in items]
    specials = special_texts(tokenizer)
    for p in items:
        assert p.key.startswith(f"{SELF_CHAT}/") and p.source_key == p.key
        assert [m["role"] for m in p.messages] in (
            ["user"],
            ["user", "assistant", "user"],
        )
        for m in p.messages:
            assert m["content"] == m["content"].strip() and len(m["content"].split()) >= 2
            assert not any(s in m["content"] for s in specials)
    assert len({p.key for p in items}) == len(items)
    firsts = [p.messages[0]["content"].lower() for p in items]
    assert len(set(firsts)) == len(firsts)
    assert report.multi_turn == sum(len(p.messages) == 3 for p in items) > 0
    for reason in ("empty", "template", "short", "duplicate", "unfinished"):
        assert report.dropped.get(reason, 0) > 0, reason
    # the second turn repeats the first's answer history and is new too
    for p in items:
        if len(p.messages) == 3:
            assert p.messages[1]["content"] == "Water it twice a week."
            assert p.messages[2]["content"] != p.messages[0]["content"]


def test_attempts_are_bounded_when_turns_run_out(tokenizer):
    items, report = _run(tokenizer, seed=0, count=1000, max_attempts=30)
    assert report.attempts == 30 and len(items) < 30


def test_self_chat_is_made_by_train_eagle3_not_read():
    with pytest.raises(PromptSourceError, match="written by the target"):
        read_source(SELF_CHAT)
    from specserve.train.prompts import PromptItem

    made = [
        PromptItem(f"{SELF_CHAT}/{i}", [{"role": "user", "content": f"q {i}"}]) for i in range(50)
    ]
    train, heldout = load_prompts([SELF_CHAT], 0, None, 3, made={SELF_CHAT: made})
    assert len(heldout) == 3 and len(train) == 47
    assert {p.key for p in train} | {p.key for p in heldout} == {p.key for p in made}


def test_through_the_engine_every_candidate_starts_at_the_user_prefix(target, tokenizer):
    """The real engine writes the candidates (a random tiny model: few end at end-of-turn);
    every prompt is the template's user prefix, every candidate finishes, and a second run
    with the same seed draws the same turns."""
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_flags(model=str(target), max_num_seqs=8, num_kv_pages=64))
    seen = []

    def generate(prompts, params):
        seen.append((prompts, params))
        return engine_generate(engine)(prompts, params)

    cfg = SelfChatConfig(
        4, seed=3, max_turn_tokens=6, min_chars=1, min_words=1, batch=8, max_attempts=16
    )
    reports = [SelfChatReport(), SelfChatReport()]
    runs = [self_chat_prompts(tokenizer, generate, cfg, r) for r in reports]
    assert [p.messages for p in runs[0]] == [p.messages for p in runs[1]]
    assert reports[0].attempts == 16 or reports[0].kept == 4
    prefix = user_turn_prefix(tokenizer, [])
    firsts = [
        (pr, pa)
        for prompts, params in seen
        for pr, pa in zip(prompts, params)
        if pa.temperature > 0 and pr == prefix
    ]
    assert len(firsts) == reports[0].attempts + reports[1].attempts
    assert all(isinstance(pa, SamplingParams) and pa.max_tokens == 6 for _, pa in firsts)
    assert not engine.has_unfinished()
    assert _first_turns(reports[0]) == reports[0].attempts


def test_distillation_with_self_chat_logs_it_and_trains_on_the_rest(target, tmp_path):
    """train-eagle3 --data self-chat FILE: the target writes its self-chat prompts first (an
    event in the log), then the replies to every prompt."""
    from specserve.train.distill import distill

    prompt_file = write_prompt_file(tmp_path / "prompts.jsonl")
    cfg = train_config(
        tmp_path,
        target,
        prompt_file,
        data=[SELF_CHAT, str(prompt_file)],
        self_chat_prompts=3,
        max_new_tokens=4,
        num_prompts=8,
    )
    records = []
    train, heldout = distill(cfg, tmp_path, records.append)
    events = [r for r in records if r.get("event") == "self_chat"]
    assert len(events) == 1 and events[0]["candidates"] > 0
    assert _first_turns(events[0]) == events[0]["candidates"]
    assert len(train) == 8 and len(heldout) == 4


def test_neighbouring_seeds_share_no_draw_and_a_deadline_stops_the_rounds(tokenizer):
    """Seeds s and s+1 drew the same candidates but one (seed + index), so a second seed's
    data was the first's; past the deadline no round is drawn and the turns kept stay."""
    assert not {draw_seed(0, i) for i in range(2000)} & {draw_seed(1, i) for i in range(2000)}
    items, report = _run(tokenizer, seed=0, deadline=time.monotonic() - 1.0)
    assert items == [] and report.attempts == 0 and report.out_of_time


def test_other_sources_are_read_before_self_chat_is_drawn(tmp_path, monkeypatch):
    """A missing file named beside self-chat failed only after minutes of drawing."""
    from specserve.train import distill
    from specserve.train.config import TrainConfig
    from specserve.train.prompts import PromptSourceError

    monkeypatch.setattr(distill, "_engine", lambda cfg: pytest.fail("self-chat was drawn"))
    cfg = TrainConfig(target="t", data=[SELF_CHAT, str(tmp_path / "missing.jsonl")], out="o")
    with pytest.raises(PromptSourceError, match="missing.jsonl"):
        distill.distill(cfg, tmp_path, lambda record: None)


def test_draws_take_the_temperatures_in_turn_and_keep_the_defaults_seeds(tokenizer):
    """`temperatures` (0.6, 1.0): first-turn draw i samples at T[i mod 2], the second turn of
    conversation i at T[i mod 2]; the seeds are the single-temperature run's, and a default
    run draws every turn at 1.0 from the plain prefix, as before the option."""
    seen = []
    script = Scripted(tokenizer, 0)

    def generate(prompts, params):
        seen.extend(zip(prompts, params))
        return script(prompts, params)

    temps = (0.6, 1.0)
    cfg = SelfChatConfig(5, seed=0, batch=4, multi_turn_share=0.5, temperatures=temps)
    self_chat_prompts(tokenizer, generate, cfg)
    firsts = [p for _, p in seen if p.seed in script.index]
    assert [p.temperature for p in firsts] == [temps[i % 2] for i in range(len(firsts))]
    assert [p.seed for p in firsts] == [draw_seed(0, i) for i in range(len(firsts))]
    second_of = {draw_seed(0, f"second {i}"): i for i in range(64)}
    seconds = [p for _, p in seen if p.seed in second_of]
    assert len(seconds) > 1 and len({p.temperature for p in seconds}) == 2
    assert all(p.temperature == temps[second_of[p.seed] % 2] for p in seconds)
    seen.clear()
    self_chat_prompts(tokenizer, generate, SelfChatConfig(5, seed=0, batch=4, multi_turn_share=0.5))
    drawn = [(prompt, p) for prompt, p in seen if p.temperature > 0]
    assert drawn and all(p.temperature == 1.0 for _, p in drawn)
    assert all(prompt == script.first for prompt, p in drawn if p.seed in script.index)


def test_openers_are_drawn_by_share_and_seed():
    """draw_opener: about the share of draws get an opener, every stem of OPENERS among them,
    the same ones again under the seed, others under another, none at share 0."""
    cfg = SelfChatConfig(10, seed=0, opener_share=0.5)
    picks = [draw_opener(cfg, d) for d in range(2000)]
    assert 0.45 < sum(map(bool, picks)) / len(picks) < 0.55
    assert set(picks) - {""} == set(OPENERS)
    assert picks == [draw_opener(cfg, d) for d in range(2000)]
    assert picks != [
        draw_opener(SelfChatConfig(10, seed=1, opener_share=0.5), d) for d in range(2000)
    ]
    assert not any(draw_opener(SelfChatConfig(10, seed=0), d) for d in range(2000))


def test_a_share_of_first_turns_starts_from_an_opener(tokenizer):
    """opener_share 0.5: about half the first-turn draws are the user prefix then an opener's
    tokens, the turn kept being the opener and what the target wrote after it (at least two
    words of its own: a bare stem is dropped as short); the draws repeat under a seed."""
    seen = []
    script = Scripted(tokenizer, 0)

    def generate(prompts, params):
        seen.extend(zip(prompts, params))
        return script(prompts, params)

    cfg = SelfChatConfig(40, seed=0, batch=16, multi_turn_share=0.25, opener_share=0.5)
    report = SelfChatReport()
    items = self_chat_prompts(tokenizer, generate, cfg, report)
    firsts = [prompt for prompt, p in seen if p.temperature > 0 and p.seed in script.index]
    first = script.first
    assert all(prompt[: len(first)] == first for prompt in firsts)
    opened = [prompt[len(first) :] for prompt in firsts if prompt != first]
    assert 0.3 < len(opened) / len(firsts) < 0.7
    assert {tokenizer.decode(tail) for tail in opened} <= set(OPENERS)
    steered = [
        p.messages[0]["content"] for p in items if "of an opened turn" in p.messages[0]["content"]
    ]
    assert report.opened == len(steered) > 0
    assert all(any(t.startswith(o + " case ") for o in OPENERS) for t in steered)
    again = self_chat_prompts(tokenizer, Scripted(tokenizer, 0), cfg)
    assert [p.messages for p in again] == [p.messages for p in items]

    def bare(prompts, params):  # the target ends the turn (almost) at once after the opener
        return [
            (tokenizer.encode(" it?", add_special_tokens=False), "stop")
            if prompt != first and p.seed in script.index
            else out
            for prompt, p, out in zip(prompts, params, script(prompts, params))
        ]

    report = SelfChatReport()
    self_chat_prompts(tokenizer, bare, replace(cfg, max_attempts=64), report)
    assert report.opened == 0 and report.dropped["short"] >= len(opened) / 2


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_the_opener_share_is_a_share(share):
    from specserve.train.config import TrainConfig

    with pytest.raises(ValueError, match="opener_share must be in"):
        SelfChatConfig(3, opener_share=share)
    with pytest.raises(ValueError, match="opener_share must be in"):
        TrainConfig(out="o", self_chat_opener_share=share)


@pytest.mark.parametrize("temperatures", [(), (0.0,), (0.6, -1.0), (float("nan"),), (150.0,)])
def test_temperatures_are_in_the_samplers_range_and_not_greedy(temperatures):
    from specserve.train.config import TrainConfig

    message = r"--self-chat-temperatures must be one or more numbers in \(0, 100\]"
    with pytest.raises(ValueError, match=message):
        SelfChatConfig(3, temperatures=temperatures)
    with pytest.raises(ValueError, match=message):
        TrainConfig(out="o", self_chat_temperatures=list(temperatures))


def test_train_eagle3_passes_the_steering_and_redraws_when_it_changes(
    tokenizer, tmp_path, monkeypatch
):
    """--self-chat-temperatures and --self-chat-opener-share reach the draws, the log event
    and the kept prompts' settings, and each run's record in data_settings.json: a run of
    the same settings reuses out/self_chat.jsonl, one of another mix draws again, and a file
    kept before the options existed is reused at the defaults."""
    from types import SimpleNamespace

    from specserve.cli import build_parser
    from specserve.train import distill
    from specserve.train.config import TrainConfig, config_from_args

    seen = []
    script = Scripted(tokenizer, 0)

    def generate(prompts, params):
        seen.extend(params)
        return script(prompts, params)

    engine = SimpleNamespace(tokenizer=SimpleNamespace(_tokenizer=tokenizer))
    monkeypatch.setattr(distill, "_engine", lambda cfg: engine)
    monkeypatch.setattr(distill, "engine_generate", lambda engine: generate)
    args = build_parser().parse_args(
        ["train-eagle3", "--out", str(tmp_path), "--data", SELF_CHAT, "--self-chat-prompts", "3"]
        + ["--self-chat-temperatures", "0.6", "1", "--self-chat-opener-share", "0.5"]
    )
    cfg = config_from_args(args)
    assert cfg.self_chat_temperatures == [0.6, 1.0] and cfg.self_chat_opener_share == 0.5
    records = []
    items = distill._self_chat(cfg, tmp_path, records.append)
    assert len(items) == 3 and {p.temperature for p in seen if p.temperature} == {0.6, 1.0}
    steering = {"temperatures": [0.6, 1.0], "opener_share": 0.5, "openers": openers_tag()}
    event = records[0]
    assert event["event"] == "self_chat" and {k: event[k] for k in steering} == steering
    opened = sum("of an opened turn" in p.messages[0]["content"] for p in items)
    assert event["opened"] == opened
    lines = (tmp_path / "self_chat.jsonl").read_text().splitlines()
    settings = json.loads(lines[0])["settings"]
    assert {k: settings[k] for k in steering} == steering
    drawn = len(seen)
    assert distill._self_chat(cfg, tmp_path, records.append) == items and len(seen) == drawn
    assert records[-1]["event"] == "self_chat_reused" and records[-1]["opener_share"] == 0.5
    # (a tuple, as code may give it, is the same settings as the CLI's list)
    same = TrainConfig(**{**vars(cfg), "self_chat_temperatures": (0.6, 1)})
    assert distill._self_chat(same, tmp_path, records.append) == items and len(seen) == drawn
    distill._record_run(tmp_path, cfg, 3, None)
    run = json.loads((tmp_path / distill.DATA_SETTINGS).read_text())["runs"][0]
    assert run["self_chat"] == steering
    default = replace(cfg, self_chat_temperatures=[1.0], self_chat_opener_share=0.0)
    distill._self_chat(default, tmp_path, records.append)
    assert len(seen) > drawn and {p.temperature for p in seen[drawn:] if p.temperature} == {1.0}
    # a file written before the options: its settings hold none of their keys
    old = {"target": None, "seed": 0, "count": 3, "answer_tokens": cfg.max_new_tokens}
    rows = [json.dumps({"key": p.key, "messages": p.messages}) for p in items]
    (tmp_path / "self_chat.jsonl").write_text("\n".join([json.dumps({"settings": old}), *rows]))
    drawn = len(seen)
    assert distill._self_chat(default, tmp_path, records.append) == items and len(seen) == drawn
