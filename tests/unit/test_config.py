"""The sidecar's configuration: each room's record, the flat names, and the command line."""

from __future__ import annotations

import os

import pytest

from cachefleet_common.contract.names import Policy
from cachefleet_sidecar import config as sidecar_config
from cachefleet_sidecar.config import SidecarConfig, parse_args


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CACHEFLEET_* or POD_NAME from the machine running the tests."""
    for name in list(os.environ):
        if name.startswith("CACHEFLEET_") or name == "POD_NAME":
            monkeypatch.delenv(name)


def test_the_flags_defaults_are_the_records_defaults() -> None:
    parsed = parse_args([])
    assert parsed == SidecarConfig(pod=parsed.pod)


def test_flat_names_go_to_the_record_that_owns_them() -> None:
    config = SidecarConfig.from_flat(
        cache="ns/c",
        admin_listen=None,
        l1_bytes=1024,
        policy=Policy.LIRS,
        semantic_shadow=True,
        max_url_bytes=2048,
        upstream="http://m:8000",
        default_tenant="dflt",
        mrc_samples=0,
        otlp_endpoint="http://c:4318",
        warm_bytes=10,
    )
    assert (config.cache, config.admin_listen) == ("ns/c", None)
    assert (config.caching.l1_bytes, config.caching.policy) == (1024, Policy.LIRS)
    assert config.semantic.shadow is True
    assert config.http.limits.max_url_bytes == 2048
    assert config.http.limits.max_body_bytes == SidecarConfig().http.limits.max_body_bytes
    assert config.http.upstream == "http://m:8000"
    assert config.tenancy.default_tenant == "dflt"
    assert config.adapt.mrc_samples == 0
    assert config.observe.otlp_endpoint == "http://c:4318"
    assert config.control.warm_bytes == 10


def test_an_unknown_flat_name_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="no setting 'l1_size'"):
        SidecarConfig.from_flat(l1_size=1)


def test_no_two_records_share_a_flat_name() -> None:
    names = [*sidecar_config._TOP, *sidecar_config._LIMITS, *sidecar_config._OWNER]
    assert len(names) == len(set(names))


def test_the_pod_falls_back_to_pod_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "web-0")
    assert parse_args([]).pod == "web-0"
    assert parse_args(["--pod", "web-1"]).pod == "web-1"
    monkeypatch.setenv("CACHEFLEET_POD", "web-2")
    assert parse_args([]).pod == "web-2"


def test_a_bad_environment_value_exits_2_naming_it_and_its_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CACHEFLEET_L1_BYTES", "lots")
    with pytest.raises(SystemExit) as exc:
        parse_args([])
    assert exc.value.code == 2
    assert "CACHEFLEET_L1_BYTES (for --l1-bytes)" in capsys.readouterr().err


def test_switches_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEFLEET_ADMISSION", "true")
    monkeypatch.setenv("CACHEFLEET_COLLAPSE_WHITESPACE", "1")
    config = parse_args([])
    assert config.adapt.admission is not None
    assert config.caching.collapse_whitespace is True
    assert parse_args(["--admin-listen", "off"]).admin_listen is None
