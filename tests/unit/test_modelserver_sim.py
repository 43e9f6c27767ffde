"""The model-server simulator: prefix-cache accounting, deterministic answers, vLLM metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest

from cachefleet_common.modelserver import parse_metrics
from cachefleet_e2e.modelserver_sim import ModelServerSim, block_hashes, main

SYSTEM = "You are a careful assistant. " * 20  # 580 characters: 9 blocks of 64


@pytest.fixture
def sim() -> Iterator[ModelServerSim]:
    with ModelServerSim(kv_blocks=64, prefill_rate=1e6, model="sim-1") as s:
        yield s


def chat(client: httpx.Client, content: str, **extra: object) -> httpx.Response:
    body = {"model": "sim-1", "messages": [{"role": "user", "content": content}], **extra}
    return client.post("/v1/chat/completions", json=body)


def test_block_hashes_are_chained_so_only_a_shared_prefix_matches() -> None:
    a = block_hashes("x" * 64 + "y" * 64, 64)
    b = block_hashes("z" * 64 + "y" * 64, 64)
    assert len(a) == 2
    assert a[1] != b[1]
    assert block_hashes("x" * 64 + "y" * 63, 64) == a[:1]  # a partial block is not cached


def test_shared_prefix_is_a_prefix_cache_hit_and_metrics_parse(sim: ModelServerSim) -> None:
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        first = chat(client, SYSTEM + "question one")
        second = chat(client, SYSTEM + "question two")
        assert first.status_code == second.status_code == 200
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 9 * 16
        text = client.get("/metrics").text
    m = parse_metrics(text)
    assert m.server == "vllm"
    assert (m.waiting, m.running) == (0.0, 0.0)
    assert m.kv_capacity_tokens == 64 * 16
    assert m.prefix_hits_total == 9 * 16
    assert m.prefix_queries_total == m.prompt_tokens_total
    assert m.prompt_tokens_total == sum(r.json()["usage"]["prompt_tokens"] for r in (first, second))
    assert m.prefill_requests_total == 2
    assert m.prefill_seconds_total is not None
    assert m.prefill_seconds_total > 0
    assert 'vllm:time_to_first_token_seconds_count{model_name="sim-1"} 2' in text


def test_answers_are_deterministic_and_differ_by_prompt(sim: ModelServerSim) -> None:
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        a1 = chat(client, "same", max_tokens=5).json()
        a2 = chat(client, "same", max_tokens=5).json()
        b = chat(client, "other", max_tokens=5).json()
        done = client.post("/v1/completions", json={"model": "sim-1", "prompt": "same"})
    text = a1["choices"][0]["message"]["content"]
    assert text == a2["choices"][0]["message"]["content"] != b["choices"][0]["message"]["content"]
    assert len(text.split()) == 5
    assert a1["id"] == a2["id"]
    assert done.json()["choices"][0]["text"]


def test_streaming_answers_the_same_words_as_sse(sim: ModelServerSim) -> None:
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        whole = chat(client, "stream me", max_tokens=4).json()["choices"][0]["message"]["content"]
        resp = chat(client, "stream me", max_tokens=4, stream=True)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert "".join(pieces) == whole


def test_held_prefill_queues_requests_in_the_waiting_gauge(sim: ModelServerSim) -> None:
    sim.hold()
    results: list[int] = []

    def send(i: int) -> None:
        with httpx.Client(base_url=sim.url, timeout=10) as client:
            results.append(chat(client, f"queued {i}").status_code)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert sim.wait_queued(3)
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        assert parse_metrics(client.get("/metrics").text).waiting == 3.0
        client.post("/_control", json={"hold": False})
    for t in threads:
        t.join(10)
    assert results == [200, 200, 200]


def test_lru_capacity_bounds_the_prefix_cache(sim: ModelServerSim) -> None:
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        for i in range(10):  # 10 distinct prompts of 9 blocks: more than 64 blocks
            chat(client, f"{i:03d}" + SYSTEM)
        again = chat(client, "000" + SYSTEM).json()  # its blocks were evicted first
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert sim.snapshot()["kv_blocks_cached"] <= 64


def test_bad_requests_get_400_naming_the_field(sim: ModelServerSim) -> None:
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        no_messages = client.post("/v1/chat/completions", json={"model": "m"})
        bad_tokens = chat(client, "x", max_tokens=0)
        not_json = client.post("/v1/completions", content=b"{")
    assert no_messages.status_code == 400
    assert "messages" in no_messages.text
    assert bad_tokens.status_code == 400
    assert "max_tokens" in bad_tokens.text
    assert not_json.status_code == 400


def test_cli_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--kv-blocks", "0"])
    assert "--kv-blocks" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prefill_rate"):
        ModelServerSim(prefill_rate=0)


def test_runs_as_a_module_for_the_demo() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachefleet_e2e.modelserver_sim",
            *("--listen", "127.0.0.1:0", "--kv-blocks", "32", "--prefill-rate", "1e6"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.rsplit(" ", 1)[-1].strip()
        assert url.startswith("http://127.0.0.1:")
        with httpx.Client(base_url=url, timeout=10) as client:
            assert chat(client, "hello").status_code == 200
            m = parse_metrics(client.get("/metrics").text)
        assert m.kv_capacity_tokens == 32 * 16
        assert m.prefill_requests_total == 1
        proc.terminate()  # SIGTERM: a clean stop, exit status 0
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
