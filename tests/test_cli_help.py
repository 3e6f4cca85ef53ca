"""`--help` reads as a user needs it: flags in groups (model, sampling, speculation,
performance, advanced) with the GPU kernel switches under advanced, every flag with help in
a user's words, every default shown; a short usage line."""

from __future__ import annotations

import argparse
import re

import pytest

from specserve.cli import build_parser, main

GROUPS = ["model", "sampling", "speculation", "performance", "advanced"]
# The snapshot: which engine flag goes where (generate adds its own sampling flags).
EXPECTED = {
    "model": {"--model", "--load-format", "--dtype", "--device", "--max-model-len"},
    "sampling": {"--seed"},
    "speculation": {
        "--speculative-algorithm",
        "--speculative-draft-model-path",
        "--speculative-num-steps",
        "--speculative-policy",
    },
    "performance": {
        "--kv-cache-memory-fraction",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--tensor-parallel-size",
    },
    "advanced": {
        "--page-size",
        "--kv-cache-bytes",
        "--num-kv-pages",
        "--disable-prefix-caching",
        "--disable-gemv",
        "--disable-gemv-tuning",
        "--disable-batch-invariance",
        "--disable-verify-tiles",
        "--disable-pdl",
        "--gemv-stream-k",
        "--disable-fusion",
        "--cuda-graph-max-batch",
        "--cuda-graph-max-tokens",
        "--grammar-workers",
        "--disable-cuda-graph",
        "--attention-backend",
        "--overlap-schedule",
        "--speculative-simulate-acceptance",
        "--speculative-head-parallel",
        "--debug-tp-check",
        "--speculative-schedule",
        "--speculative-trace-file",
        "--nnodes",
        "--node-rank",
        "--dist-init-addr",
    },
}
GENERATE_SAMPLING = {
    "--max-tokens",
    "--temperature",
    "--top-k",
    "--top-p",
    "--min-p",
    "--sampling-seed",
    "--stop",
}


def help_of(capsys, monkeypatch, *command: str) -> str:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def sections(text: str) -> dict[str, str]:
    """Heading ("model", "options"...) -> the text under it, in order."""
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        heading = re.fullmatch(r"([a-z][a-z /-]*):", line)
        if heading:
            name = heading.group(1)
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def flags_in(text: str) -> set[str]:
    return set(re.findall(r"^  (?:-\w, )?(--[a-z0-9-]+)", text, re.M))


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_flags_are_grouped_with_gpu_switches_under_advanced(capsys, monkeypatch, command):
    text = help_of(capsys, monkeypatch, command)
    assert text.startswith(f"usage: specserve {command} [options]")
    parts = sections(text)
    assert [name for name in parts if name in GROUPS] == GROUPS
    for group, flags in EXPECTED.items():
        extra = GENERATE_SAMPLING if (command, group) == ("generate", "sampling") else set()
        if (command, group) == ("serve", "advanced"):
            extra = {"--uvicorn-log-level", "--disable-uvicorn-access-log"}
        assert flags_in(parts[group]) == flags | extra, group
    if command == "serve":  # what a user reads before the advanced knobs: at most 25 flags
        outside = set().union(
            *(flags_in(t) for name, t in parts.items() if name not in ("advanced", "options"))
        )
        assert len(outside) <= 25, sorted(outside)
    # one way to say it documented; the other still works
    assert "--disable-overlap-schedule" not in text
    args = subparser(command).parse_args(
        ["--disable-overlap-schedule"] + (["hi"] if command == "generate" else [])
    )
    assert args.disable_overlap_schedule
    args = subparser(command).parse_args(["--tp", "2"] + (["hi"] if command == "generate" else []))
    assert args.tensor_parallel_size == 2  # the short alias


@pytest.mark.parametrize("command", ["generate", "serve", "eval-draft", "train-eagle3"])
def test_every_default_is_shown(capsys, monkeypatch, command):
    text = help_of(capsys, monkeypatch, command)
    blocks = re.split(r"\n(?=  -)", text)  # one block per option
    for action in subparser(command)._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        block = next(
            b
            for b in blocks
            if re.match(rf"  (-\w, )?{action.option_strings[0]}\b", b.lstrip("\n"))
            or re.match(rf"  -\w, {action.option_strings[-1]}\b", b.lstrip("\n"))
        )
        if (
            action.default is not None
            and action.default is not False
            and action.default is not argparse.SUPPRESS
        ):
            assert "default" in block, block
    assert "(default: 128)" in help_of(capsys, monkeypatch, "generate")  # --max-tokens


@pytest.mark.parametrize("command", ["generate", "eval-draft"])
def test_every_flag_has_help_in_a_users_words(capsys, monkeypatch, command):
    for action in subparser(command)._actions:
        if action.help != argparse.SUPPRESS:
            assert action.help, action.option_strings
    text = help_of(capsys, monkeypatch, command)
    assert not re.search(r"\w+\.py\b|\w+/\w+\.py", text), "no source file names in help"


def test_generate_help_shows_the_python_apis_defaults(capsys, monkeypatch):
    from specserve import SamplingParams

    parsed = subparser("generate").parse_args(["hi"])
    defaults = SamplingParams()
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p"):
        assert getattr(parsed, name) == getattr(defaults, name), name
    assert defaults.greedy and defaults.max_tokens == 128
