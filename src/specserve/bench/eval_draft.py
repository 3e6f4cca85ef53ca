"""`specserve eval-draft`: how well a drafter predicts a target, measured by real greedy
speculative decoding: mean acceptance length and per-position acceptance at K = 1..7."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specserve.core.errors import ConfigError
from specserve.core.sampling_params import SamplingParams
from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.policy import FixedPolicy


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
    by_source: dict[str, dict] = field(default_factory=dict)  # see `evaluate`

    @property
    def mean_accept_len(self) -> float:
        """Accepted drafts + 1 (the bonus) per verify step."""
        return (self.accepted + self.verify_steps) / max(self.verify_steps, 1)

    @property
    def draft_fill(self) -> float:
        """Drafts made per K a verify step allows: below 1 where steps drafted fewer than
        K (a request's last tokens: drafts past max_tokens are never made)."""
        return self.drafted / max(self.k * self.verify_steps, 1)


def evaluate(
    llm,
    prompts: list[list[int]],
    draft_lens: list[int],
    max_tokens: int,
    on_result: Callable[[list[DraftEval]], None] | None = None,
    sources: list[str] | None = None,
) -> list[DraftEval]:
    """Run the prompts greedily at each fixed K (in the order given) with the llm's drafter;
    `on_result` sees the results so far after each K (to save them as they come). With
    `sources` (each prompt's source), every result also holds each source's own figures
    (`by_source`), from the same run."""
    spec = llm.engine.spec
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = []
    for k in draft_lens:
        spec.policy = FixedPolicy(k)
        spec.acceptance = AcceptanceModel(spec.k_max)
        t0 = time.monotonic()
        outs = llm.generate(prompts, params)
        stats = [o.spec_stats for o in outs]
        result = DraftEval(
            k=k,
            verify_steps=sum(s.verify_steps for s in stats),
            drafted=sum(s.drafted for s in stats),
            accepted=sum(s.accepted for s in stats),
            position_rates=[round(r, 4) for r in spec.acceptance.position_rates()[:k]],
            seconds=round(time.monotonic() - t0, 2),
            generated=sum(len(o.token_ids) for o in outs),
        )
        if sources is not None and len(set(sources)) > 1:
            for name in dict.fromkeys(sources):
                mine = [s for s, src in zip(stats, sources) if src == name]
                result.by_source[name] = _source_figures(k, mine)
        results.append(result)
        if on_result is not None:
            on_result(results)
    return results


def _source_figures(k: int, stats: list) -> dict:
    """One source's figures at draft length k: its prompts' verify steps, drafts and
    accepted drafts summed; mean acceptance length; per-position acceptance (position j:
    steps that accepted the draft at j over steps that judged it, as the engine-wide
    figure counts them: a step that drafted fewer than k judged only its drafts)."""
    steps = sum(s.verify_steps for s in stats)
    accepted = sum(s.accepted for s in stats)
    verified, hits = [0] * k, [0] * k
    for s in stats:
        for j, (n, a) in enumerate(zip(s.position_verified[:k], s.position_accepted)):
            verified[j] += n
            hits[j] += a
    return {
        "num_prompts": len(stats),
        "verify_steps": steps,
        "drafted": sum(s.drafted for s in stats),
        "accepted": accepted,
        "mean_accept_len": (accepted + steps) / max(steps, 1),
        "position_rates": [round(a / n, 4) if n else 0.0 for a, n in zip(hits, verified)],
    }


def _print_table(title: str, results: list[DraftEval]) -> None:
    """A rich table, or plain lines where rich is not installed (GPU machines)."""
    cols = ("K", "mean accept len", "accepted/drafted", "drafts/K", "per-position acceptance")
    rows = [
        (
            str(r.k),
            f"{r.mean_accept_len:.3f}",
            f"{r.accepted}/{r.drafted}",
            f"{r.draft_fill:.3f}",
            " ".join(f"{x:.2f}" for x in r.position_rates),
        )
        for r in sorted(results, key=lambda r: r.k)
    ]
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


def _print_sources(results: list[DraftEval]) -> None:
    """Each source's mean acceptance length side by side, a row per K (several sources)."""
    names = list(dict.fromkeys(n for r in results for n in r.by_source))
    if not names:
        return
    print("mean accept len by source: K | " + " | ".join(names) + " | all")
    for r in sorted(results, key=lambda r: r.k):
        figures = [f"{r.by_source[n]['mean_accept_len']:.3f}" for n in names]
        print(f"{r.k} | " + " | ".join(figures) + f" | {r.mean_accept_len:.3f}")


def draft_path(args: argparse.Namespace) -> str | None:
    """--draft, else the EAGLE-3 head shipped for the embedded model when that is the
    target; a drafter that needs a path and has none is an error."""
    if args.draft is not None or args.algorithm == "ngram":
        return args.draft
    if args.target is None and args.algorithm == "eagle3":
        from specserve.core.config import shipped_head_path

        head = shipped_head_path()
        if (head / "config.json").is_file():
            return str(head)
    what = "EAGLE-3 head folder" if args.algorithm == "eagle3" else "draft model"
    raise ConfigError(
        f"--algorithm {args.algorithm} needs --draft (the {what}); only the "
        "embedded model (no --target) has a shipped EAGLE-3 head"
    )


def select_prompts(args: argparse.Namespace) -> tuple[list, list[str]]:
    """The prompts of --split, and the --data source of each: up to --num-prompts of every
    prompt (all), of those no training run trains on (heldout: at most as many as there
    are, else an error), or of those left for training (train). A split that selects none
    is an error that says where the prompts went.

    Held out are only the prompts every train-eagle3 run with this --data and --seed keeps
    out of training, whatever its --heldout-prompts (`always_held_out`): a run reserves
    more when its --heldout-prompts asks for more, but which ones depends on that count,
    which eval-draft does not know."""
    from specserve.train.prompts import HELDOUT_FRACTION, interleave, load_prompts, read_source

    if args.split == "all":
        items = interleave([read_source(name) for name in args.data])[: args.num_prompts]
        if not items:
            raise ConfigError("--split all selects no prompts: --data has 0 prompts")
        return items, _sources(args.data, items)
    train, heldout = load_prompts(args.data, args.seed, None, None)
    held = f"{HELDOUT_FRACTION:.0%} of each source's texts, picked by --seed {args.seed}"
    if args.split == "heldout" and args.num_prompts > len(heldout):
        lower = f"lower --num-prompts to {len(heldout)}, " if heldout else ""
        raise ConfigError(
            f"--split heldout: --data holds {len(heldout)} prompts that no train-eagle3 run "
            f"trains on ({held}) and --num-prompts asks for {args.num_prompts}; {lower}"
            "add prompts, or take --split all for prompts never trained on (a run's "
            "heldout_prompts.jsonl, hand-written questions)"
        )
    items = heldout[: args.num_prompts] if args.split == "heldout" else train[: args.num_prompts]
    if items:
        return items, _sources(args.data, items)
    total = len(train) + len(heldout)
    raise ConfigError(
        f"--split train selects no prompts: --data has {total} prompts and {len(heldout)} of "
        f"them are held out for evaluation ({held}); add prompts, or take --split all"
    )


def _sources(names: list[str], items: list) -> list[str]:
    """The --data source each prompt came from (a file by its name)."""
    from specserve.train.prompts import read_source

    if len(names) == 1:
        return [names[0]] * len(items)
    owner = {}
    for name in names:
        label = Path(name).name if Path(name).is_file() else name
        for p in read_source(name):
            owner.setdefault(p.key, label)
    return [owner.get(p.key, "?") for p in items]


def run_eval_draft(args: argparse.Namespace) -> int:
    """The eval-draft command: every argument checked, then the engine loaded and run."""
    from specserve.core.config_sections import ModelLoadConfig
    from specserve.engine_args import flag_message
    from specserve.llm import LLM

    draft_lens = list(dict.fromkeys(args.k))  # the order given: the most wanted K first
    for flag, values in (
        ("--k", draft_lens),
        ("--num-prompts", [args.num_prompts]),
        ("--max-tokens", [args.max_tokens]),
    ):
        if min(values) < 1:
            raise ConfigError(f"{flag} must be at least 1; got {min(values)}")
    if max(draft_lens) > 16:
        raise ConfigError(f"--k takes draft lengths of at most 16; got {max(draft_lens)}")
    try:  # a missing GPU now, not after reading the prompts
        ModelLoadConfig(device=args.device).check_device()
    except ConfigError as e:
        raise ConfigError(flag_message(str(e), {"device": "--device"})) from None
    draft = draft_path(args)
    items, sources = select_prompts(args)
    engine_opts = {}
    if not args.serving_kernels:  # acceptance, not speed: start in seconds
        engine_opts.update(disable_gemv=True, disable_cuda_graph=True)
    if args.out and Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a folder; name the JSON file to write")
    if args.append and args.out and Path(args.out).is_file():
        try:
            json.loads(Path(args.out).read_text())["results"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"--append: {args.out} is not an eval-draft result to add to ({e})"
            ) from None
    if args.kv_cache_gib is not None:
        if not 0 < args.kv_cache_gib < math.inf:
            raise ConfigError(f"--kv-cache-gib must be positive; got {args.kv_cache_gib}")
        engine_opts["kv_cache_bytes"] = int(args.kv_cache_gib * 2**30)
    seqs = max(1, min(len(items), 256))
    llm = LLM(
        args.target,
        progress=True,
        speculative_algorithm=args.algorithm,
        speculative_draft_model_path=draft,
        speculative_num_steps=max(draft_lens),
        speculative_policy="fixed",
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=seqs,  # all prompts at once, no idle graphs
        # every decoding request's K + 1 verify tokens beside a prefill chunk: the budget
        # never cuts a step's drafts below K (measured at K=7: 0.8% fewer drafts than K at
        # the default 2,048, from steps that prefilled too)
        max_num_batched_tokens=seqs * (max(draft_lens) + 1) + 2048,
        **engine_opts,
    )
    prompts = [llm.apply_chat_template(p.messages) for p in items]

    earlier = []  # --append: results already in --out (other K, an earlier run)
    if args.append and args.out and Path(args.out).is_file():
        earlier = json.loads(Path(args.out).read_text())["results"]

    def payload(results: list[DraftEval]) -> dict:
        return {
            "target": args.target,
            "draft": draft,
            "algorithm": args.algorithm,
            "data": args.data,
            "split": args.split,
            "seed": args.seed,
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "results": earlier
            + [
                {**r.__dict__, "mean_accept_len": r.mean_accept_len, "draft_fill": r.draft_fill}
                for r in results
            ],
        }

    def save(results: list[DraftEval]) -> None:
        if args.out:  # whole files only: a run cut by a timeout leaves the last K's file
            tmp = Path(args.out).with_suffix(".tmp")
            tmp.write_text(json.dumps(payload(results), indent=2) + "\n")
            tmp.replace(args.out)

    with llm:  # (tensor parallelism: the other ranks stop)
        results = evaluate(
            llm, prompts, draft_lens, args.max_tokens, on_result=save, sources=sources
        )
    _print_table(f"{args.algorithm} drafter on {len(prompts)} {args.split} prompts", results)
    _print_sources(results)
    save(results)
    return 0


def add_eval_draft_parser(sub) -> None:
    """The `specserve eval-draft` subcommand."""
    p = sub.add_parser(
        "eval-draft", help="mean acceptance length and per-position acceptance of a drafter"
    )
    p.add_argument(
        "--target", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--draft",
        default=None,
        help="EAGLE-3 head folder or draft model (default: the head shipped for the "
        "embedded model, when --target is not given)",
    )
    p.add_argument(
        "--algorithm",
        default="eagle3",
        choices=["eagle3", "draft", "ngram"],
        help="the kind of drafter",
    )
    p.add_argument(
        "--data",
        nargs="+",
        default=["stdlib", "shakespeare"],
        help="prompt sources: stdlib, shakespeare, or JSONL files (several: each one's "
        "figures side by side too)",
    )
    p.add_argument(
        "--split",
        default="heldout",
        choices=["heldout", "train", "all"],
        help="heldout: prompts no train-eagle3 run with the same --data and --seed trains "
        "on (2%% of each source's texts); train: prompts it may train on; all: every "
        "prompt (files never trained on: a run's heldout_prompts.jsonl, hand-written "
        "questions)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out choice")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=32,
        help="prompts to run (--split heldout: at most as many as are held out)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4, 5, 6, 7],
        help="draft lengths, run in this order (results are saved after each)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="target KV cache size (default: the engine's)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="compute precision of the target",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="GPUs to shard the target over (one process each)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--serving-kernels",
        action="store_true",
        help="choose GEMV kernels by timing and capture CUDA graphs as the server does "
        "(a longer start-up; by default cuBLAS, eagerly: acceptance is the same up to "
        "rounding, and the evaluation does not time the steps)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the results already in --out and add these after them",
    )
    p.set_defaults(func=run_eval_draft)
