"""The ``cachefleet`` command line: one entry point, one subcommand per role.

Each subcommand's module is imported only when it runs, so ``cachefleet
sidecar`` never loads kopf or the Kubernetes client.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

#: subcommand -> (module, function taking argv and returning an exit code, help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "sidecar": ("cachefleet_sidecar.app", "main", "run the caching reverse proxy"),
    "operator": ("cachefleet_operator.run", "main", "run the kopf operator"),
    "router": (
        "cachefleet_router.cli",
        "main",
        "run the endpoint picker (Gateway API Inference Extension, ext_proc)",
    ),
    "crds": ("cachefleet_operator.crdgen", "main", "write crds/*.yaml from the models"),
    "docs": (
        "cachefleet_operator.docgen",
        "main",
        "write docs/reference/*.md (flags, CRD fields) from the code",
    ),
    "demo": ("cachefleet_e2e.demo", "main", "run the whole fleet locally"),
    "bench": ("cachefleet_bench.__main__", "main", "run a benchmark (proxy, ...)"),
    "simulate": (
        "cachefleet_bench.simulate",
        "main",
        "replay a multi-tenant trace with each allocator in the loop",
    ),
}


def _usage() -> str:
    lines = ["usage: cachefleet <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {info[2]}" for name, info in SUBCOMMANDS.items()]
    lines += ["", "cachefleet <command> --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"cachefleet: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[command]
    func: Callable[[list[str]], int] = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
