"""Prometheus metrics (`--enable-metrics`): request latencies from the tokenizer manager, load from the scheduler."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sglang.srt.managers.io_struct import SchedulerState

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"sglang:{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.num_running_reqs = gauge("num_running_reqs", "Requests running in the scheduler.")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting in the scheduler's queue.")
        self.token_usage = gauge("token_usage", "Fraction of the KV pool used by running requests.")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.")
        self.gen_throughput = gauge("gen_throughput", "Generation throughput (token/s).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_requests = counter("num_requests", "Requests finished.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.")

    def on_output(self, created: float, last_time: float | None, new_tokens: int, now: float) -> None:
        if new_tokens <= 0:
            return
        if last_time is None:
            self.ttft.labels(**self.labels).observe(now - created)
            new_tokens -= 1
            last_time = now
        for _ in range(new_tokens):
            self.itl.labels(**self.labels).observe((now - last_time) / max(new_tokens, 1))

    def on_finish(self, created: float, prompt_tokens: int, completion_tokens: int) -> None:
        self.e2e.labels(**self.labels).observe(time.monotonic() - created)
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)
        self.generation_tokens.labels(**self.labels).inc(completion_tokens)
        self.num_requests.labels(**self.labels).inc()

    def render(self, state: SchedulerState) -> bytes:
        self.num_running_reqs.labels(**self.labels).set(state.num_running_reqs)
        self.num_queue_reqs.labels(**self.labels).set(state.num_queue_reqs)
        self.token_usage.labels(**self.labels).set(state.token_usage)
        self.cache_hit_rate.labels(**self.labels).set(state.cache_hit_rate)
        self.gen_throughput.labels(**self.labels).set(state.last_gen_throughput)
        return generate_latest(self.registry)
