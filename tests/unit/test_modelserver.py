"""The model-server metrics reader: vLLM and SGLang names, sums, and what is refused."""

from __future__ import annotations

import math

import pytest

from cachefleet_common.modelserver import MAX_VALUE, MetricsParseError, parse_metrics

VLLM = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="lora-a"} 2.0
vllm:num_requests_running{model_name="m"} 7.0
vllm:kv_cache_usage_perc{model_name="m"} 0.5
vllm:kv_cache_usage_perc{model_name="lora-a"} 0.7
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
vllm:prefix_cache_hits_total{model_name="m"} 250.0
vllm:prompt_tokens_total{model_name="m"} 5e3
vllm:request_prefill_time_seconds_sum{model_name="m"} 1.25
vllm:request_prefill_time_seconds_bucket{le="0.1",model_name="m"} 4.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0
vllm:e2e_request_latency_seconds_count{model_name="m"} NaN
"""

SGLANG = """\
sglang:num_queue_reqs{model_name="m"} 4
sglang:num_running_reqs{model_name="m"} 9
sglang:token_usage{model_name="m"} 0.28
sglang:cache_hit_rate{model_name="m"} 0.4
sglang:prompt_tokens_total{model_name="m"} 8.1e6
sglang:max_total_num_tokens{model_name="m"} 161721.0
"""


def test_vllm_series_are_read_and_summed_over_label_sets() -> None:
    m = parse_metrics(VLLM)
    assert m.server == "vllm"
    assert m.waiting == 5.0
    assert m.running == 7.0
    assert m.kv_usage == pytest.approx(0.6)  # a ratio is averaged, not summed
    assert (m.prefix_queries_total, m.prefix_hits_total) == (1000.0, 250.0)
    assert m.prompt_tokens_total == 5000.0
    assert m.prefill_seconds_total == 1.25  # the histogram's _sum, not its buckets
    assert m.kv_capacity_tokens == 2048 * 16
    assert m.prefix_hit_ratio is None


def test_sglang_names_map_to_the_same_fields() -> None:
    m = parse_metrics(SGLANG)
    assert m.server == "sglang"
    assert (m.waiting, m.running) == (4.0, 9.0)
    assert m.kv_usage == pytest.approx(0.28)
    assert m.prefix_hit_ratio == pytest.approx(0.4)
    assert m.kv_capacity_tokens == 161721
    assert m.prefix_queries_total is None


def test_pre_v1_vllm_kv_gauge_is_read() -> None:
    assert parse_metrics("vllm:gpu_cache_usage_perc 0.9\n").kv_usage == pytest.approx(0.9)


def test_garbage_lines_are_skipped_and_usage_is_clamped() -> None:
    text = (
        "vllm:num_requests_waiting{x} oops\n"
        "vllm:kv_cache_usage_perc 1.7\n"
        "vllm:num_requests_running\n"
    )
    m = parse_metrics(text)
    assert m.waiting == 0.0
    assert m.kv_usage == 1.0


@pytest.mark.parametrize(
    "text",
    ["", "<html>502 Bad Gateway</html>", "cachefleet_requests_total 3\nprocess_cpu_seconds 1\n"],
)
def test_an_answer_without_model_server_series_is_refused(text: str) -> None:
    with pytest.raises(MetricsParseError, match="no vLLM or SGLang metrics"):
        parse_metrics(text)


def test_every_number_is_finite_and_clamped_whatever_the_server_says() -> None:
    """Issue 34 (2): two ``1e308`` lines sum to infinity; negatives, infinities, NaN and
    huge labels are an answer's too. Each field comes out finite, within [0, MAX_VALUE]."""
    text = (
        'vllm:num_requests_waiting{model_name="a"} 1e308\n'
        'vllm:num_requests_waiting{model_name="b"} 1e308\n'
        "vllm:num_requests_running -5\n"
        "vllm:kv_cache_usage_perc -inf\n"
        "vllm:prompt_tokens_total +Inf\n"
        "vllm:request_prefill_time_seconds_sum 1e308\n"
        "vllm:request_prefill_time_seconds_count 1e-300\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="' + "9" * 5000 + '"} 1\n'
        'vllm:cache_config_info{block_size="\u00b2",num_gpu_blocks="4"} 1\n'
    )
    m = parse_metrics(text)
    assert m.waiting == MAX_VALUE
    assert m.running == 0.0
    assert m.kv_usage == 0.0
    assert m.prompt_tokens_total is None  # an infinite value is not read
    assert m.prefill_seconds_total == MAX_VALUE
    assert m.kv_capacity_tokens is None  # neither label pair is a number we take
    for value in (m.waiting, m.running, m.prefill_seconds_total, m.prefill_requests_total):
        assert value is not None
        assert math.isfinite(value)
        assert 0 <= value <= MAX_VALUE
    # many large lines of one series: the sum stops at the bound, never overflows
    many = "".join(f'vllm:num_requests_running{{m="{i}"}} 1e300\n' for i in range(2000))
    assert parse_metrics(many).running == MAX_VALUE
