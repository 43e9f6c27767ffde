"""One flag mechanism for every program: argparse flags, each also ``CACHEFLEET_<FLAG>``.

The sidecar, the router, the operator and the kubectl plugin declare their
flags with :class:`Flags`: a flag has a name, a help text, a default and a
parser (a function from the text to the value that raises ``ValueError`` or
``argparse.ArgumentTypeError`` with a reason). The value is, in this order,
the flag given on the command line, the environment variable
(``CACHEFLEET_`` + the flag in upper case, ``-`` as ``_``), the default.
Every value, the default's text included, goes through the flag's parser, so
a default and an environment value are checked exactly as a flag is; a bad
one ends the process with exit status 2 and a message that names the flag and
where the value came from.

Why not pydantic-settings: the programs' settings are frozen records that
each room owns (plain dataclasses, no pydantic on the request path), the
reference pages are generated from argparse parsers, and ``--help`` must
show the environment names. This helper is the 100 lines between argparse
and those records; a new dependency would add a second schema beside them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

ENV_PREFIX = "CACHEFLEET_"
_MISSING: Any = object()
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def env_name(flag: str, prefix: str = ENV_PREFIX) -> str:
    """``--l1-bytes`` -> ``CACHEFLEET_L1_BYTES``."""
    return prefix + flag.lstrip("-").upper().replace("-", "_")


def switch(value: str) -> bool:
    """A boolean's text: 1/true/yes/on or 0/false/no/off (any case)."""
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"expected true or false, got {value!r}")


@dataclass(frozen=True)
class _Flag:
    name: str
    parse: Callable[[str], Any]
    default: str | None
    env: str | None
    is_switch: bool


class Flags:
    """An ``ArgumentParser`` whose flags also read the environment and parse every value.

    ``add`` declares a flag (in a titled group when ``group`` names one);
    ``parse`` returns a namespace of parsed values (attribute: the flag with
    ``-`` as ``_``). The parser itself is :attr:`parser` (``--help``, the
    generated reference).
    """

    def __init__(
        self,
        prog: str,
        description: str,
        *,
        environ: Mapping[str, str] | None = None,
        env_prefix: str = ENV_PREFIX,
        **parser_kw: Any,
    ) -> None:
        self.parser = argparse.ArgumentParser(prog=prog, description=description, **parser_kw)
        self.environ = os.environ if environ is None else environ
        self.env_prefix = env_prefix
        self._flags: list[_Flag] = []
        self._groups: dict[str, argparse._ArgumentGroup] = {}

    def group(self, title: str) -> argparse._ArgumentGroup:
        if title not in self._groups:
            self._groups[title] = self.parser.add_argument_group(title)
        return self._groups[title]

    def add(
        self,
        flag: str,
        help_text: str,
        *,
        default: object = None,
        parse: Callable[[str], Any] = str,
        group: str | None = None,
        env: bool = True,
        is_switch: bool = False,
        metavar: str | None = None,
        choices: tuple[str, ...] | None = None,
    ) -> None:
        """Declare ``--flag``; ``default`` is text (or None: no value) parsed like the flag."""
        name = flag.lstrip("-")
        env_var = env_name(name, self.env_prefix) if env else None
        suffix = f" [env {env_var}]" if env_var else ""
        target = self.group(group) if group else self.parser
        kw: dict[str, Any] = {"help": (help_text + suffix).replace("%", "%%"), "dest": _dest(name)}
        if is_switch:
            kw["action"] = "store_const"
            kw["const"] = "true"
            kw["default"] = None
            parse = switch
        else:
            kw["default"] = None
            kw["metavar"] = metavar or name.upper().replace("-", "_")
        if choices:
            kw["choices"] = choices
        target.add_argument(f"--{name}", **kw)
        text = None if default is None else _text(default)
        if text is not None:  # shown by --help and read by the generated reference
            self.parser._option_string_actions[f"--{name}"].default = text
        self._flags.append(_Flag(name, parse, text, env_var, is_switch))

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        """Flags, then the environment, then the defaults; exit 2 naming a bad value's source."""
        # argparse fills in a default only where the namespace has no value yet: a
        # sentinel tells "not given" from "given", and the parser keeps its defaults
        # for --help and the generated reference.
        given = argparse.Namespace(**{_dest(f.name): _MISSING for f in self._flags})
        ns = self.parser.parse_args(argv, namespace=given)
        out = argparse.Namespace()
        for flag in self._flags:
            dest = _dest(flag.name)
            raw, source = getattr(ns, dest), f"--{flag.name}"
            if raw is _MISSING:
                raw = None
            if raw is None and flag.env and flag.env in self.environ:
                raw, source = self.environ[flag.env], f"{flag.env} (for --{flag.name})"
            if raw is None:
                raw, source = flag.default, f"--{flag.name}'s default"
            if raw is None:
                setattr(out, dest, False if flag.is_switch else None)
                continue
            try:
                setattr(out, dest, flag.parse(raw))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                self.error(f"{source}: {exc}")
        for key, value in vars(ns).items():  # anything declared with the parser directly
            if not hasattr(out, key):
                setattr(out, key, value)
        return out

    def error(self, message: str) -> NoReturn:
        self.parser.error(message)


def _dest(name: str) -> str:
    return name.replace("-", "_")


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
