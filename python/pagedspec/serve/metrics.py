"""Prometheus metrics of a serving engine, under vLLM v1's names with a ``pagedspec:`` prefix
(``vllm:time_to_first_token_seconds`` is ``pagedspec:time_to_first_token_seconds`` here, same
buckets, same ``model_name`` and ``engine`` labels), so vLLM dashboards port by renaming the
prefix.

:class:`ServerMetrics` is fed by the async engine's ``stats_listener`` with one
:class:`~pagedspec.engine.metrics.StepStats` per engine step (called on the engine's thread;
``prometheus_client`` metrics are thread-safe) and renders its own :class:`CollectorRegistry`, so
several servers in one process (tests) never share a series.

Names (vLLM v1's ``vllm/v1/metrics/loggers.py`` and ``vllm/v1/spec_decode/metrics.py``):

- gauges: ``num_requests_running``, ``num_requests_waiting``, ``num_requests_swapped`` (vLLM
  v0's), ``kv_cache_usage_perc`` (a fraction, 1 = full, as vLLM's);
- counters: ``num_preemptions_total``, ``prompt_tokens_total``, ``generation_tokens_total``,
  ``request_success_total{finished_reason="stop"|"length"|"abort"}``;
- histograms: ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds``,
  ``request_inference_time_seconds``, ``request_prefill_time_seconds``,
  ``request_decode_time_seconds``, ``request_prompt_tokens``, ``request_generation_tokens``,
  ``request_params_n``, ``request_params_max_tokens``, ``iteration_tokens_total``;
- with speculation: ``spec_decode_num_drafts_total``, ``spec_decode_num_draft_tokens_total``,
  ``spec_decode_num_accepted_tokens_total``,
  ``spec_decode_num_accepted_tokens_per_pos_total{position}``.
"""
from __future__ import annotations

import threading
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "pagedspec:"
FINISH_REASONS = ("stop", "length", "abort")

# vLLM v1's bucket boundaries, so that quantiles computed from either server's histograms agree
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of their own.

    Args:
        model_name: the ``model_name`` label (the served model name, as vLLM's).
        max_model_len: the engine's context length (top of the token-count histograms).
        num_speculative_tokens: the draft length when the engine speculates (its per-position
            counters are created up front, as vLLM's), None without speculation (no
            ``spec_decode_*`` metrics then).

    Use :meth:`record` as the async engine's ``stats_listener``; :meth:`render` gives the text
    exposition for ``GET /metrics``.
    """

    def __init__(self, model_name: str, max_model_len: int,
                 num_speculative_tokens: Optional[int] = None):
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"ServerMetrics: max_model_len must be an int >= 1, got "
                             f"{max_model_len!r}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name", "engine"]
        values = (model_name, "0")
        self._lock = threading.Lock()      # the per-position counters may grow from two threads

        def make(kind, name: str, doc: str, **kwargs):
            return kind(PREFIX + name, doc, labels, registry=self.registry,
                        **kwargs).labels(*values)

        self.running = make(Gauge, "num_requests_running",
                            "Number of requests in model execution batches.")
        self.waiting = make(Gauge, "num_requests_waiting",
                            "Number of requests waiting to be processed.")
        self.swapped = make(Gauge, "num_requests_swapped",
                            "Number of requests whose KV blocks are swapped out to CPU memory.")
        self.kv_cache_usage = make(Gauge, "kv_cache_usage_perc",
                                   "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = make(Counter, "num_preemptions",
                                "Cumulative number of preemption from the engine.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "generation_tokens",
                                      "Number of generation tokens processed.")
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=self.registry)
        self.request_success = {reason: success.labels(*values, reason)
                                for reason in FINISH_REASONS}
        self._success_family = success
        self.ttft = make(Histogram, "time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS)
        self.inter_token = make(Histogram, "inter_token_latency_seconds",
                                "Histogram of inter-token latency in seconds.",
                                buckets=INTER_TOKEN_BUCKETS)
        timing = {}
        for key, name, doc in [
            ("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            ("queue", "request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request."),
            ("inference", "request_inference_time_seconds",
             "Histogram of time spent in RUNNING phase for request."),
            ("prefill", "request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request."),
            ("decode", "request_decode_time_seconds",
             "Histogram of time spent in DECODE phase for request.")]:
            timing[key] = make(Histogram, name, doc, buckets=REQUEST_LATENCY_BUCKETS)
        self.timing = timing
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = make(Histogram, "request_prompt_tokens",
                                          "Number of prefill tokens processed.",
                                          buckets=token_buckets)
        self.request_generation_tokens = make(Histogram, "request_generation_tokens",
                                              "Number of generation tokens processed.",
                                              buckets=token_buckets)
        self.request_max_tokens = make(Histogram, "request_params_max_tokens",
                                       "Histogram of the max_tokens request parameter.",
                                       buckets=token_buckets)
        self.request_n = make(Histogram, "request_params_n",
                              "Histogram of the n request parameter.", buckets=N_BUCKETS)
        self.iteration_tokens = make(Histogram, "iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     buckets=ITERATION_TOKEN_BUCKETS)
        self.speculative = num_speculative_tokens is not None
        if self.speculative:
            self.spec_drafts = make(Counter, "spec_decode_num_drafts",
                                    "Number of spec decoding drafts.")
            self.spec_draft_tokens = make(Counter, "spec_decode_num_draft_tokens",
                                          "Number of draft tokens.")
            self.spec_accepted_tokens = make(Counter, "spec_decode_num_accepted_tokens",
                                             "Number of accepted tokens.")
            self._per_pos_family = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.",
                                           labels + ["position"], registry=self.registry)
            self.spec_accepted_per_pos = [self._per_pos_family.labels(*values, str(pos))
                                          for pos in range(num_speculative_tokens)]

    def record(self, stats) -> None:
        """Adds one engine step (:class:`~pagedspec.engine.metrics.StepStats`)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_prompt_tokens or stats.num_generation_tokens:
            self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        for seconds in stats.time_to_first_tokens:
            self.ttft.observe(seconds)
        for seconds in stats.inter_token_latencies:
            self.inter_token.observe(seconds)
        for done in stats.finished:
            counter = self.request_success.get(done.finish_reason)
            if counter is None:   # a reason vLLM does not list: count it under its own label
                counter = self._success_family.labels(self.model_name, "0", done.finish_reason)
            counter.inc()
            self.timing["e2e"].observe(done.e2e_latency)
            self.timing["queue"].observe(done.queue_time)
            self.timing["inference"].observe(done.prefill_time + done.decode_time)
            self.timing["prefill"].observe(done.prefill_time)
            self.timing["decode"].observe(done.decode_time)
            self.request_prompt_tokens.observe(done.num_prompt_tokens)
            self.request_generation_tokens.observe(done.num_generation_tokens)
            self.request_max_tokens.observe(done.max_tokens)
            self.request_n.observe(done.n)
        spec = stats.spec
        if spec is not None and self.speculative:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
            per_pos = spec.num_accepted_tokens_per_pos
            if len(per_pos) > len(self.spec_accepted_per_pos):
                with self._lock:
                    for pos in range(len(self.spec_accepted_per_pos), len(per_pos)):
                        self.spec_accepted_per_pos.append(
                            self._per_pos_family.labels(self.model_name, "0", str(pos)))
            for counter, count in zip(self.spec_accepted_per_pos, per_pos):
                counter.inc(count)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
