"""`specserve train-eagle3`: self-distill, record target features, train with the
training-time test, evaluate on held-out prompts, save the head in the public layout.

Files in --out: data.jsonl (prompt + reply token ids of every sample, reused on --resume),
heldout_prompts.jsonl, log.jsonl (the training curve), state.pt (resumable checkpoint:
head, optimizer, schedule, step), metrics.json, and the head (config.json, model.safetensors).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.core.errors import SpecserveError
from specserve.model.eagle3 import Eagle3Head
from specserve.model.eagle3_config import check_aux_layer_ids
from specserve.model.loader import load_config, load_model, resolve_model
from specserve.train.checkpoint import load_checkpoint, save_checkpoint
from specserve.train.config import TrainConfig
from specserve.train.distill import (
    coverage_curve,
    distill,
    keep_heldout_out,
    vocab_coverage,
)
from specserve.train.features import FeatureStore, LiveFeatures, record_features
from specserve.train.trainee import Trainee, draft_vocab_size, make_head, save_head

logger = logging.getLogger("specserve")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class TrainResult:
    """What a run produced: the head, per-step losses, and held-out / train acceptance."""

    head: Eagle3Head | None  # None after --generate-only
    losses: list[float] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(store: FeatureStore, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches: shuffled, bucketed by length inside chunks of 32 batches so that
    padding stays small, then the batch order shuffled again."""
    rng = random.Random(seed * 100003 + epoch)
    order = list(range(len(store)))
    rng.shuffle(order)
    chunk = 32 * batch_size
    batches = []
    for c in range(0, len(order), chunk):
        part = sorted(order[c : c + chunk], key=store.length)
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def _lr_factor(step: int, warmup: int, progress: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% as progress goes 0 -> 1."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def train(cfg: TrainConfig) -> TrainResult:
    """The whole pipeline; returns the trained head and its metrics."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise SpecserveError(f"--out {out} is a file; the head and its data go in a folder")
    state_path = out / "state.pt"
    if cfg.resume and not (state_path.exists() or (out / "data.jsonl").exists()):
        raise SpecserveError(
            f"--resume: {out} holds no checkpoint and no data.jsonl to continue from (another "
            "--out?); leave --resume out to start a new run"
        )
    out.mkdir(parents=True, exist_ok=True)
    if state_path.exists() and not cfg.resume:
        raise SpecserveError(
            f"{out} holds a training checkpoint; pass --resume to continue it "
            "or choose another --out"
        )
    log_file = open(out / "log.jsonl", "a")

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    t_start = time.monotonic()
    torch.manual_seed(cfg.seed)
    device = _device(cfg.device)
    source = resolve_model(cfg.target)
    target_cfg = load_config(source)
    # Every flag is checked before the data is generated (minutes to hours). A checkpoint's
    # head keeps its own layers and vocabulary (--init-head aside); flags that disagree
    # with them are refused.
    resumed = None
    if cfg.resume and state_path.exists():
        resumed = load_checkpoint(state_path, cfg, target_cfg)
    elif cfg.aux_layer_ids:
        check_aux_layer_ids(cfg.aux_layer_ids, target_cfg.num_layers)
    if resumed is None and cfg.init_head is None:
        draft_vocab_size(cfg, target_cfg)
    train_samples, heldout_samples = distill(cfg, out, log)
    if cfg.generate_only:
        log({"event": "generate_only", "train_samples": len(train_samples)})
        return TrainResult(None, metrics={"train_samples": len(train_samples)})
    train_samples = keep_heldout_out(cfg, out, train_samples, log)

    dtype = (
        _DTYPES[cfg.dtype]
        if cfg.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    model = load_model(source, dtype, device, cfg.progress, target_cfg)
    kept = _fit_store(cfg, train_samples, heldout_samples, target_cfg, dtype, device, log)
    live = kept is None  # the features computed for each batch (`LiveFeatures`)
    train_samples = _capped(cfg, train_samples, None, log) if live else kept
    if resumed is not None:
        head = resumed.build_head(device)
        coverage = vocab_coverage(train_samples, head.t2d.cpu())
    else:
        head, coverage = make_head(cfg, target_cfg, train_samples, device)
    aux_ids = head.aux_layer_ids
    rec = dict(tokens_per_batch=cfg.feature_batch_tokens, progress=cfg.progress)
    t_rec = time.monotonic()
    if live:  # (the held-out samples, few, are kept)
        store = LiveFeatures(model, train_samples, aux_ids)
    else:
        store = record_features(model, train_samples, aux_ids, **rec)
    held = record_features(model, heldout_samples, aux_ids, **rec) if heldout_samples else None
    _sync(device)
    log(
        {
            "event": "features",
            "live": live,
            "tokens": store.offsets[-1],
            "seconds": round(time.monotonic() - t_rec, 1),
            "gib": 0.0
            if live
            else round(
                sum(
                    t.numel() * t.element_size()
                    for t in (store.aux, store.hidden, store.argmax, store.tokens)
                )
                / 2**30,
                2,
            ),
        }
    )
    draft_ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=device))
    embed = model.model.embed_tokens.weight.detach()
    target_head = model.lm_head_weight.detach()[draft_ids]  # in the target's dtype
    if cfg.init_head is None and resumed is None:
        with torch.no_grad():  # warm start: the target's own output head and final norm
            head.lm_head.weight.copy_(target_head.float())
            head.norm.weight.copy_(model.model.norm.weight.float())
    if not live:
        del model
    trainee = Trainee(head, embed, target_head, cfg)
    opt = torch.optim.AdamW(
        head.parameters(),
        lr=cfg.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        fused=device.type == "cuda",
    )
    step, done_before = 0, 0.0
    if resumed is not None:
        opt.load_state_dict(resumed.state["optimizer"])
        step = resumed.state["step"]  # --steps of this invocation sets the new end
        # where the learning-rate schedule was: a time budget's schedule cut short goes on
        # from there (restarted, it re-heated a half-annealed head to the peak rate); one
        # that had ended starts anew over this run's budget (training further on purpose)
        done_before = max(0.0, resumed.state.get("progress", 0.0))
        if done_before >= 1.0:
            done_before = 0.0
        del resumed
    curve = coverage_curve(train_samples, range(4096, 32769, 4096))
    log(
        {
            "event": "start",
            "step": step,
            "config": asdict(cfg),
            "draft_coverage": coverage,
            "draft_vocab_size": head.config.draft_vocab_size,
            "coverage_by_size": curve,
            "train_tokens": store.offsets[-1],
            "aux_layer_ids": list(aux_ids),
            "seconds_since_start": round(time.monotonic() - t_start, 1),
        }
    )

    saved_at = [None]  # the step of the last checkpoint

    def checkpoint() -> None:
        saved_at[0] = step
        save_checkpoint(state_path, head, opt, step, progress())
        save_head(head, out, _DTYPES[cfg.save_dtype])

    initial = {}
    if step == 0:  # the untrained head, for comparison
        initial = {
            "heldout": trainee.evaluate(held) if held is not None else {},
            "train_subset": trainee.evaluate(store.subset(64)),
        }
        log({"event": "eval", "step": 0, **initial["heldout"]})
    losses: list[torch.Tensor] = []  # detached device scalars: read when logging
    skipped = 0  # batches dropped for running out of device memory
    per_epoch = max(1, -(-len(store) // cfg.batch_size))
    epochs: dict[int, list[list[int]]] = {}
    bar = tqdm(
        total=cfg.steps, initial=step, desc="Training", unit="step", disable=not cfg.progress
    )
    start = time.monotonic()
    budget_s = cfg.train_time_s
    if cfg.end_by is not None:  # an absolute deadline (Unix time) shortens the budget
        budget_s = min(budget_s or math.inf, max(1.0, cfg.end_by - time.time()))
    log({"event": "train_budget", "seconds": None if budget_s is None else round(budget_s, 1)})

    def progress() -> float:
        """Schedule progress by steps, or by the time budget when that runs out sooner (a
        resumed run's budget covering what the schedule had left)."""
        done = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        if budget_s is not None:
            spent = (time.monotonic() - start) / budget_s
            done = max(done, done_before + (1.0 - done_before) * spent)
        return done

    while step < cfg.steps:
        epoch, pos = divmod(step, per_epoch)
        if epoch not in epochs:
            epochs.clear()
            epochs[epoch] = _batches(store, cfg.batch_size, cfg.seed, epoch)
        batch = epochs[epoch][pos]
        for group in opt.param_groups:
            group["lr"] = cfg.lr * _lr_factor(step, cfg.warmup_steps, progress())
        opt.zero_grad(set_to_none=True)
        try:
            res = trainee.run(store, batch)
            res.loss.backward()
        except torch.cuda.OutOfMemoryError:  # one oversized batch must not end a lease's run
            res = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            skipped += 1
            log(
                {
                    "event": "skipped_batch",
                    "step": step,
                    "samples": len(batch),
                    "tokens": sum(store.length(i) for i in batch),
                }
            )
            if skipped > 20:
                raise
            step += 1
            continue
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(res.loss.detach())
        bar.update(1)
        last = step >= cfg.steps or (budget_s is not None and progress() >= 1.0)
        if step % 10 == 0 or last:
            acc = [
                float(c.sum()) / max(float(v.sum()), 1.0) for c, v in zip(res.correct, res.valid)
            ]
            loss = float(losses[-1])
            bar.set_postfix(loss=f"{loss:.3f}")
            log(
                {
                    "step": step,
                    "loss": round(loss, 4),
                    "step_losses": [round(x, 4) for x in res.step_losses.tolist()],
                    "acc": acc,
                    "lr": opt.param_groups[0]["lr"],
                    "seconds": round(time.monotonic() - start, 1),
                }
            )
        if held is not None and (step % cfg.eval_every == 0 or last):
            log({"event": "eval", "step": step, **trainee.evaluate(held)})
        if step % cfg.save_every == 0 or last:
            checkpoint()
        if last:
            break
    bar.close()
    if saved_at[0] != step:  # (no step at all; or the last batches were skipped: out of memory)
        checkpoint()
    head.eval()
    metrics = {
        "steps": step,
        "draft_coverage": coverage,
        "train_samples": len(store),
        "train_tokens": store.offsets[-1],
        "heldout": trainee.evaluate(held) if held is not None else {},
        "train_subset": trainee.evaluate(store.subset(64)),
        "initial": initial,
        "skipped_batches": skipped,
        "train_seconds": round(time.monotonic() - start, 1),
        "total_seconds": round(time.monotonic() - t_start, 1),
    }
    if device.type == "cuda":
        metrics["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log({"event": "done", **metrics})
    log_file.close()
    return TrainResult(head, torch.stack(losses).tolist() if losses else [], metrics)


# The share of a GPU's free memory (after the model) the feature store may take: training
# took ~28 GiB beside a 43 GiB store on the H200 (the default model, batch 16, TTT 7)
STORE_SHARE = 0.6


def _fit_store(cfg, train, heldout, model_cfg, dtype, device, log) -> list | None:
    """The training samples whose features a store keeps: the first ones within
    --max-train-tokens and, on a GPU, within STORE_SHARE of its free memory (the store is
    one allocation: more data than fits failed after the generation, with out of memory).
    None: none are kept, each batch's are computed (`LiveFeatures`): --features live, or
    auto where the device's memory would drop samples that --max-train-tokens keeps."""
    if cfg.features == "live":
        return None
    fits = None
    if device.type == "cuda":
        per_token = 4 * model_cfg.hidden_size * dtype.itemsize + 16  # aux, hidden, ids
        free, _ = torch.cuda.mem_get_info(device)
        held = sum(len(s.token_ids) for s in heldout)
        fits = int(free * STORE_SHARE) // per_token - held
        wanted = sum(len(s.token_ids) for s in train)
        if cfg.max_train_tokens is not None:
            wanted = min(wanted, cfg.max_train_tokens)
        if cfg.features == "auto" and fits < wanted:
            log({"event": "live_features", "tokens": wanted, "store_fits_tokens": fits})
            return None
    return _capped(cfg, train, fits, log)


def _capped(cfg, train: list, fits: int | None, log) -> list:
    """The first training samples within --max-train-tokens and `fits` tokens of kept
    features (None: no such bound), logged and warned where samples are dropped."""
    cap = cfg.max_train_tokens
    if fits is not None:
        cap = fits if cap is None else min(cap, fits)
    if cap is None:
        return train
    kept, tokens = [], 0
    for s in train:
        if tokens + len(s.token_ids) > cap:
            break
        kept.append(s)
        tokens += len(s.token_ids)
    if not kept:
        raise SpecserveError(
            f"no training sample fits in {cap} tokens of target features "
            "(--max-train-tokens, or the device's free memory)"
        )
    if len(kept) < len(train):
        log(
            {
                "event": "train_tokens_capped",
                "samples": len(kept),
                "of": len(train),
                "tokens": tokens,
                "cap": cap,
            }
        )
        logger.warning(
            "training on the first %d of %d samples (%d tokens): their target features fill "
            "the store's share of the device (or --max-train-tokens)",
            len(kept),
            len(train),
            tokens,
        )
    return kept


def run_cli(cfg: TrainConfig) -> int:
    """`specserve train-eagle3`: train, then print where the head is and how it does."""
    result = train(cfg)
    m = result.metrics
    if result.head is None:
        print(
            f"{m['train_samples']} training samples written to {cfg.out}/data.jsonl; "
            "train on them with --resume"
        )
        return 0
    print(
        f"EAGLE-3 head written to {cfg.out} after {m['steps']} steps "
        f"(draft vocabulary covers {m['draft_coverage']:.1%} of reply tokens)"
    )
    for name in ("heldout", "train_subset"):
        stats = m.get(name) or {}
        if stats:
            accept = ", ".join(
                f"K={k + 1}: {v:.2f}" for k, v in enumerate(stats["mean_accept_len"])
            )
            print(f"{name}: teacher-forced mean acceptance length {accept}")
    return 0
