"""``cachefleet router`` flags of precise routing: --profile, --kv-events(-listen), --tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachefleet_router.cli import parse_args
from cachefleet_router.profiles import GIE_LIKE
from cachefleet_router.schedule import ProfilePicker
from cachefleet_router.scoring import ScoringPicker
from cachefleet_router.server import RouterServer

TINY = Path(__file__).parents[1] / "data" / "vllm" / "tiny"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "fastest"], "--profile: expected one of default, least-loaded"),
        (["--kv-events", "on"], "--kv-events: expected off or auto"),
        (["--kv-events-listen", "127.0.0.1:5557"], "--kv-events-listen: expected tcp://"),
        (["--kv-events-listen", "tcp://h:x"], "--kv-events-listen: port must be"),
        (["--tokenizer", "hf"], "--tokenizer: expected auto, approx or local:PATH"),
        (["--tokenizer", "local:/nonexistent"], "--tokenizer: no tokenizer.json in"),
    ],
)
def test_bad_precise_flags_exit_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--endpoints", "a:1", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config, _ = parse_args(["--endpoints", "a:1"])
    assert (config.profile, config.kv_events, config.kv_events_listen, config.tokenizer) == (
        "default",
        "auto",
        None,
        "auto",
    )
    monkeypatch.setenv("CACHEFLEET_PROFILE", "gie-like")
    monkeypatch.setenv("CACHEFLEET_KV_EVENTS", "off")
    monkeypatch.setenv("CACHEFLEET_KV_EVENTS_LISTEN", "tcp://0.0.0.0:5557")
    monkeypatch.setenv("CACHEFLEET_TOKENIZER", f"local:{TINY}")
    config, _ = parse_args(["--endpoints", "a:1"])
    assert (config.profile, config.kv_events, config.kv_events_listen, config.tokenizer) == (
        "gie-like",
        "off",
        "tcp://0.0.0.0:5557",
        f"local:{TINY}",
    )
    config, _ = parse_args(["--endpoints", "a:1", "--tokenizer", "approx"])  # a flag wins
    assert config.tokenizer == "approx"


def test_the_router_runs_the_profile_it_is_given() -> None:
    config, _ = parse_args(["--endpoints", "a:1", "--profile", "gie-like", "--kv-events", "off"])
    router = RouterServer(config)
    picker = router.service.picker
    assert isinstance(picker, ProfilePicker)
    assert picker.profile is GIE_LIKE
    assert router.kv_index is None
    assert router.tokenization is None  # its scorers read no token ids
    config, _ = parse_args(["--endpoints", "a:1", "--tokenizer", "approx"])
    router = RouterServer(config)
    assert isinstance(router.service.picker, ScoringPicker)  # default, with the KV index
    assert router.kv_index is not None
    assert router.tokenization is None
