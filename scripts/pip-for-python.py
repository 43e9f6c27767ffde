"""Run pip with environment markers evaluated for another Python version.

``python scripts/pip-for-python.py 3.11.2 download ...`` is ``pip download ...``
as if run by Python 3.11.2: pip's ``--python-version`` picks wheels for that
version but still evaluates ``python_full_version`` markers with the running
interpreter (redis needs async-timeout below 3.11.3, Debian bookworm has 3.11.2),
so the image's wheelhouse would miss requirements. Used by build-image.sh.
"""

from __future__ import annotations

import sys

from pip._internal.cli.main import main
from pip._vendor.packaging import markers


def _for(version: str) -> None:
    original = markers.default_environment

    def environment() -> dict[str, str]:
        env = dict(original())
        env["python_full_version"] = version
        env["python_version"] = ".".join(version.split(".")[:2])
        return env

    markers.default_environment = environment  # type: ignore[assignment]


if __name__ == "__main__":
    _for(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
