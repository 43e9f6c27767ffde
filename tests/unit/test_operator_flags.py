"""``cachefleet operator``'s flags: each also ``CACHEFLEET_<FLAG>``, one scope of namespaces."""

from __future__ import annotations

import pytest

from cachefleet_operator.login import DEFAULT_SERVICE_ACCOUNT_DIR
from cachefleet_operator.run import DEFAULT_METRICS_PORT, parse_args


def test_the_defaults_and_the_flags() -> None:
    args = parse_args(["-n", "a", "--namespace", "b", "-v"], {})
    assert args.namespace == ["a", "b"]
    assert args.all_namespaces is False
    assert args.verbose is True
    assert args.metrics_port == DEFAULT_METRICS_PORT
    assert args.service_account_dir == DEFAULT_SERVICE_ACCOUNT_DIR
    assert args.webhook_port is None
    assert args.webhook_service_namespace is None


def test_every_flag_has_an_environment_form() -> None:
    env = {
        "CACHEFLEET_NAMESPACE": "a,b",
        "CACHEFLEET_METRICS_PORT": "9999",
        "CACHEFLEET_WEBHOOK_PORT": "8443",
        "CACHEFLEET_PEERING": "cachefleet",
        "POD_NAMESPACE": "system",
    }
    args = parse_args([], env)
    assert args.namespace == ["a", "b"]
    assert (args.metrics_port, args.webhook_port, args.peering) == (9999, 8443, "cachefleet")
    assert args.webhook_service_namespace == "system"
    assert parse_args(["--metrics-port", "1234"], env).metrics_port == 1234
    assert parse_args([], {"CACHEFLEET_ALL_NAMESPACES": "true"}).all_namespaces is True


@pytest.mark.parametrize(
    ("argv", "environ", "said"),
    [
        ([], {}, "one of the arguments --namespace/-n --all-namespaces/-A is required"),
        (["-n", "a", "-A"], {}, "--all-namespaces/-A: not allowed with argument --namespace/-n"),
        (["-A"], {"CACHEFLEET_NAMESPACE": "a"}, "not allowed with argument --namespace/-n"),
        (["-A", "--metrics-port", "x"], {}, "--metrics-port: invalid literal"),
        (["-A"], {"CACHEFLEET_WEBHOOK_PORT": "x"}, "CACHEFLEET_WEBHOOK_PORT (for --webhook-port)"),
    ],
)
def test_a_bad_flag_exits_2_naming_it(
    argv: list[str], environ: dict[str, str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, environ)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err
