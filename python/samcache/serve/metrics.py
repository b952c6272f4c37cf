"""``GET /metrics``: the server's Prometheus metrics (prometheus_client, one registry per server).

Counters and histograms are updated as requests end; the pool, the image-KV store, the tiers and
the running requests are read from the engine when scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from samcache.engine.metrics import TurnMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_COUNTERS = {  # metric name -> (TurnMetrics field, help)
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of finished requests"),
    "generation_tokens": ("decode_tokens", "Tokens generated"),
    "prefix_reused_tokens": ("prefix_reused_tokens", "Prompt tokens whose KV came from the prefix cache"),
    "image_reused_tokens": ("image_reused_tokens", "Image tokens whose KV was spliced in from an earlier request"),
    "prefilled_tokens": ("prefilled_tokens", "Prompt tokens computed from scratch"),
    "recomputed_tokens": ("recomputed_tokens", "Reused tokens recomputed"),
    "vit_calls": ("vit_calls", "Images run through the vision tower"),
    "vit_hits": ("vit_hits", "Images whose vision-tower output came from the ViT cache"),
    "image_kv_hits": ("image_kv_hits", "Images whose KV came from the image-KV store or its tiers"),
}


class ServerMetrics:
    """The metrics of one server over ``engine`` and its online ``loop`` (the engine's memory read
    between two steps when scraped)."""

    def __init__(self, engine, loop) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("samcache_requests", "Requests answered, by outcome", ["outcome"],
                                registry=self.registry)
        self.ttft = Histogram("samcache_time_to_first_token_seconds", "Arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("samcache_request_latency_seconds", "Arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens = {name: Counter(f"samcache_{name}", help_, registry=self.registry)
                       for name, (_, help_) in TOKEN_COUNTERS.items()}
        self.registry.register(_EngineState(engine, loop))

    def finished(self, metrics: TurnMetrics) -> None:
        self.requests.labels("ok").inc()
        self.ttft.observe(metrics.ttft_s)
        self.latency.observe(metrics.latency_s)
        for name, (field, _) in TOKEN_COUNTERS.items():
            self.tokens[name].inc(getattr(metrics, field))

    def failed(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineState:
    """Gauges read from the engine at scrape time."""

    def __init__(self, engine, loop) -> None:
        self.engine = engine
        self.loop = loop

    def describe(self):
        return []

    def collect(self):
        memory = self.engine.memory_stats()  # between two steps
        pool, tiers = memory["pool"], memory["tiers"]
        image_bytes, image_records = memory["image_kv_bytes"], memory["image_kv_records"]
        blocks = GaugeMetricFamily("samcache_kv_pool_blocks", "KV pool blocks by state", labels=["state"])
        cached = int(pool["evictable_blocks"])
        blocks.add_metric(["free"], int(pool["free_blocks"]))
        blocks.add_metric(["cached"], cached)
        blocks.add_metric(["used"], int(pool["num_blocks"]) - int(pool["free_blocks"]) - cached)
        yield blocks
        yield GaugeMetricFamily("samcache_kv_pool_blocks_total", "KV pool size in blocks", value=int(pool["num_blocks"]))
        yield GaugeMetricFamily("samcache_live_sequences", "Sequences in the pool (requests and image records)",
                                value=int(pool["live_sequences"]))
        yield GaugeMetricFamily("samcache_image_kv_store_bytes", "Image KV held for reuse", value=image_bytes)
        yield GaugeMetricFamily("samcache_image_kv_records", "Images whose KV the pool holds for reuse (one sequence "
                                "each)", value=image_records)
        yield GaugeMetricFamily("samcache_running_requests", "Requests admitted and not finished",
                                value=self.loop.live)
        yield CounterMetricFamily("samcache_steps", "Forward steps of the step loop", value=self.loop.steps)
        yield CounterMetricFamily("samcache_batch_wait_seconds", "Time an idle loop held its first step for requests "
                                  "still being parsed (--batch-wait-ms)", value=self.loop.gathered_s)
        tier = GaugeMetricFamily("samcache_tier", "Each tier's counters and occupancy (engine.tier_stats())",
                                 labels=["tier", "stat"])
        for name, stats in tiers.items():
            for stat, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    tier.add_metric([name, stat], value)
        yield tier


__all__ = ["ServerMetrics"]
