"""What a model server's own ``/metrics`` says about its load and its KV cache.

Pure: text in, :class:`ModelServerMetrics` out. The sidecar's admission reads
its own model server through it, and the router reads every endpoint through
it, so vLLM's and SGLang's names are spelled here and nowhere else.

Only the few series routing and admission need are read; every other line is
skipped without being parsed. A series exported once per label set (one per
model or LoRA adapter) is summed. A value that is not finite is skipped; every
value, and every sum, is clamped into ``[0, MAX_VALUE]`` (an answer is not
trusted: no reading can make its reader's arithmetic overflow). Names, by server:

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

TensorRT-LLM, with the names of the Gateway API Inference Extension's
model-server protocol (``server`` is ``triton`` for Triton's TensorRT-LLM
backend, ``trtllm`` for ``trtllm-serve``):

* waiting: ``nv_trt_llm_request_metrics{request_type=waiting}``,
  ``trtllm_num_requests_waiting``;
* running: ``nv_trt_llm_request_metrics{request_type=scheduled}``,
  ``trtllm_num_requests_running``;
* kv_usage: ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}``,
  ``trtllm_kv_cache_utilization``;
* KV capacity: blocks (``kv_cache_block_type=max``, ``trtllm_kv_cache_max_blocks``)
  times tokens per block (``kv_cache_block_type=tokens_per``,
  ``trtllm_kv_cache_tokens_per_block``).

LoRA adapters (vLLM with ``--enable-lora``; the router's ``lora-affinity`` scorer), from
``vllm:lora_requests_info``: a gauge whose labels ``running_lora_adapters`` and
``waiting_lora_adapters`` list the adapters of the running and waiting requests
(comma-separated) and ``max_lora`` the adapters a batch holds at most. vLLM
sets a new label set to the current time whenever the lists change and never
removes the old ones, so the series with the greatest value is the current
one; as in the Gateway API Inference Extension's reading
(``pkg/epp/backend/metrics``, ``getLatestLoraMetric``), series whose lists are
both empty are skipped (an idle server still holds the adapters it last ran).
The base model's name is the ``model_name`` label of
``vllm:num_requests_waiting`` (a request naming it needs no adapter). These
fields stay ``None`` where the series are not exported, and nothing else
depends on them.
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
    #: which server family the names came from: ``vllm``, ``sglang``, ``triton``, ``trtllm``
    server: str = ""
    #: LoRA adapters of the running / waiting requests, and the most a batch holds
    #: (``vllm:lora_requests_info``; None: LoRA not enabled, or not vLLM)
    lora_running: frozenset[str] | None = None
    lora_waiting: frozenset[str] | None = None
    lora_max: int | None = None
    #: the base model's served name (vLLM's ``model_name`` label), when exported
    model_name: str | None = None


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
#: TensorRT-LLM (GIE's model-server protocol): trtllm-serve's series, as above
_SERIES.update(
    {
        "trtllm_num_requests_waiting": ("waiting", "trtllm"),
        "trtllm_num_requests_running": ("running", "trtllm"),
        "trtllm_kv_cache_utilization": ("kv_usage", "trtllm"),
        "trtllm_kv_cache_tokens_per_block": ("_block_tokens", "trtllm"),
        "trtllm_kv_cache_max_blocks": ("_blocks", "trtllm"),
    }
)
#: series name -> (label, label value -> (field, server)): one family, fields told apart by a label
_BY_LABEL: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "nv_trt_llm_request_metrics": (
        "request_type",
        {"waiting": ("waiting", "triton"), "scheduled": ("running", "triton")},
    ),
    "nv_trt_llm_kv_cache_block_metrics": (
        "kv_cache_block_type",
        {
            "fraction": ("kv_usage", "triton"),
            "tokens_per": ("_block_tokens", "triton"),
            "max": ("_blocks", "triton"),
        },
    ),
}
#: gauges that are ratios or capacities: averaged / taken once, not summed
_NOT_SUMMED = frozenset({"kv_usage", "prefix_hit_ratio", "kv_capacity_tokens", "_block_tokens"})
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_VLLM_LORA_INFO = "vllm:lora_requests_info"
_VLLM_WAITING = "vllm:num_requests_waiting"
#: adapters read per list at most (an answer is not trusted: memory stays bounded)
MAX_LORA_ADAPTERS = 1024
_PREFIXES = ("vllm:", "sglang:", "nv_trt_llm_", "trtllm_")
#: Largest number a field takes (2**53: every integer below it is exact as a float). A
#: model server's answer is not trusted: each value, and each field's sum over label
#: sets, is clamped into [0, MAX_VALUE], so no arithmetic on a reading can overflow.
MAX_VALUE = float(2**53)


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


def _small_int(text: str | None) -> int | None:
    """A label's non-negative integer of at most 15 ASCII digits (None: anything else)."""
    if text and len(text) <= 15 and text.isascii() and text.isdigit():
        return int(text)
    return None


def _adapters(listed: str) -> frozenset[str]:
    """The adapter names of a comma-separated label value (at most MAX_LORA_ADAPTERS)."""
    names = (n.strip() for n in listed.split(",", MAX_LORA_ADAPTERS))
    return frozenset(n for n in names if n and len(n) <= 256)


def _clamped(value: float) -> float:
    return min(MAX_VALUE, max(-MAX_VALUE, value))


def parse_metrics(text: str) -> ModelServerMetrics:
    """The fields of :class:`ModelServerMetrics` from a ``/metrics`` body.

    Raises :class:`MetricsParseError` when no series of a known server is present
    (a wrong port, a proxy's error page): an endpoint that says nothing about
    its load must not look idle.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    server = ""
    capacity: int | None = None
    #: (value, running, waiting, max_lora) of the current vllm:lora_requests_info series
    lora: tuple[float, str, str, int | None] | None = None
    model_name: str | None = None
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
        value = _clamped(value)
        if name == _VLLM_CACHE_INFO:
            blocks = _small_int(_label(labels, "num_gpu_blocks"))
            size = _small_int(_label(labels, "block_size"))
            if blocks is not None and size is not None:
                capacity = min(int(MAX_VALUE), blocks * size)
                server = server or "vllm"
            continue
        if name == _VLLM_LORA_INFO:
            running = _label(labels, "running_lora_adapters") or ""
            waiting = _label(labels, "waiting_lora_adapters") or ""
            series = (value, running, waiting, _small_int(_label(labels, "max_lora")))
            # the newest series that names an adapter; an empty one only when there is none
            newer = lora is None or (bool(running or waiting), value) > (
                bool(lora[1] or lora[2]),
                lora[0],
            )
            if newer:
                lora = series
            continue
        if name == _VLLM_WAITING and model_name is None:
            named = _label(labels, "model_name")
            model_name = named if named and len(named) <= 256 else None
        known = _SERIES.get(name)
        if known is None and name in _BY_LABEL:
            label, fields = _BY_LABEL[name]
            known = fields.get(_label(labels, label) or "")
        if known is None:
            continue
        field, family = known
        server = server or family
        sums[field] = sums.get(field, 0.0) + value
        counts[field] = counts.get(field, 0) + 1
    if not server:
        raise MetricsParseError("no vLLM or SGLang metrics in the answer (nor TensorRT-LLM's)")
    out = ModelServerMetrics(server=server)
    # TensorRT-LLM gives its KV capacity as blocks and tokens per block (two series)
    trt_blocks, block_tokens = sums.pop("_blocks", None), sums.pop("_block_tokens", None)
    if trt_blocks is not None and block_tokens is not None and capacity is None:
        tokens = trt_blocks * (block_tokens / counts["_block_tokens"])
        if 0 < tokens < MAX_VALUE:  # beyond it (or inf, NaN): no capacity at all
            capacity = int(tokens)
    for field, total in sums.items():
        value = total / counts[field] if field in _NOT_SUMMED else total
        value = min(MAX_VALUE, max(0.0, value))  # a sum of many clamped values, or negative
        if field == "kv_capacity_tokens":
            out.kv_capacity_tokens = int(value)
        else:
            setattr(out, field, value)
    if capacity is not None:
        out.kv_capacity_tokens = capacity
    if lora is not None:
        out.lora_running, out.lora_waiting = _adapters(lora[1]), _adapters(lora[2])
        out.lora_max = lora[3]
    out.model_name = model_name
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
