"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from luxjax.engine.requests import Finished

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("luxjax_requests", "Finished HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("luxjax_prompt_tokens", "Prompt tokens processed (image tokens included)",
                                     registry=r)
        self.completion_tokens = Counter("luxjax_completion_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("luxjax_queue_depth", "Requests waiting for a slot", registry=r)
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.active_slots = Gauge("luxjax_active_slots", "Slots holding a sequence", registry=r)
        self.active_slots.set_function(lambda: engine.active_slots)
        self.ttft = Histogram("luxjax_time_to_first_token_seconds", "Submit to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.per_token = Histogram("luxjax_time_per_output_token_seconds", "Gap between consecutive tokens",
                                   registry=r, buckets=LATENCY_BUCKETS)
        self.image_encode = Histogram("luxjax_image_encode_seconds", "Vision encoder time per request with images",
                                      registry=r, buckets=LATENCY_BUCKETS)
        self.queued = Histogram("luxjax_queue_wait_seconds", "Submit to admission into a slot", registry=r,
                                buckets=LATENCY_BUCKETS)
        self.duration = Histogram("luxjax_request_duration_seconds", "Submit to last token", registry=r,
                                  buckets=LATENCY_BUCKETS)

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe(self, finished: Finished, has_images: bool) -> None:
        t = finished.timings
        self.prompt_tokens.inc(finished.prompt_tokens)
        self.completion_tokens.inc(finished.completion_tokens)
        self.queued.observe(t.queued_s)
        self.duration.observe(t.total_s)
        if finished.completion_tokens or finished.finish_reason == "stop":
            self.ttft.observe(t.time_to_first_token_s)
        for gap in t.inter_token_s:
            self.per_token.observe(gap)
        if has_images:
            self.image_encode.observe(t.image_encode_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
