"""`specserve eval-draft`: how well a drafter predicts a target, measured by real greedy
speculative decoding: mean acceptance length and per-position acceptance at K = 1..7."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specserve.sampling_params import SamplingParams
from specserve.spec.acceptance import AcceptanceModel
from specserve.spec.policy import FixedPolicy


@dataclass
class DraftEval:
    """Acceptance figures of one draft length."""

    k: int
    verify_steps: int
    drafted: int
    accepted: int
    position_rates: list[float] = field(default_factory=list)
    seconds: float = 0.0
    generated: int = 0

    @property
    def mean_accept_len(self) -> float:
        """Accepted drafts + 1 (the bonus) per verify step."""
        return (self.accepted + self.verify_steps) / max(self.verify_steps, 1)


def evaluate(
    llm,
    prompts: list[list[int]],
    ks: list[int],
    max_tokens: int,
    on_result: Callable[[list[DraftEval]], None] | None = None,
) -> list[DraftEval]:
    """Run the prompts greedily at each fixed K (in the order given) with the llm's drafter;
    `on_result` sees the results so far after each K (to save them as they come)."""
    spec = llm.engine.spec
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = []
    for k in ks:
        spec.policy = FixedPolicy(k)
        spec.acceptance = AcceptanceModel(spec.k_max)
        t0 = time.monotonic()
        outs = llm.generate(prompts, params)
        stats = [o.spec_stats for o in outs]
        results.append(
            DraftEval(
                k=k,
                verify_steps=sum(s.verify_steps for s in stats),
                drafted=sum(s.drafted for s in stats),
                accepted=sum(s.accepted for s in stats),
                position_rates=[round(r, 4) for r in spec.acceptance.position_rates()[:k]],
                seconds=round(time.monotonic() - t0, 2),
                generated=sum(len(o.token_ids) for o in outs),
            )
        )
        if on_result is not None:
            on_result(results)
    return results


def _print_table(title: str, results: list[DraftEval]) -> None:
    """A rich table, or plain lines where rich is not installed (GPU machines)."""
    cols = ("K", "mean accept len", "accepted/drafted", "per-position acceptance")
    rows = [(str(r.k), f"{r.mean_accept_len:.3f}", f"{r.accepted}/{r.drafted}",
             " ".join(f"{x:.2f}" for x in r.position_rates))
            for r in sorted(results, key=lambda r: r.k)]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in (cols, *rows):
            print(" | ".join(row))
        return
    table = Table(title=title)
    for col in cols:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def run_eval_draft(args) -> int:
    from specserve.llm import LLM
    from specserve.train.prompts import load_prompts

    ks = list(dict.fromkeys(args.k))  # the order given: the most wanted K first
    train, heldout = load_prompts(args.data, args.seed, None, args.num_prompts)
    items = heldout if args.split == "heldout" else train[: args.num_prompts]
    engine_opts = {}
    if args.kv_cache_gib is not None:
        engine_opts["kv_cache_bytes"] = int(args.kv_cache_gib * 2**30)
    llm = LLM(
        args.target,
        progress=True,
        speculative_algorithm=args.algorithm,
        speculative_draft_model_path=args.draft,
        speculative_num_steps=max(ks),
        speculative_policy="fixed",
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(1, min(len(items), 256)),  # all prompts at once, no idle graphs
        **engine_opts,
    )
    prompts = [llm.apply_chat_template(p.messages) for p in items]

    earlier = []  # --append: results already in --out (other K, an earlier run)
    if args.append and args.out and Path(args.out).is_file():
        earlier = json.loads(Path(args.out).read_text())["results"]

    def payload(results: list[DraftEval]) -> dict:
        return {
            "target": args.target,
            "draft": args.draft,
            "algorithm": args.algorithm,
            "data": args.data,
            "split": args.split,
            "seed": args.seed,
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "results": earlier + [{**r.__dict__, "mean_accept_len": r.mean_accept_len}
                                  for r in results],
        }

    def save(results: list[DraftEval]) -> None:
        if args.out:  # whole files only: a run cut by a timeout leaves the last K's file
            tmp = Path(args.out).with_suffix(".tmp")
            tmp.write_text(json.dumps(payload(results), indent=2) + "\n")
            tmp.replace(args.out)

    results = evaluate(llm, prompts, ks, args.max_tokens, on_result=save)
    _print_table(f"{args.algorithm} drafter on {len(prompts)} {args.split} prompts", results)
    save(results)
    return 0


def add_eval_draft_parser(sub) -> None:
    p = sub.add_parser(
        "eval-draft", help="mean acceptance length and per-position acceptance of a drafter"
    )
    p.add_argument("--target", default=None, help="target model (default: embedded SmolLM2)")
    p.add_argument("--draft", default=None, help="EAGLE-3 head folder or draft model path")
    p.add_argument("--algorithm", default="eagle3", choices=["eagle3", "draft", "ngram"])
    p.add_argument("--data", nargs="+", default=["stdlib", "shakespeare"],
                   help="prompt sources: stdlib, shakespeare, or JSONL files")
    p.add_argument("--split", default="heldout", choices=["heldout", "train"],
                   help="held-out prompts of the training split (same --data and --seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7],
                   help="draft lengths, run in this order (results are saved after each)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="target KV cache size (default: the engine's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--append", action="store_true",
                   help="keep the results already in --out and add these after them")
    p.set_defaults(func=run_eval_draft)
