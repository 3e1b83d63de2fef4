"""The serving benchmark's client (pagedspec.bench.serve): its workload, its timing against a
scripted streaming server whose delays are known, and its counts against the real
``pagedspec serve`` on a tiny checkpoint."""
from __future__ import annotations

import asyncio
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from pagedspec.bench import serve as bench

from checkpoints import make_checkpoint

# --------------------------------------------------------------------------------------------
# Workload (no server)


@pytest.mark.parametrize("rate,burstiness", [(50.0, 1.0), (20.0, 0.25), (100.0, 4.0)])
def test_arrivals_have_the_gamma_process_moments(rate, burstiness):
    # n = 20000 intervals: the sample mean's relative standard error is 1/sqrt(n burstiness)
    # <= 1.5%, the squared coefficient of variation's about sqrt(2/n)(1 + ...) < 5%; 5 sigma-ish
    # bounds below. A wrong scale (1/rate without the shape) or a Poisson process regardless of
    # burstiness fails one of them.
    rng = np.random.default_rng(zlib.crc32(f"{rate}{burstiness}".encode()))
    offsets = bench.arrival_offsets(20001, rate, burstiness, rng)
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    assert abs(gaps.mean() * rate - 1.0) < 0.06
    assert abs(gaps.var() / gaps.mean() ** 2 * burstiness - 1.0) < 0.25


def test_infinite_rate_sends_all_at_once():
    assert np.array_equal(bench.arrival_offsets(7, float("inf"), 1.0,
                                                np.random.default_rng(0)), np.zeros(7))


@pytest.mark.parametrize("mean,ratio", [(256, 0.0), (100, 0.5), (3, 0.9), (1, 0.5)])
def test_sampled_lengths_stay_in_range(mean, ratio):
    rng = np.random.default_rng(mean)
    lengths = bench.sample_lengths(rng, 4000, mean, ratio)
    low, high = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    assert lengths.min() >= low and lengths.max() <= high
    if high - low >= 2:     # uniform: both ends are drawn, the mean is near the middle
        assert lengths.min() == low and lengths.max() == high
        assert abs(lengths.mean() - (low + high) / 2) < 0.05 * (high - low) + 0.5
    else:
        assert set(lengths.tolist()) <= {low, high}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bench-serve") / "tiny", seed=3,
                           vocab_size=320, max_position_embeddings=256)


@pytest.mark.parametrize("prompt_format", ["ids", "text"])
def test_prompts_are_random_reproducible_and_never_special(checkpoint, prompt_format):
    source = bench.PromptSource(checkpoint)
    special = set(source.tokenizer.get_added_tokens_decoder())
    assert special == {0, 1, 2}           # <unk>, <s>, </s> in the tiny tokenizer
    a = bench.make_requests(source, 12, 40, 8, 0.5, prompt_format, seed=5)
    b = bench.make_requests(source, 12, 40, 8, 0.5, prompt_format, seed=5)
    c = bench.make_requests(source, 12, 40, 8, 0.5, prompt_format, seed=6)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    for r in a:
        assert 20 <= r.prompt_len <= 60 and 4 <= r.output_len <= 12
        ids = (r.prompt if prompt_format == "ids"
               else source.tokenizer.encode(r.prompt, add_special_tokens=False).ids)
        assert not special & set(ids)
        if prompt_format == "ids":
            assert len(ids) == r.prompt_len and all(0 <= t < source.vocab_size for t in ids)
        else:
            assert 0 < len(ids) <= r.prompt_len + 2   # re-encoding may merge or split an edge


def test_bad_arguments_name_the_argument(checkpoint, capsys):
    cases = [(["--goodput", "ttft"], "--goodput"), (["--goodput", "latency:5"], "--goodput"),
             (["--goodput", "ttft:-1"], "--goodput"), (["--range-ratio", "1.0"], "--range-ratio"),
             (["--base-url", "http://10.0.0.1:8000"], "--base-url"),
             (["--servers", "a=http://example.com:80"], "--servers"),
             (["--sweep-concurrency", "1,4", "--num-prompts", "1,2,3"], "--num-prompts"),
             (["--max-concurrency", "0"], "--max-concurrency"),
             (["--launch", "nameless"], "--launch"), (["--input-len", "0"], "--input-len")]
    for extra, argument in cases:
        assert bench.main(["--tokenizer", str(checkpoint), *extra]) == 2
        assert argument in capsys.readouterr().err, extra
    assert bench.main(["--tokenizer", str(checkpoint.parent)]) == 2
    assert "--tokenizer" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Timing against a scripted server: the first chunk after FIRST_S, then a chunk every GAP_S.

FIRST_S, GAP_S = 0.12, 0.03


async def scripted_server(record: dict):
    """An aiohttp app streaming ``max_tokens`` one-token chunks on a fixed schedule, recording
    the most requests it had in flight. A prompt of [0] answers 400; [1] ends without [DONE]."""
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        record["bodies"].append(body)
        if body["prompt"] == [0]:
            return web.json_response({"error": {"message": "bad"}}, status=400)
        record["in_flight"] += 1
        record["max_in_flight"] = max(record["max_in_flight"], record["in_flight"])
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(FIRST_S if i == 0 else GAP_S)
                chunk = {"choices": [{"index": 0, "text": f"t{i}",
                                      "finish_reason": "length" if i == n - 1 else None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if body["prompt"] == [1]:
                return response
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                                 .encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            record["in_flight"] -= 1

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = bench.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def scripted_run(specs, warmups, **kwargs):
    record = {"bodies": [], "in_flight": 0, "max_in_flight": 0}

    async def scenario():
        runner, url = await scripted_server(record)
        try:
            return await bench.run_tier(url, "m", specs, warmups, burstiness=1.0, seed=0,
                                        temperature=0.0, request_timeout=30.0,
                                        tier_timeout=30.0, **kwargs)
        finally:
            await runner.cleanup()

    return asyncio.run(scenario()), record


@pytest.mark.parametrize("concurrency", [1, 3])
def test_timing_and_concurrency_against_a_scripted_server(concurrency):
    output_lens = [4, 6, 2, 5, 3, 6]
    specs = [bench.RequestSpec([5 + i] * (3 + i), 3 + i, n) for i, n in enumerate(output_lens)]
    run, record = scripted_run(specs, [bench.RequestSpec([9], 1, 1)],
                               max_concurrency=concurrency, request_rate=float("inf"))
    assert len(record["bodies"]) == len(specs) + 1          # the warm-up went first, untimed
    assert record["bodies"][0]["prompt"] == [9]
    assert record["max_in_flight"] == concurrency
    body = record["bodies"][1]
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    m = bench.summarize(run, {})
    assert m["completed"] == len(specs) and m["failed"] == 0
    assert m["total_output_tokens"] == sum(output_lens)
    # Lower bounds are exact (the server sleeps at least that long); upper bounds allow 80 ms of
    # scheduling delay on a loaded machine. Measuring TTFT from the tier's start, or TPOT over
    # all tokens, would break them at concurrency 1 (later requests wait for earlier ones).
    for r, n in zip(run.results, output_lens):
        assert r.success and r.output_tokens == n and r.prompt_tokens == r.prompt_len
        assert FIRST_S <= r.ttft < FIRST_S + 0.08
        assert len(r.itl) == n - 1 and all(GAP_S * 0.9 <= g < GAP_S + 0.08 for g in r.itl)
        if n > 1:
            assert GAP_S * 0.9 <= r.tpot < GAP_S + 0.08
        assert r.e2el >= FIRST_S + (n - 1) * GAP_S
    serial = sum(FIRST_S + (n - 1) * GAP_S for n in output_lens)
    if concurrency == 1:
        assert run.duration >= serial
        starts = sorted(r.start for r in run.results)
        assert starts[-1] >= serial - (FIRST_S + 5 * GAP_S)     # the last waited for the rest
    else:
        assert run.duration < serial


def test_failures_are_counted_not_raised():
    specs = [bench.RequestSpec([0], 1, 3), bench.RequestSpec([1], 1, 3),
             bench.RequestSpec([7, 7], 2, 3)]
    run, _ = scripted_run(specs, [], max_concurrency=None, request_rate=float("inf"))
    m = bench.summarize(run, {})
    assert (m["completed"], m["failed"]) == (1, 2)
    assert m["total_output_tokens"] == 3
    errors = [r.error for r in run.results]
    assert errors[0].startswith("HTTP 400") and "[DONE]" in errors[1] and errors[2] == ""


def test_poisson_arrivals_spread_the_requests():
    specs = [bench.RequestSpec([5, 6], 2, 1) for _ in range(8)]
    run, _ = scripted_run(specs, [], max_concurrency=None, request_rate=10.0)
    starts = np.array(sorted(r.start for r in run.results))
    expected = bench.arrival_offsets(8, 10.0, 1.0, np.random.default_rng(0))
    assert np.all(starts >= expected - 1e-3) and np.all(starts < expected + 0.08)


# --------------------------------------------------------------------------------------------
# Against the real server


@pytest.fixture(scope="module")
def pagedspec_server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = (f"env OMP_NUM_THREADS=1 {sys.executable} -m pagedspec.serve --model {checkpoint} "
               f"--dtype float32 --max-num-seqs 8 --log-level warning")
    server = bench.LaunchedServer("pagedspec", command, log, start_timeout=90.0)
    url = server.start()
    yield url
    server.stop()
    assert server.process is None


@pytest.mark.parametrize("concurrency,range_ratio,prompt_format",
                         [(1, 0.0, "ids"), (4, 0.5, "ids"), (3, 0.0, "text")])
def test_counts_percentiles_and_goodput_against_pagedspec_serve(
        pagedspec_server, checkpoint, concurrency, range_ratio, prompt_format):
    source = bench.PromptSource(checkpoint)
    seed = zlib.crc32(f"{concurrency}{range_ratio}{prompt_format}".encode())
    specs = bench.make_requests(source, 6, 24, 10, range_ratio, prompt_format, seed)
    warmups = bench.make_requests(source, 1, 24, 2, 0.0, prompt_format, seed + 1)
    model = bench.served_model_name(pagedspec_server)
    run = asyncio.run(bench.run_tier(
        pagedspec_server, model, specs, warmups, max_concurrency=concurrency,
        request_rate=float("inf"), burstiness=1.0, seed=seed, temperature=0.0,
        request_timeout=60.0, tier_timeout=60.0))
    m = bench.summarize(run, {})
    assert (m["completed"], m["failed"], m["warmup_failed"]) == (6, 0, 0), m["errors"]
    # ignore_eos: every request generates exactly its max_tokens.
    assert m["total_output_tokens"] == sum(s.output_len for s in specs)
    for r, s in zip(run.results, specs):
        assert r.output_tokens == s.output_len and r.finish_reason == "length"
        if prompt_format == "ids":
            assert r.prompt_tokens == s.prompt_len
        assert r.ttft <= r.e2el and 0 < len(r.itl) + 1 <= r.output_tokens + 1
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = m[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
    assert m["ttft_ms"]["p99"] <= m["e2el_ms"]["p99"]
    assert m["request_throughput"] == pytest.approx(6 / m["duration_s"])
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])

    # Goodput at SLOs between the measured values: exactly the requests below each cut count.
    ttft_cut = float(np.median([r.ttft for r in run.results])) * 1000.0
    slo = {"ttft": ttft_cut, "e2el": 1e9}
    good = sum(r.ttft * 1000.0 <= ttft_cut for r in run.results)
    m_slo = bench.summarize(run, slo)
    assert m_slo["good_requests"] == good >= 3          # at least the half below the median
    assert m_slo["goodput"] == pytest.approx(good / m["duration_s"])
    assert bench.summarize(run, {"tpot": 1e9, "e2el": 1e9})["good_requests"] == 6
    assert bench.summarize(run, {"e2el": 1e-3})["good_requests"] == 0


def test_cli_side_by_side_with_the_offline_llm_writes_json_markdown_and_plot(
        pagedspec_server, checkpoint, tmp_path, monkeypatch):
    # The server and the offline LLM on the same checkpoint, two tiers: the alternation, the
    # counts of both kinds of column, the table, the JSON and the plot are what is checked.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "report"
    start = time.monotonic()
    rc = bench.main(["--servers", f"served={pagedspec_server}",
                     "--offline", f"offline=--model {checkpoint} --dtype float32",
                     "--tokenizer", str(checkpoint), "--sweep-concurrency", "1,2",
                     "--num-prompts", "2,3", "--input-len", "16", "--output-len", "4",
                     "--num-warmups", "1", "--goodput", "ttft:60000", "tpot:60000",
                     "--out", str(out)])
    assert rc == 0 and time.monotonic() - start < 90
    report = json.loads((out / "results.json").read_text())
    tiers = report["tiers"]
    assert [(t["server"], t["concurrency"]) for t in tiers] == [
        ("served", 1), ("offline", 1), ("offline", 2), ("served", 2)]
    for t in tiers:
        m = t["metrics"]
        assert m["completed"] == t["num_prompts"] == len(t["requests"])
        assert m["total_output_tokens"] == 4 * t["num_prompts"]
        assert m["total_input_tokens"] == 16 * t["num_prompts"]
        assert m["good_requests"] == t["num_prompts"]
        assert m["ttft_ms"]["p50"] <= m["e2el_ms"]["p50"]
        assert (m["itl_ms"]["mean"] is None) == (t["server"] == "offline")
    table = (out / "table.md").read_text()
    assert "| concurrency | served out tok/s | served p99 TTFT ms | offline out tok/s" in table
    assert "goodput req/s (ttft<=60000ms, tpot<=60000ms)" in table
    assert (out / "serve.png").stat().st_size > 10_000


def test_launch_gives_up_on_a_server_that_exits_or_never_answers(tmp_path):
    gone = bench.LaunchedServer("gone", f"{sys.executable} -c 'print(\"bye\"); raise "
                                f"SystemExit(3)'", tmp_path / "gone.log", start_timeout=30.0)
    with pytest.raises(RuntimeError, match="exited with 3"):
        gone.start()
    assert "bye" in gone.log_tail()
    # A server without /health (404): waited for at most start_timeout, then stopped.
    silent = bench.LaunchedServer(
        "silent", f"{sys.executable} -m http.server {{port}} --bind 127.0.0.1",
        tmp_path / "silent.log", start_timeout=3.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer within"):
        silent.start()
    # The bound a correct launcher keeps however loaded the machine: the start timeout, one
    # health request's own 2 s timeout past it, and stop()'s whole escalation (SIGINT, SIGTERM,
    # SIGKILL waits). The SIGINT wait alone once took 18 s under CI's load.
    assert time.monotonic() - start < 3.0 + 2.0 + bench.STOP_GRACE_S + 10.0 + 10.0
    assert silent.process is None
