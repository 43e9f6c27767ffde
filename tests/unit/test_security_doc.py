"""docs/security.md shows the Redis ACLs the code defines (one place: contract/acls.py)."""

from __future__ import annotations

from pathlib import Path

from cachefleet_common.contract.acls import operator_acl, sidecar_acl

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def test_documented_acls_are_the_ones_the_code_defines() -> None:
    text = DOC.read_text()
    assert " ".join(sidecar_acl("NAMESPACE/NAME")) in text
    assert " ".join(operator_acl()) in text
