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

A flag may have a short form (``-n``), be repeated (``repeat``: a list; its
environment form is comma-separated) or be required (by any of the three
sources). Subcommands (:meth:`Flags.command`) have flags of their own; a flag
the program and a subcommand both declare (kubectl's ``--namespace``) may be
given before or after the subcommand's name.

Why not pydantic-settings: the programs' settings are frozen records that
each room owns (plain dataclasses, no pydantic on the request path), the
reference pages are generated from argparse parsers, and ``--help`` must
show the environment names. This helper is the few hundred lines between
argparse and those records; a new dependency would add a second schema beside
them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

ENV_PREFIX = "CACHEFLEET_"
_MISSING: Any = object()
#: The namespace attribute that names the subcommand given.
COMMAND = "command"
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
    repeat: bool = False
    required: bool = False


class _Parser(argparse.ArgumentParser):
    """Marks its flags "not given" (a sentinel) before it parses, also as a subcommand's
    parser: argparse hands that one a fresh namespace, where the defaults' text (kept on
    the actions for ``--help`` and the reference) would read as given."""

    flag_dests: tuple[str, ...] = ()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        namespace = argparse.Namespace() if namespace is None else namespace
        for dest in self.flag_dests:
            if not hasattr(namespace, dest):
                setattr(namespace, dest, _MISSING)
        return super().parse_known_args(args, namespace)


class Flags:
    """An ``ArgumentParser`` whose flags also read the environment and parse every value.

    ``add`` declares a flag (in a titled group when ``group`` names one);
    ``parse`` returns a namespace of parsed values (attribute: the flag with
    ``-`` as ``_``). The parser itself is :attr:`parser` (``--help``, the
    generated reference). ``env_prefix=None``: no flag of the program (or of its
    subcommands) has an environment form.
    """

    def __init__(
        self,
        prog: str,
        description: str,
        *,
        environ: Mapping[str, str] | None = None,
        env_prefix: str | None = ENV_PREFIX,
        **parser_kw: Any,
    ) -> None:
        parser = _Parser(prog=prog, description=description, **parser_kw)
        self._setup(parser, os.environ if environ is None else environ, env_prefix, None)

    def _setup(
        self,
        parser: argparse.ArgumentParser,
        environ: Mapping[str, str],
        env_prefix: str | None,
        parent: Flags | None,
    ) -> None:
        self.parser = parser
        self.environ = environ
        self.env_prefix = env_prefix
        self._parent = parent
        self._flags: list[_Flag] = []
        self._groups: dict[str, argparse._ArgumentGroup] = {}
        self._exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
        self._subparsers: argparse._SubParsersAction[Any] | None = None
        self._commands: dict[str, Flags] = {}

    def command(self, name: str, **parser_kw: Any) -> Flags:
        """Subcommand ``name`` (its name in the namespace's ``command``), with flags of its
        own declared on the Flags returned; ``parser_kw`` go to ``add_parser``."""
        if self._subparsers is None:
            self._subparsers = self.parser.add_subparsers(dest=COMMAND, metavar="COMMAND")
        sub = Flags.__new__(Flags)
        sub._setup(
            self._subparsers.add_parser(name, **parser_kw), self.environ, self.env_prefix, self
        )
        self._commands[name] = sub
        return sub

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
        short: str | None = None,
        repeat: bool = False,
        required: bool = False,
        exclusive: str | None = None,
    ) -> None:
        """Declare ``--flag``; ``default`` is text (or None: no value) parsed like the flag.

        Flags that name the same ``exclusive`` set may not be given together on the
        command line (argparse refuses the pair, exit 2).
        """
        name = flag.lstrip("-")
        env_var = env_name(name, self.env_prefix) if env and self.env_prefix else None
        suffix = f" [env {env_var}]" if env_var else ""
        target: Any = self.group(group) if group else self.parser
        if exclusive is not None:
            if exclusive not in self._exclusive:
                self._exclusive[exclusive] = target.add_mutually_exclusive_group()
            target = self._exclusive[exclusive]
        kw: dict[str, Any] = {"help": (help_text + suffix).replace("%", "%%"), "dest": _dest(name)}
        if is_switch:
            kw["action"] = "store_const"
            kw["const"] = "true"
            parse = switch
        elif metavar or not choices:  # (with choices and no metavar, argparse lists them)
            kw["metavar"] = metavar or name.upper().replace("-", "_")
        if repeat:
            kw["action"] = "append"
        # the program declares it too: given before or after the subcommand, it is the
        # program's flag (not given here, it leaves the program's value alone)
        shared = self._parent is not None and any(f.name == name for f in self._parent._flags)
        kw["default"] = argparse.SUPPRESS if shared else None
        if choices:
            kw["choices"] = choices
        target.add_argument(*([short] if short else []), f"--{name}", **kw)
        if shared:
            return
        text = None if default is None else _text(default)
        if text is not None:  # shown by --help and read by the generated reference
            self.parser._option_string_actions[f"--{name}"].default = text
        self._flags.append(_Flag(name, parse, text, env_var, is_switch, repeat, required))
        if not repeat:  # (argparse appends to what is there: a repeated flag starts as None)
            assert isinstance(self.parser, _Parser)
            self.parser.flag_dests += (_dest(name),)

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        """Flags, then the environment, then the defaults; exit 2 naming a bad value's source."""
        # the parser marks what was not given (:class:`_Parser`) and keeps its defaults
        # for --help and the generated reference
        ns = self.parser.parse_args(argv)
        out = argparse.Namespace()
        self._resolve(ns, out)
        command = self._commands.get(getattr(ns, COMMAND, None) or "")
        if command is not None:
            command._resolve(ns, out)
        for key, value in vars(ns).items():  # anything declared with the parser directly
            if not hasattr(out, key):
                setattr(out, key, value)
        return out

    def _resolve(self, ns: argparse.Namespace, out: argparse.Namespace) -> None:
        for flag in self._flags:
            dest = _dest(flag.name)
            raw: Any = getattr(ns, dest, None)
            source = f"--{flag.name}"
            if raw is _MISSING:
                raw = None
            if raw is None and flag.env and flag.env in self.environ:
                raw, source = self.environ[flag.env], f"{flag.env} (for --{flag.name})"
            if raw is None:
                raw, source = flag.default, f"--{flag.name}'s default"
            if flag.repeat and isinstance(raw, str):  # the environment's or the default's
                raw = [part.strip() for part in raw.split(",") if part.strip()]
            if raw is None:
                if flag.required:
                    self.error(f"the following arguments are required: --{flag.name}")
                setattr(out, dest, False if flag.is_switch else None)
                continue
            try:
                value = [flag.parse(r) for r in raw] if flag.repeat else flag.parse(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                self.error(f"{source}: {exc}")
            setattr(out, dest, value)

    def error(self, message: str) -> NoReturn:
        self.parser.error(message)


def _dest(name: str) -> str:
    return name.replace("-", "_")


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
