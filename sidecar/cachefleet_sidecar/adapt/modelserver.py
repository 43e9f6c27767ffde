"""What a model server's own ``/metrics`` says about its load and its KV cache.

Pure: text in, :class:`ModelServerMetrics` out. The sidecar's admission reads
its own model server through it, and the router reads every endpoint through
it, so vLLM's and SGLang's names are spelled here and nowhere else.

Only the few series routing and admission need are read; every other line is
skipped without being parsed. A series exported once per label set (one per
model or LoRA adapter) is summed. Names, by server:

=====================  ==================================  =============================
field                  vLLM                                SGLang
=====================  ==================================  =============================
waiting                ``vllm:num_requests_waiting``       ``sglang:num_queue_reqs``
running                ``vllm:num_requests_running``       ``sglang:num_running_reqs``
kv_usage               ``vllm:kv_cache_usage_perc``        ``sglang:token_usage``
                       (``vllm:gpu_cache_usage_perc``
                       before v1)
prefix queries / hits  ``vllm:prefix_cache_queries_total``
                       / ``vllm:prefix_cache_hits_total``
                       (tokens)
prefix hit ratio                                           ``sglang:cache_hit_rate``
prompt tokens          ``vllm:prompt_tokens_total``        ``sglang:prompt_tokens_total``
prefill seconds        ``vllm:request_prefill_time_``
                       ``seconds_sum``
prefilled requests     ``vllm:request_prefill_time_``
                       ``seconds_count``
KV capacity            ``vllm:cache_config_info``          ``sglang:max_total_num_tokens``
                       labels ``num_gpu_blocks``,
                       ``block_size``
=====================  ==================================  =============================
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class ModelServerMetrics:
    """One scrape of a model server, normalised across vLLM and SGLang.

    Gauges are as read; ``*_total`` fields are the raw cumulative counters (the
    reader of two scrapes takes their difference). ``None``: not exported.
    """

    #: requests queued for prefill
    waiting: float = 0.0
    #: requests being prefilled or decoded
    running: float = 0.0
    #: share of KV cache in use, 0..1
    kv_usage: float = 0.0
    #: prefix cache: tokens looked up and tokens found, cumulative (vLLM)
    prefix_queries_total: float | None = None
    prefix_hits_total: float | None = None
    #: the server's own prefix hit ratio, 0..1 (SGLang exports the ratio itself)
    prefix_hit_ratio: float | None = None
    #: prompt tokens processed, cumulative
    prompt_tokens_total: float | None = None
    #: seconds spent in prefill, cumulative
    prefill_seconds_total: float | None = None
    #: requests prefilled, cumulative (the prefill histogram's count)
    prefill_requests_total: float | None = None
    #: KV capacity in tokens, when the server says
    kv_capacity_tokens: int | None = None
    #: which server family the names came from: ``vllm``, ``sglang`` or ``""`` (neither)
    server: str = ""


#: series name -> (field, server); summed over label sets
_SERIES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_waiting": ("waiting", "vllm"),
    "vllm:num_requests_running": ("running", "vllm"),
    "vllm:kv_cache_usage_perc": ("kv_usage", "vllm"),
    "vllm:gpu_cache_usage_perc": ("kv_usage", "vllm"),
    "vllm:prefix_cache_queries_total": ("prefix_queries_total", "vllm"),
    "vllm:prefix_cache_hits_total": ("prefix_hits_total", "vllm"),
    "vllm:prompt_tokens_total": ("prompt_tokens_total", "vllm"),
    "vllm:request_prefill_time_seconds_sum": ("prefill_seconds_total", "vllm"),
    "vllm:request_prefill_time_seconds_count": ("prefill_requests_total", "vllm"),
    "sglang:num_queue_reqs": ("waiting", "sglang"),
    "sglang:num_running_reqs": ("running", "sglang"),
    "sglang:token_usage": ("kv_usage", "sglang"),
    "sglang:cache_hit_rate": ("prefix_hit_ratio", "sglang"),
    "sglang:prompt_tokens_total": ("prompt_tokens_total", "sglang"),
    "sglang:max_total_num_tokens": ("kv_capacity_tokens", "sglang"),
}
#: gauges that are ratios or capacities: averaged / taken once, not summed
_NOT_SUMMED = frozenset({"kv_usage", "prefix_hit_ratio", "kv_capacity_tokens"})
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_PREFIXES = ("vllm:", "sglang:")


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition of a known model server."""


def _label(labels: str, name: str) -> str | None:
    """The value of one label in ``a="1",b="2"`` (no escapes in the labels we read)."""
    key = f'{name}="'
    start = labels.find(key)
    if start < 0 or (start > 0 and labels[start - 1] not in ", {"):
        return None
    start += len(key)
    end = labels.find('"', start)
    return labels[start:end] if end >= 0 else None


def parse_metrics(text: str) -> ModelServerMetrics:
    """The fields of :class:`ModelServerMetrics` from a ``/metrics`` body.

    Raises :class:`MetricsParseError` when no vLLM or SGLang series is present
    (a wrong port, a proxy's error page): an endpoint that says nothing about
    its load must not look idle.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    server = ""
    capacity: int | None = None
    for raw in text.splitlines():
        if not raw.startswith(_PREFIXES):
            continue
        line = raw.strip()
        brace = line.find("{")
        if brace >= 0:
            close = line.rfind("}")
            if close < brace:
                continue
            name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
        else:
            name, _, rest = line.partition(" ")
            labels = ""
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        if name == _VLLM_CACHE_INFO:
            blocks, size = _label(labels, "num_gpu_blocks"), _label(labels, "block_size")
            if blocks and size and blocks.isdigit() and size.isdigit():
                capacity = int(blocks) * int(size)
                server = server or "vllm"
            continue
        known = _SERIES.get(name)
        if known is None:
            continue
        field, family = known
        server = server or family
        sums[field] = sums.get(field, 0.0) + value
        counts[field] = counts.get(field, 0) + 1
    if not server:
        raise MetricsParseError("no vLLM or SGLang metrics in the answer")
    out = ModelServerMetrics(server=server)
    for field, total in sums.items():
        value = total / counts[field] if field in _NOT_SUMMED else total
        if field == "kv_capacity_tokens":
            out.kv_capacity_tokens = int(value)
        else:
            setattr(out, field, value)
    if capacity is not None:
        out.kv_capacity_tokens = capacity
    out.kv_usage = min(1.0, max(0.0, out.kv_usage))
    return out


def vllm_cache_config(text: str) -> tuple[int, int | None] | None:
    """(``block_size``, ``num_gpu_blocks``) of ``vllm:cache_config_info`` in a ``/metrics``
    body; None when the series or its ``block_size`` is missing (the router's precise
    prefix index: tokens per KV block, and blocks the server holds at most)."""
    for raw in text.splitlines():
        if not raw.startswith(_VLLM_CACHE_INFO + "{"):
            continue
        labels = raw[len(_VLLM_CACHE_INFO) + 1 : raw.rfind("}")]
        size, blocks = _label(labels, "block_size"), _label(labels, "num_gpu_blocks")
        if size and size.isdigit() and int(size) > 0:
            return int(size), int(blocks) if blocks and blocks.isdigit() else None
    return None
