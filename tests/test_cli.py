"""The command line: ``python -m pagedspec`` lists the commands; ``generate`` completes a prompt
with a local checkpoint and reports tokens/s; bad arguments fail with a message, not a trace."""
from __future__ import annotations

import subprocess
import sys

import pytest

from checkpoints import make_checkpoint
from pagedspec import LLM, SamplingParams
from pagedspec.cli import main


def test_module_prints_the_commands():
    out = subprocess.run([sys.executable, "-m", "pagedspec"], capture_output=True, text=True,
                         check=True).stdout
    assert "generate" in out and "bench" in out


def test_generate_prints_the_greedy_completion(tmp_path, capsys):
    path = make_checkpoint(tmp_path / "m", "llama")
    prompt = "def fibonacci(n):"
    assert main(["generate", "--model", str(path), "--prompt", prompt, "--max-tokens", "12",
                 "--ignore-eos", "--device", "cpu", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    expected = LLM(path, device="cpu", dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert captured.out == prompt + expected.text + "\n"
    assert "12 tokens in" in captured.err and "tokens/s" in captured.err


def test_generate_with_speculation_prints_the_metrics(tmp_path, capsys):
    path = make_checkpoint(tmp_path / "m", "llama")
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--max-tokens", "16",
                 "--ignore-eos", "--device", "cpu", "--speculative-model", "ngram",
                 "--no-speculative-adaptive"]) == 0
    err = capsys.readouterr().err
    assert "speculative:" in err and "acceptance rate" in err and "mean acceptance length" in err


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent", "--prompt", "x"], "not a checkpoint directory"),
    (["--prompt", "x", "--max-tokens", "0"], "max_tokens must be"),
])
def test_generate_reports_bad_arguments(tmp_path, capsys, args, message):
    if "--model" not in args:
        args = ["--model", str(make_checkpoint(tmp_path / "m", "llama"))] + args
    assert main(["generate", "--device", "cpu"] + args) == 2
    assert message in capsys.readouterr().err


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
