"""`specserve generate` streams text and exits 0; bad input exits 2 with a clear message."""

from __future__ import annotations

import sys

import pytest

from specserve import LLM, SamplingParams
from specserve.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_the_greedy_text(tiny_llama, capsys, monkeypatch):
    writes: list[str] = []
    write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or write(s))
    code, out, _ = run(capsys, "The quick brown fox", "--model", str(tiny_llama),
                       "--max-tokens", "12")
    assert code == 0
    llm = LLM(str(tiny_llama))
    ids = llm.apply_chat_template([{"role": "user", "content": "The quick brown fox"}])
    expected = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    assert out == expected + "\n"
    assert len([w for w in writes if w]) > 2, "the text should arrive in several deltas"


def test_generate_without_chat_template_and_with_a_seed(tiny_llama, capsys):
    argv = ["Héllo wörld", "--model", str(tiny_llama), "--max-tokens", "10",
            "--no-chat-template", "--temperature", "1.0", "--sampling-seed", "5"]
    code, first, _ = run(capsys, *argv)
    assert code == 0
    code, second, _ = run(capsys, *argv)
    assert code == 0 and first == second
    llm = LLM(str(tiny_llama))
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5)
    assert first == llm.generate("Héllo wörld", params)[0].text + "\n"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1; got 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]; got 1.5"),
        (["--temperature", "-1"], "temperature must be in [0, 100]"),
        (["--max-model-len", "8"], "this model's context is 8 tokens"),
    ],
)
def test_bad_request_exits_2_with_a_message(tiny_llama, capsys, argv, message):
    code, out, err = run(capsys, "a long enough prompt for the context check",
                         "--model", str(tiny_llama), *argv)
    assert code == 2
    assert out == ""
    last = err.strip().splitlines()[-1]  # after the weight-loading progress bar
    assert last.startswith("specserve: error: ") and message in last


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


def test_bad_engine_option_exits_2(tiny_llama, capsys):
    code, _, err = run(capsys, "hi", "--model", str(tiny_llama), "--page-size", "0")
    assert code == 2 and "page_size must be >= 1" in err
