"""Self-distillation: the target writes the replies the head learns from (specserve's own
engine, continuous batching), saved as token ids in data.jsonl; the draft vocabulary is the
most frequent target tokens of those replies."""

from __future__ import annotations

import gc
import itertools
import json
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.core.errors import RequestTooLargeError, SpecserveError
from specserve.core.sampling_params import SamplingParams
from specserve.train.config import TrainConfig
from specserve.train.prompts import (
    PromptItem,
    PromptSourceError,
    always_held_out,
    load_prompts,
    read_source,
)
from specserve.train.self_chat import (
    SELF_CHAT,
    SelfChatConfig,
    SelfChatReport,
    engine_generate,
    openers_tag,
    self_chat_prompts,
)


@dataclass
class Sample:
    """A prompt and the target's own reply as token ids (prompt first)."""

    key: str
    token_ids: list[int]
    prompt_len: int

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


class TokenIdsOnly:
    """The target's tokenizer with `decode` switched off, for the generation engine: the
    samples are token ids, and the engine's per-token detokenization (two decodes a token,
    hundreds of requests a step) would only cost time on the host. Everything else (chat
    template, special tokens) is the tokenizer's own."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def decode(self, ids, **kwargs) -> str:
        return ""

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


@dataclass
class Skipped:
    """Prompts that generation left out, counted: longer than --max-prompt-tokens or than
    the engine's context leaves room for (`too_long`), or refused by the engine as too large
    for it (`refused`: its KV cache). One such prompt is never the end of a run."""

    too_long: int = 0
    refused: int = 0


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation, ready for the assistant's reply."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def generate_samples(
    engine,
    prompts: list[PromptItem],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    max_prompt_tokens: int,
    time_budget_s: float | None = None,
    progress: bool = True,
    desc: str = "Generating",
    grace_s: float | None = None,
    min_partial_tokens: int = 16,
    skipped: Skipped | None = None,
) -> list[Sample]:
    """Run the target (a specserve LLMEngine) over the prompts with continuous batching.

    Greedy when temperature is 0, else sampled with seed + prompt index, so output does not
    depend on batching. New prompts join in bursts (when an eighth of the batch slots are
    free), so that most steps are pure decode steps, which replay CUDA graphs, and prefill
    comes in a few large chunks. With `time_budget_s`, no new prompt starts after the budget;
    those already running may finish within `grace_s` more seconds (default: a tenth of the
    budget, at least 5 s), then the rest are stopped and kept as samples when their partial
    replies (greedy prefixes of the full replies) have `min_partial_tokens` tokens or more.
    Prompts longer than `max_prompt_tokens`, or with no room for a reply in the engine's
    context, are skipped, as are those the engine refuses as too large; `skipped` counts
    them. Returns samples in prompt order."""
    tok = engine.tokenizer
    skipped = skipped if skipped is not None else Skipped()
    longest = min(max_prompt_tokens, engine.max_model_len - 1)
    slots = engine.config.scheduler.max_num_seqs
    burst = max(1, slots // 8)
    pending = iter(enumerate(prompts))
    running: dict[str, tuple[int, PromptItem, list[int]]] = {}
    latest: dict[str, object] = {}  # request id -> its last RequestOutput (live token view)
    done: dict[int, Sample] = {}
    start = time.monotonic()
    if grace_s is None and time_budget_s is not None:
        grace_s = max(5.0, 0.1 * time_budget_s)
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
    new_tokens = 0
    exhausted = False
    while True:
        elapsed = time.monotonic() - start
        if time_budget_s is not None and elapsed > time_budget_s:
            exhausted = True
        if not exhausted and len(running) <= slots - burst:
            while len(running) < slots:
                nxt = next(pending, None)
                if nxt is None:
                    exhausted = True
                    break
                index, item = nxt
                ids = chat_ids(tok, item.messages)
                if len(ids) > longest:
                    skipped.too_long += 1
                    bar.update(1)
                    continue
                params = SamplingParams(
                    max_tokens=max_new_tokens,
                    temperature=temperature,
                    seed=None if temperature == 0 else seed + index,
                )
                try:
                    running[engine.add_request(ids, params)] = (index, item, ids)
                except RequestTooLargeError:
                    skipped.refused += 1
                    bar.update(1)
        if not running:
            break
        if time_budget_s is not None and elapsed > time_budget_s + grace_s:
            for rid, (index, item, ids) in running.items():  # out of time: keep prefixes
                out = latest.get(rid)
                reply = list(out.token_ids) if out is not None else []
                engine.abort_request(rid)
                if len(reply) >= min(min_partial_tokens, max_new_tokens):
                    done[index] = Sample(item.key, ids + reply, len(ids))
                    new_tokens += len(reply)
            running.clear()
            break
        for out in engine.step():
            if out.request_id not in running:
                continue
            latest[out.request_id] = out
            if out.finished:
                index, item, ids = running.pop(out.request_id)
                del latest[out.request_id]
                done[index] = Sample(item.key, ids + list(out.token_ids), len(ids))
                new_tokens += len(out.token_ids)
                bar.update(1)
                bar.set_postfix(tok_s=f"{new_tokens / (time.monotonic() - start):.0f}")
    bar.close()
    return [done[i] for i in sorted(done)]


def build_draft_vocab(
    samples: list[Sample],
    vocab_size: int,
    draft_vocab_size: int,
    min_coverage: float | None = None,
    granularity: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t, t2d, coverage): the `draft_vocab_size` most frequent reply tokens (ties and any
    shortfall filled by prompt-token frequency, then by lowest id), sorted by id; at most
    the whole vocabulary.

    With `min_coverage`, the size is the smallest multiple of `granularity` (at most
    `draft_vocab_size`) whose tokens hold that fraction of reply tokens: a smaller draft
    vocabulary makes the head smaller and drafting cheaper. coverage is the fraction of reply
    tokens that the chosen draft vocabulary holds."""
    replies = token_counts(samples, vocab_size)
    prompts = token_counts(samples, vocab_size, replies=False)
    # Descending by (reply count, prompt count); the stable sort keeps lower ids first on ties.
    key = replies * (int(prompts.max()) + 1) + prompts
    ranked = torch.sort(key, descending=True, stable=True).indices
    draft_vocab_size = min(draft_vocab_size, vocab_size)
    if min_coverage is not None:
        curve = coverage_curve(samples, range(granularity, draft_vocab_size, granularity))
        draft_vocab_size = next(
            (n for n, c in curve.items() if c >= min_coverage), draft_vocab_size
        )
    chosen = ranked[:draft_vocab_size].sort().values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d, vocab_coverage(samples, t2d)


def token_counts(samples: list[Sample], size: int = 0, replies: bool = True) -> torch.Tensor:
    """[max(size, largest id + 1)] occurrences of every token id in the replies (or the
    prompts) of `samples`, counted in one pass over a flat tensor."""
    parts = (
        s.token_ids[s.prompt_len :] if replies else s.token_ids[: s.prompt_len] for s in samples
    )
    flat = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.int64)
    return torch.bincount(flat, minlength=size)


def coverage_curve(samples: list[Sample], sizes) -> dict[int, float]:
    """Fraction of reply tokens held by the n most frequent reply tokens, for each n."""
    counts = token_counts(samples).sort(descending=True).values.cumsum(0)
    total = max(int(counts[-1]) if len(counts) else 0, 1)
    return {n: int(counts[min(n, len(counts)) - 1]) / total if len(counts) else 0.0 for n in sizes}


def vocab_coverage(samples: list[Sample], t2d: torch.Tensor) -> float:
    """The fraction of reply tokens inside the draft vocabulary `t2d` marks."""
    counts = token_counts(samples, len(t2d))
    return int(counts[t2d.bool()].sum()) / max(int(counts.sum()), 1)


def _write_samples(path: Path, train: list[Sample], heldout: list[Sample]) -> None:
    with open(path, "w") as f:
        for split, samples in (("train", train), ("heldout", heldout)):
            for s in samples:
                f.write(
                    json.dumps(
                        {
                            "split": split,
                            "key": s.key,
                            "prompt_len": s.prompt_len,
                            "token_ids": s.token_ids,
                        }
                    )
                    + "\n"
                )


def _read_samples(path: Path) -> tuple[list[Sample], list[Sample]]:
    train, heldout = [], []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        (train if r["split"] == "train" else heldout).append(
            Sample(r["key"], r["token_ids"], r["prompt_len"])
        )
    return train, heldout


def _engine(cfg: TrainConfig, safe: bool = False):
    """The generation engine: plain decoding (no speculation: the default model would
    otherwise draft with the shipped head), KV for gen_batch sequences of full length, large
    prefill steps (prompts join in bursts), and on GPU a CUDA graph for every batch size up
    to gen_batch with the overlapped step loop; `safe`: the synchronous loop, eagerly. Its
    tokenizer decodes nothing (`TokenIdsOnly`)."""
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.model.loader import load_config, load_tokenizer, resolve_model

    page = 16
    positions = load_config(resolve_model(cfg.target)).max_position_embeddings
    max_len = min(cfg.max_prompt_tokens + cfg.max_new_tokens + 1, positions)
    pages_per_seq = -(-max_len // page) + 1
    mode = (
        dict(disable_overlap_schedule=True, disable_cuda_graph=True)
        if safe
        else dict(cuda_graph_max_batch=cfg.gen_batch)
    )
    return LLMEngine(
        EngineConfig.from_flags(
            model=cfg.target,
            dtype=cfg.dtype,
            device=cfg.device,
            page_size=page,
            num_kv_pages=cfg.gen_batch * pages_per_seq + 2,
            max_num_seqs=cfg.gen_batch,
            max_num_batched_tokens=16384,
            max_model_len=max_len,
            seed=cfg.seed,
            speculative_algorithm=None,
            **mode,
        ),
        progress=cfg.progress,
        tokenizer=TokenIdsOnly(load_tokenizer(resolve_model(cfg.target))),
    )


def _self_chat(cfg: TrainConfig, out: Path, log) -> list[PromptItem]:
    """--data self-chat: the target writes cfg.self_chat_prompts user turns (seeded by
    cfg.seed) on a generation engine of its own, let go before the replies are written.
    With --gen-time-s, no round of them is drawn past half of it (the replies get the rest).
    They are kept in out/self_chat.jsonl: a run cut before its data was written draws
    them again only if its settings changed."""
    path = out / "self_chat.jsonl"
    settings = {
        "target": cfg.target,
        "seed": cfg.seed,
        "count": cfg.self_chat_prompts,
        "answer_tokens": cfg.max_new_tokens,
    }
    settings.update(_steering(cfg))  # (none at the defaults: files before them read as ever)
    kept = _kept_self_chat(path, settings)
    if kept is not None:
        log({"event": "self_chat_reused", "prompts": len(kept), **_steering(cfg, all_=True)})
        return kept
    t0 = time.monotonic()
    engine = _engine(cfg)
    report = SelfChatReport()
    sc = SelfChatConfig(
        cfg.self_chat_prompts,
        seed=cfg.seed,
        temperatures=tuple(cfg.self_chat_temperatures),
        opener_share=cfg.self_chat_opener_share,
        answer_tokens=cfg.max_new_tokens,
        batch=cfg.gen_batch,
        deadline=None if cfg.gen_time_s is None else t0 + cfg.gen_time_s / 2,
    )
    tokenizer = engine.tokenizer._tokenizer  # (the generation engine's decodes nothing)
    items = self_chat_prompts(tokenizer, engine_generate(engine), sc, report)
    log(
        {
            "event": "self_chat",
            "prompts": report.kept,
            "two_turn": report.multi_turn,
            "opened": report.opened,
            **_steering(cfg, all_=True),
            "candidates": report.attempts,
            "dropped": report.dropped,
            "out_of_time": report.out_of_time,
            "seconds": round(time.monotonic() - t0, 1),
        }
    )
    with open(path, "w") as f:
        f.write(json.dumps({"settings": settings}) + "\n")
        for p in items:
            f.write(json.dumps({"key": p.key, "messages": p.messages}) + "\n")
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return items


def _steering(cfg: TrainConfig, all_: bool = False) -> dict:
    """How self-chat's turns were drawn beyond the seed: the temperatures and the opener
    share with its list's digest; only what differs from the defaults unless `all_`."""
    out: dict = {}
    if all_ or cfg.self_chat_temperatures != [1.0]:
        out["temperatures"] = cfg.self_chat_temperatures
    if all_ or cfg.self_chat_opener_share:
        out["opener_share"] = cfg.self_chat_opener_share
        if cfg.self_chat_opener_share:
            out["openers"] = openers_tag()
    return out


def _kept_self_chat(path: Path, settings: dict) -> list[PromptItem] | None:
    """The self-chat prompts an earlier run of these settings kept, or None."""
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    if not lines or json.loads(lines[0]).get("settings") != settings:
        return None
    return [PromptItem(r["key"], r["messages"]) for r in map(json.loads, lines[1:])]


def _generate(
    cfg: TrainConfig,
    prompts: list[PromptItem],
    heldout_prompts: list[PromptItem],
    log,
    budget_s: float | None,
    safe: bool,
) -> tuple[list[Sample], list[Sample], int, Skipped]:
    """(held-out samples, training samples, engine steps, prompts skipped) from a fresh
    engine (`_engine`); `safe` runs the synchronous loop eagerly instead."""
    t_load = time.monotonic()
    engine = _engine(cfg, safe)
    log(
        {
            "event": "engine",
            "safe": safe,
            "seconds": round(time.monotonic() - t_load, 1),
            "backend": engine.config.backend_name(),
            "device": str(engine.config.load.torch_device()),
            "cuda_graphs": engine.runner.graphs is not None,
            "max_num_seqs": cfg.gen_batch,
            "prompts": len(prompts),
            "heldout_prompts": len(heldout_prompts),
        }
    )
    gen = dict(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        seed=cfg.seed,
        max_prompt_tokens=cfg.max_prompt_tokens,
        progress=cfg.progress,
        skipped=Skipped(),
    )
    heldout = generate_samples(engine, heldout_prompts, desc="Generating (held-out)", **gen)
    train = generate_samples(engine, prompts, time_budget_s=budget_s, **gen)
    return heldout, train, engine.num_steps, gen["skipped"]


DATA_SETTINGS = "data_settings.json"  # the seed whose held-out texts data.jsonl keeps out
HELDOUT_PROMPTS = "heldout_prompts.jsonl"  # a run's held-out prompts, shipped beside its head


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def keep_heldout_out(cfg: TrainConfig, out: Path, train: list[Sample], log) -> list[Sample]:
    """The training samples without any of a prompt out/heldout_prompts.jsonl lists
    (variants of a text included). With --init-head, that head's held-out prompts (its
    heldout_prompts.jsonl) are listed there first, after the run's own, so a head trained
    further from this one keeps them out too, and so does this run resumed without the
    flag. Each seed holds out texts of its own only, and a draw takes most of a small
    offline source (stdlib: about 7,200 prompts), so without this a head's held-out prompts
    were training prompts of the head trained further from it, and "no worse on the old
    held-out set" read high. (The run's own held-out texts are in no training sample.)"""
    own_path = out / HELDOUT_PROMPTS
    own = _jsonl(own_path) if own_path.is_file() else []
    found, added = False, []
    if cfg.init_head is not None:
        path = Path(cfg.init_head) / HELDOUT_PROMPTS
        found = path.is_file()
        listed = {PromptItem(r["key"], []).source_key for r in own}
        for r in _jsonl(path) if found else []:
            key = PromptItem(r["key"], []).source_key
            if key not in listed:
                listed.add(key)
                added.append(r)
        if added:
            text = own_path.read_text() if own_path.is_file() else ""
            with open(own_path, "a") as f:
                f.write("\n" if text and not text.endswith("\n") else "")
                f.writelines(json.dumps(r) + "\n" for r in added)
    held = {PromptItem(r["key"], []).source_key for r in own + added}
    kept = [s for s in train if PromptItem(s.key, []).source_key not in held]
    if not kept:
        inherited = f" (--init-head {cfg.init_head}'s included)" if cfg.init_head else ""
        raise PromptSourceError(
            f"every training sample of {out / 'data.jsonl'} is of a prompt {own_path} holds "
            f"out{inherited}: generate data of other prompts (a new --seed)"
        )
    if cfg.init_head is not None or len(kept) < len(train):
        log(
            {
                "event": "heldout_kept_out",
                "init_head": cfg.init_head,
                "init_head_listed": found,  # (a head from elsewhere may list none)
                "listed_now": len(added),
                "held_out_prompts": len(own) + len(added),
                "dropped_samples": len(train) - len(kept),
            }
        )
    return kept


@dataclass
class _Appended:
    """What --append adds to: the samples of out/data.jsonl and the seed of the run that
    first wrote them (its held-out texts stay out)."""

    train: list[Sample]
    heldout: list[Sample]
    first_seed: int
    held_keys: set[str]  # source keys of its heldout_prompts.jsonl (a skipped one too)


def _to_append(out: Path) -> _Appended:
    data_path, settings_path = out / "data.jsonl", out / DATA_SETTINGS
    if not data_path.is_file():
        raise SpecserveError(
            f"--append: {out} holds no data.jsonl to add to; write it there with "
            "--generate-only first"
        )
    if not settings_path.is_file():
        raise SpecserveError(
            f"--append: {settings_path} is missing (data written before --append existed), "
            "so the texts its run held out cannot be told; generate the data anew"
        )
    train, heldout = _read_samples(data_path)
    held_path = out / HELDOUT_PROMPTS
    held = _jsonl(held_path) if held_path.is_file() else []
    held_keys = {PromptItem(r["key"], []).source_key for r in held}
    seed = json.loads(settings_path.read_text())["seed"]
    return _Appended(train, heldout, seed, held_keys)


def _new_prompts(
    candidates: list[PromptItem], before: _Appended, limit: int | None
) -> list[PromptItem]:
    """The candidates --append generates replies for: each text once, none that
    data.jsonl holds (trained or held out) or its first run held out (a held-out prompt
    the generation skipped too) and none that the first run's seed holds out
    (`always_held_out`: eval-draft's held-out split), at most `limit`."""
    taken = {PromptItem(s.key, []).source_key for s in before.train + before.heldout}
    taken |= before.held_keys
    new, seen = [], set()
    for p in candidates:
        if p.key in seen or p.source_key in taken or always_held_out(before.first_seed, p):
            continue
        seen.add(p.key)
        new.append(p)
    return new[:limit] if limit is not None else new


def _record_run(out: Path, cfg: TrainConfig, train_samples: int, before) -> None:
    """out/data_settings.json: the seed whose held-out texts data.jsonl keeps out (the first
    run's) and every run that wrote samples to it."""
    path = out / DATA_SETTINGS
    settings = json.loads(path.read_text()) if before is not None else {"seed": cfg.seed}
    run = {"seed": cfg.seed, "data": cfg.data, "train_samples": train_samples}
    if SELF_CHAT in cfg.data:
        run["self_chat"] = _steering(cfg, all_=True)
    settings["runs"] = [*settings.get("runs", []), run]
    path.write_text(json.dumps(settings, indent=1) + "\n")


def distill(cfg: TrainConfig, out: Path, log) -> tuple[list[Sample], list[Sample]]:
    """The (train, held-out) samples: read from out/data.jsonl on --resume, else generated
    (with --append: generated for new prompts and added to data.jsonl's)."""
    data_path = out / "data.jsonl"
    if cfg.resume and data_path.is_file():
        return _read_samples(data_path)
    before = _to_append(out) if cfg.append else None
    for name in cfg.data:  # every other source read first: one that cannot be read fails
        if name != SELF_CHAT:  # before self-chat spends minutes of generation
            read_source(name, cfg.prompt_variants)
    t0 = time.monotonic()
    made = {SELF_CHAT: _self_chat(cfg, out, log)} if SELF_CHAT in cfg.data else None
    reply_budget = cfg.gen_time_s  # (self-chat's time counts against --gen-time-s)
    if reply_budget is not None:
        reply_budget = max(0.0, reply_budget - (time.monotonic() - t0))
    prompts, heldout_prompts = load_prompts(
        cfg.data,
        cfg.seed,
        None if before is not None else cfg.num_prompts,
        cfg.heldout_prompts,
        cfg.prompt_variants,
        made,
        cfg.data_weights,
    )
    if before is not None:  # (held-out samples: the first run's)
        prompts = _new_prompts(prompts + heldout_prompts, before, cfg.num_prompts)
        heldout_prompts = []
        if not prompts:
            raise PromptSourceError(
                f"--append: every prompt of --data {cfg.data} is in {data_path} already or "
                "held out by its first run; give other sources, or a new --seed for new "
                "self-chat turns"
            )
    elif not prompts:
        raise PromptSourceError(
            f"--data {cfg.data} leaves no training prompts after the "
            f"{len(heldout_prompts)} held out"
        )
    else:
        with open(out / HELDOUT_PROMPTS, "w") as f:
            for p in heldout_prompts:
                f.write(json.dumps({"key": p.key, "messages": p.messages}) + "\n")
    t0 = time.monotonic()
    try:
        heldout, train, engine_steps, skipped = _generate(
            cfg, prompts, heldout_prompts, log, reply_budget, safe=False
        )
        failed = False
    except SpecserveError:
        raise  # the user's input or configuration: the same on any path, say it now
    except Exception as e:  # one retry on the engine's most tested path, for fixed leases
        log(
            {
                "event": "generation_failed",
                "error": repr(e)[:1000],
                "traceback": traceback.format_exc()[-3000:],
            }
        )
        failed = True
    if failed:
        gc.collect()
        spent = time.monotonic() - t0
        budget = None if reply_budget is None else max(30.0, reply_budget - spent)
        heldout, train, engine_steps, skipped = _generate(
            cfg, prompts, heldout_prompts, log, budget, safe=True
        )
    seconds = time.monotonic() - t0
    if not train:
        too_long = skipped.too_long + skipped.refused
        raise SpecserveError(
            f"generation finished no training sample within --gen-time-s {cfg.gen_time_s} "
            f"({too_long} prompts skipped as too long for --max-prompt-tokens or the "
            "target's context): raise it, lower --max-new-tokens or give shorter prompts"
        )
    gc.collect()  # the engine's KV cache and graphs: the feature store needs the memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    new_tokens = sum(s.response_len for s in train + heldout)
    log(
        {
            "event": "generated",
            "train_samples": len(train),
            "heldout_samples": len(heldout),
            "appended_to": len(before.train) if before is not None else None,
            "prompts_available": len(prompts),
            "reply_tokens": new_tokens,
            "tokens": sum(len(s.token_ids) for s in train + heldout),
            "capped_replies": sum(s.response_len >= cfg.max_new_tokens for s in train),
            "skipped_prompts": asdict(skipped),
            "engine_steps": engine_steps,
            "seconds": round(seconds, 1),
            "reply_tokens_per_s": round(new_tokens / seconds, 1),
        }
    )
    added = len(train)
    if before is not None:
        train, heldout = before.train + train, before.heldout
    _write_samples(data_path, train, heldout)
    _record_run(out, cfg, added, before)
    return train, heldout
