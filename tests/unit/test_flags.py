"""The one flag mechanism (cachefleet_common.flags): flag > environment > default, all parsed."""

from __future__ import annotations

import pytest

from cachefleet_common.flags import Flags, env_name, switch


def _flags(environ: dict[str, str]) -> Flags:
    flags = Flags("prog", "what it does", environ=environ)
    flags.add("max-items", "how many", default=3, parse=int, group="Limits")
    flags.add("verbose", "talk more", is_switch=True)
    flags.add("name", "a name")
    return flags


def test_env_name_is_the_prefix_and_the_flag_in_upper_case() -> None:
    assert env_name("--l1-bytes") == "CACHEFLEET_L1_BYTES"
    assert env_name("kv-events", prefix="X_") == "X_KV_EVENTS"


def test_the_flag_wins_over_the_environment_which_wins_over_the_default() -> None:
    assert _flags({}).parse([]).max_items == 3
    assert _flags({"CACHEFLEET_MAX_ITEMS": "7"}).parse([]).max_items == 7
    assert _flags({"CACHEFLEET_MAX_ITEMS": "7"}).parse(["--max-items", "9"]).max_items == 9


def test_switches_read_true_and_false_words_from_the_environment() -> None:
    assert _flags({}).parse([]).verbose is False
    assert _flags({}).parse(["--verbose"]).verbose is True
    assert _flags({"CACHEFLEET_VERBOSE": "yes"}).parse([]).verbose is True
    assert _flags({"CACHEFLEET_VERBOSE": "off"}).parse([]).verbose is False
    with pytest.raises(ValueError, match="true or false"):
        switch("maybe")


def test_a_flag_without_a_default_is_none() -> None:
    assert _flags({}).parse([]).name is None


@pytest.mark.parametrize(
    ("argv", "environ", "said"),
    [
        (["--max-items", "x"], {}, "--max-items: invalid literal"),
        ([], {"CACHEFLEET_MAX_ITEMS": "x"}, "CACHEFLEET_MAX_ITEMS (for --max-items)"),
        ([], {"CACHEFLEET_VERBOSE": "maybe"}, "CACHEFLEET_VERBOSE (for --verbose)"),
    ],
)
def test_a_bad_value_exits_2_naming_where_it_came_from(
    argv: list[str], environ: dict[str, str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _flags(environ).parse(argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_help_shows_each_flags_environment_name_and_default_in_its_group() -> None:
    flags = _flags({})
    text = flags.parser.format_help()
    assert "[env CACHEFLEET_MAX_ITEMS]" in text
    assert "Limits:" in text
    assert flags.parser._option_string_actions["--max-items"].default == "3"


def test_a_short_form_a_repeated_flag_and_its_comma_separated_environment_form() -> None:
    def flags(environ: dict[str, str]) -> Flags:
        out = Flags("prog", "what it does", environ=environ)
        out.add("namespace", "where", short="-n", repeat=True)
        return out

    assert flags({}).parse([]).namespace is None
    assert flags({}).parse(["-n", "a", "--namespace", "b"]).namespace == ["a", "b"]
    assert flags({"CACHEFLEET_NAMESPACE": "a, b"}).parse([]).namespace == ["a", "b"]
    assert flags({"CACHEFLEET_NAMESPACE": "a"}).parse(["-n", "c"]).namespace == ["c"]


def test_a_required_flag_may_come_from_the_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = Flags("prog", "what it does", environ={"CACHEFLEET_SCOPE": "cache"})
    flags.add("scope", "what", required=True)
    assert flags.parse([]).scope == "cache"
    bare = Flags("prog", "what it does", environ={})
    bare.add("scope", "what", required=True)
    with pytest.raises(SystemExit) as exc:
        bare.parse([])
    assert exc.value.code == 2
    assert "required: --scope" in capsys.readouterr().err


def _with_commands(environ: dict[str, str]) -> Flags:
    flags = Flags("prog", "what it does", environ=environ)
    flags.add("context", "shared by every command", env=False)
    for name in ("get", "put"):
        sub = flags.command(name, help=f"{name} a thing")
        sub.add("context", "shared by every command", env=False)
        sub.add("timeout", "how long", default="5", parse=int)
    return flags


def test_a_subcommands_flags_read_the_environment_before_their_defaults() -> None:
    assert vars(_with_commands({}).parse(["get"])) == {
        "context": None,
        "timeout": 5,
        "command": "get",
    }
    assert _with_commands({"CACHEFLEET_TIMEOUT": "7"}).parse(["put"]).timeout == 7
    assert _with_commands({"CACHEFLEET_TIMEOUT": "7"}).parse(["put", "--timeout", "9"]).timeout == 9
    assert _with_commands({}).parse([]).command is None


def test_a_flag_of_the_program_and_its_subcommands_goes_before_or_after_the_command() -> None:
    flags = _with_commands({})
    assert flags.parse(["--context", "a", "get"]).context == "a"
    assert flags.parse(["get", "--context", "b"]).context == "b"
    assert "--context" in flags.parser.format_help()


def test_flags_of_one_exclusive_set_are_refused_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = Flags("prog", "what it does", environ={})
    flags.add("fail-open", "open", is_switch=True, exclusive="mode")
    flags.add("fail-closed", "closed", is_switch=True, env=False, exclusive="mode")
    assert flags.parse(["--fail-closed"]).fail_closed is True
    with pytest.raises(SystemExit) as exc:
        flags.parse(["--fail-open", "--fail-closed"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_shared_value_parsers_say_what_they_expected() -> None:
    from cachefleet_common.values import byte_size, cache_ref, otlp_url

    assert byte_size("256Mi") == byte_size("256M") == byte_size("268435456") == 256 << 20
    assert byte_size("4KiB") == 4096
    with pytest.raises(ValueError, match="byte count"):
        byte_size("lots")
    assert cache_ref("prod/chat") == "prod/chat"
    for bad in ("prod", "prod/", "/chat", "prod/chat/x", "Prod!/chat"):
        with pytest.raises(ValueError, match="NAMESPACE/NAME"):
            cache_ref(bad)
    assert otlp_url(" http://collector:4318 ") == "http://collector:4318"
    assert otlp_url("") == ""
    with pytest.raises(ValueError, match="http://"):
        otlp_url("collector:4318")
