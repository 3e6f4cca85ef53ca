"""`specserve generate` streams text and exits 0; bad input exits 2 with a one-line message
that names the flag as typed, before any model is loaded."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from specserve import LLM, ConfigError, SamplingParams
from specserve.cli import main
from specserve.core.config import EngineConfig


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_the_greedy_text(tiny_llama, capsys, monkeypatch):
    writes: list[str] = []
    write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or write(s))
    code, out, _ = run(
        capsys, "The quick brown fox", "--model", str(tiny_llama), "--max-tokens", "12"
    )
    assert code == 0
    llm = LLM(str(tiny_llama))
    ids = llm.apply_chat_template([{"role": "user", "content": "The quick brown fox"}])
    expected = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    assert out == expected + "\n"
    assert len([w for w in writes if w]) > 2, "the text should arrive in several deltas"


def test_generate_without_chat_template_and_with_a_seed(tiny_llama, capsys):
    argv = [
        "Héllo wörld",
        "--model",
        str(tiny_llama),
        "--max-tokens",
        "10",
        "--no-chat-template",
        "--temperature",
        "1.0",
        "--sampling-seed",
        "5",
    ]
    code, first, _ = run(capsys, *argv)
    assert code == 0
    code, second, _ = run(capsys, *argv)
    assert code == 0 and first == second
    llm = LLM(str(tiny_llama))
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5)
    assert first == llm.generate("Héllo wörld", params)[0].text + "\n"


def test_a_prompt_longer_than_the_context_exits_2_after_loading(tiny_llama, capsys):
    code, out, err = run(
        capsys,
        "a long enough prompt for the context check",
        "--model",
        str(tiny_llama),
        "--max-model-len",
        "8",
    )
    assert code == 2
    assert out == ""
    last = err.strip().splitlines()[-1]  # after the start-up progress
    assert last.startswith("specserve: error: ") and "this model's context is 8 tokens" in last


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything starts loading a model."""

    def loading(*args, **kwargs):
        raise AssertionError("the model loader was reached")

    import specserve.engine.builder as builder
    import specserve.llm as llm
    import specserve.server.launch as launch

    monkeypatch.setattr(builder, "resolve_model", loading)
    monkeypatch.setattr(builder, "load_model", loading)
    monkeypatch.setattr(llm.LLM, "__init__", loading)
    monkeypatch.setattr(launch, "run_server", loading)


CUDA_MISSING = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-tokens", "0"], "--max-tokens must be an integer >= 1; got 0"),
        (["--temperature", "-1"], "--temperature must be in [0, 100]; got -1.0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]; got 1.5"),
        (["--top-k", "-2"], "--top-k must be a non-negative integer"),
        (["--min-p", "2"], "--min-p must be in [0, 1]"),
        (["--stop", ""], "--stop must be non-empty strings"),
        (["--page-size", "0"], "--page-size must be >= 1; got 0"),
        (["--cuda-graph-max-tokens", "-1"], "--cuda-graph-max-tokens must be >= 0; got -1"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
        # (torch knows these; the loading failed with a traceback)
        (["--device", "mps"], "--device must be auto, cpu, cuda or cuda:N; got 'mps'"),
        (["--num-kv-pages", "1"], "--num-kv-pages must be >= 2 (page 0 is scratch); got 1"),
        (
            ["--kv-cache-bytes", "1000", "--num-kv-pages", "100"],  # (the pages won silently)
            "--kv-cache-bytes and --num-kv-pages both size the KV cache; give one of them",
        ),
        (
            ["--model", "m", "--speculative-algorithm", "eagle3"],
            "--speculative-algorithm eagle3 needs --speculative-draft-model-path",
        ),
        (
            ["--speculative-policy", "schedule", "--speculative-algorithm", "ngram"],
            "--speculative-policy schedule needs --speculative-schedule",
        ),
        (
            ["--overlap-schedule", "on", "--disable-overlap-schedule"],
            "--disable-overlap-schedule contradicts --overlap-schedule on",
        ),
        pytest.param(
            ["--device", "cuda"], "--device cuda needs a CUDA GPU but", marks=CUDA_MISSING
        ),
    ],
)
def test_bad_arguments_exit_2_before_loading(no_loading, capsys, argv, message):
    code, out, err = run(capsys, "hi", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1, "one line, no traceback"
    assert err.startswith("specserve: error: ") and message in err


@pytest.mark.parametrize(
    "argv", [["--page-size", "0"], pytest.param(["--device", "cuda"], marks=CUDA_MISSING)]
)
def test_serve_refuses_bad_engine_flags_before_loading(no_loading, capsys, argv):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specserve: error: --")


def test_algorithm_errors_offer_auto(no_loading, capsys):
    with pytest.raises(ConfigError, match="must be auto, eagle3, draft, ngram or none"):
        EngineConfig.from_flags(speculative_algorithm="medusa")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--speculative-algorithm", "medusa"])
    assert exc.value.code == 2
    assert "'auto'" in capsys.readouterr().err


def test_missing_model_exits_2(tmp_path, capsys):
    code, _, err = run(capsys, "hi", "--model", str(tmp_path / "missing"))
    assert code == 2
    assert "neither a Hugging Face model folder nor a .gguf file" in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate"])
    assert exc.value.code == 2
    assert "prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--max-tokens", "many"])
    assert exc.value.code == 2
    assert "invalid int value: 'many'" in capsys.readouterr().err


def test_engine_errors_after_loading_name_the_flags(tiny_llama, capsys):
    # the prompt fits the context but not the KV cache: found only once the model is known
    code, _, err = run(
        capsys,
        "hi",
        "--model",
        str(tiny_llama),
        "--page-size",
        "4",
        "--num-kv-pages",
        "9",  # (32 tokens: the prompt's 20 fit, 100 more do not)
        "--max-tokens",
        "100",
        "--quiet",
    )
    assert code == 2
    assert err.startswith("specserve: error: ") and err.count("\n") == 1
    assert "--max-tokens (100)" in err and "lower --max-tokens" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-model-len", "100000"], "past this model's context (512 positions)"),
        (["--max-model-len", "0"], "--max-model-len must be >= 1"),
        (["--speculative-policy", "fixed"], "--speculative-policy needs --speculative-algorithm"),
    ],
)
def test_settings_the_model_cannot_take_are_one_line_errors(tiny_llama, capsys, flags, message):
    code, _, err = run(capsys, "hi", "--model", str(tiny_llama), *flags, "--quiet")
    assert code == 2 and err.startswith("specserve: error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_a_missing_draft_model_is_named_by_its_flag(tiny_llama, tmp_path, capsys):
    missing = str(tmp_path / "missing")
    code, _, err = run(
        capsys,
        "hi",
        "--model",
        str(tiny_llama),
        "--speculative-algorithm",
        "draft",
        "--speculative-draft-model-path",
        missing,
        "--quiet",
    )
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"specserve: error: --speculative-draft-model-path '{missing}' is ")


def run_interrupted(capsys, *argv) -> tuple[int, str, str]:
    try:
        return run(capsys, *argv)
    except KeyboardInterrupt:  # (it would end the whole test session)
        pytest.fail("the KeyboardInterrupt escaped main: a traceback")


def test_ctrl_c_ends_the_answer_and_says_so(tiny_llama, capsys, monkeypatch):
    """A Ctrl-C printed a 40-line traceback: now the partial answer ends its line, one line
    says so, the exit status is 130 (128 + SIGINT) and the engine is closed."""
    stream, close, closed, sent = LLM.stream, LLM.close, [], []

    def interrupted(self, prompt, params=None):
        for delta in stream(self, prompt, params):
            if len(sent) == 2:
                raise KeyboardInterrupt
            sent.append(delta)
            yield delta

    monkeypatch.setattr(LLM, "stream", interrupted)
    monkeypatch.setattr(LLM, "close", lambda self: closed.append(self) or close(self))
    code, out, err = run_interrupted(
        capsys, "hi", "--model", str(tiny_llama), "--max-tokens", "20", "-q"
    )
    assert code == 130 and err == "specserve: interrupted\n"
    assert len(sent) == 2 and out == "".join(sent) + "\n"
    assert len(closed) == 1


def test_ctrl_c_while_loading_prints_no_answer(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    import specserve.llm as llm

    monkeypatch.setattr(llm.LLM, "__init__", interrupted)
    code, out, err = run_interrupted(capsys, "hi", "-q")
    assert (code, out, err) == (130, "", "specserve: interrupted\n")


@pytest.mark.parametrize("broken", ["config.json", "tokenizer.json", "model.safetensors", "gguf"])
def test_corrupt_checkpoint_files_are_named(tiny_llama, tmp_path, capsys, broken):
    """A checkpoint file that is there but unreadable (not JSON, a JSON list, a truncated
    safetensors, an empty GGUF) is a one-line error naming it, not a traceback."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    if broken == "gguf":
        model = tmp_path / "empty.gguf"
        model.write_bytes(b"")
    elif broken == "model.safetensors":
        (model / broken).write_bytes((model / broken).read_bytes()[:1000])
    else:
        (model / broken).write_text("[1, 2]" if broken == "config.json" else "{not json")
    code, _, err = run(capsys, "hi", "--model", str(model), "--quiet")
    assert code == 2 and err.startswith("specserve: error: ") and err.count("\n") == 1, err
    named = {"gguf": "empty.gguf", "tokenizer.json": "the tokenizer in"}.get(broken, broken)
    assert named in err, err


def test_a_prompt_that_is_not_utf8_is_refused(tiny_llama, capsys):
    code, _, err = run(capsys, "caf\udce9", "--model", str(tiny_llama), "--quiet")
    assert code == 2 and "not UTF-8" in err, err


def test_quiet_keeps_stderr_silent_and_progress_reports_start_up(tiny_llama, capsys):
    code, out, err = run(capsys, "hi", "--model", str(tiny_llama), "--max-tokens", "3", "--quiet")
    assert code == 0 and out and err == ""
    code, _, err = run(capsys, "hi", "--model", str(tiny_llama), "--max-tokens", "3")
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("specserve: ")]
    assert lines[0] == f"specserve: loading {tiny_llama.name} on cpu..."
    assert re.fullmatch(r"specserve: ready in \d+\.\d s", lines[-1])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "serve", "--input-len", "0"], "--input-len: must be >= 1"),
        (["bench", "serve", "--output-len", "-1"], "--output-len: must be >= 1"),
        (["bench", "serve", "--timeout", "nan"], "--timeout: must be a positive number"),
        (["bench", "serve", "--extra-body", "[1]"], "--extra-body: must be a JSON object"),
        (["serve", "--request-read-timeout", "nan"], "--request-read-timeout must be a positi"),
        (["serve", "--port", "70000"], "--port must be in [0, 65535]; got 70000"),
        (["serve", "--max-queue", "-1"], "--max-queue must be >= 0; got -1"),
        (["serve", "--max-request-bytes", "10"], "--max-request-bytes must be >= 1024"),
        (["train-eagle3", "--target", "t", "--data", "d", "--out", "o", "--lr", "nan"], "lr"),
    ],
)
def test_values_that_would_misbehave_are_usage_errors(argv, message, capsys):
    """Each was taken: lengths clamped to 1, NaN timeouts failing every request (the
    server's every connection), a JSON list as the body's extras a traceback, NaN as a
    learning rate a crash in the optimizer."""
    with pytest.raises(SystemExit) as exit_:
        code = main(argv)
        raise SystemExit(code)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_without_anything_to_resume_is_refused(tmp_path, capsys):
    from specserve.core.errors import SpecserveError
    from specserve.train.config import TrainConfig
    from specserve.train.trainer import train

    with pytest.raises(SpecserveError, match="holds no checkpoint and no data.jsonl"):
        train(TrainConfig(target="t", data="d", out=str(tmp_path / "typo"), resume=True))


@pytest.mark.parametrize("ids", [["0", "1", "2"], ["1", "1", "2"], ["1", "2", "9"]])
def test_aux_layer_ids_are_checked_in_their_own_terms_before_any_data(tiny_llama, ids, capsys):
    """Said as typed (input layers; the file's ids are one less), before the data: a layer
    0 read as the file's -1 was refused after generating it."""
    out = tiny_llama.parent / f"aux-{'-'.join(ids)}"
    argv = ["train-eagle3", "--target", str(tiny_llama), "--data", "python", "--out", str(out)]
    assert main(argv + ["--aux-layer-ids", *ids, "--no-progress"]) == 2
    last = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"] - 1
    assert (
        f"auxiliary layer ids [{', '.join(ids)}] must be three different target layers "
        f"in [1, {last}]" in capsys.readouterr().err
    )
    assert not (out / "data.jsonl").exists()
