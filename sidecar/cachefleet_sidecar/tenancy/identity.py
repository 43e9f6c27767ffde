"""Who is the tenant: API keys, trusted proxy networks (the rules are in docs/security.md).

The sidecar learns a request's tenant from exactly two places, both request
*headers* (never trailers, never the body or the URL):

* an API key (``Authorization: Bearer <key>``) looked up in the keys table;
  when a table is configured the key alone decides the tenant;
* the tenant header (``X-Tenant-ID`` by default), honoured only when there is
  no keys table and the connection comes from a trusted proxy network.

This module holds that decision, none of it needing an event loop or a
socket: the keys table (plain keys or ``sha256:<hex>`` digests, only digests
kept in memory, reloaded when the file changes), the trusted networks, and
:class:`TenantRules`, which decides a request's tenant from its headers and
peer address with those tables, the known tenants and the default tenant. A
key never appears in an error message or a log line: errors name the entry by
its position and the tenant it maps to.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import orjson

from cachefleet_common.contract.names import valid_name
from cachefleet_sidecar.http.server import Refusal

log = logging.getLogger("cachefleet.sidecar")

#: Prefix of a key given as its SHA-256 digest in the keys file.
DIGEST_PREFIX = "sha256:"
#: How often the API-keys file is checked for changes, seconds.
API_KEYS_POLL_S = 2.0
#: Most peer addresses whose trust decision is remembered (cleared when full).
PEER_MEMO_MAX = 4096
#: Most tenant-header values whose decision is remembered (no more are added when full).
TENANT_MEMO_MAX = 4096

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class KeyFileError(ValueError):
    """The API-keys file cannot be used; the message never contains a key."""


def key_digest(key: bytes) -> bytes:
    """The SHA-256 digest under which a key is kept and looked up."""
    return hashlib.sha256(key).digest()


def parse_api_keys(data: bytes | Mapping[str, object]) -> dict[bytes, str]:
    """``{digest: tenant}`` from the keys file's JSON (or an already parsed mapping).

    The file is a JSON object ``{"<key>": "<tenant>", "sha256:<64 hex>": "<tenant>"}``:
    a name that starts with ``sha256:`` followed by 64 hex digits is the
    SHA-256 digest of the key (``printf %s KEY | sha256sum``), anything else
    is the key itself. Tenants must be valid tenant names.
    """
    if isinstance(data, bytes | bytearray):
        try:
            loaded = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            # orjson's message names a position, never the document's text.
            raise KeyFileError(f"not JSON: {exc}") from None
    else:
        loaded = data
    if not isinstance(loaded, dict):
        raise KeyFileError("expected a JSON object of api-key -> tenant name")
    table: dict[bytes, str] = {}
    for position, (key, tenant) in enumerate(loaded.items(), start=1):
        if not isinstance(key, str) or not key:
            raise KeyFileError(f"entry {position}: the key must be a non-empty string")
        if not isinstance(tenant, str) or not valid_name(tenant):
            raise KeyFileError(
                f"entry {position}: tenant must be 1-63 characters of [A-Za-z0-9._-] "
                "starting with a letter or digit"
            )
        digest = _digest_of(key, position)
        if table.get(digest, tenant) != tenant:
            raise KeyFileError(f"entry {position}: the same key maps to two tenants")
        table[digest] = tenant
    return table


def _digest_of(key: str, position: int) -> bytes:
    if key.lower().startswith(DIGEST_PREFIX):
        hexpart = key[len(DIGEST_PREFIX) :]
        if len(hexpart) != 64:
            raise KeyFileError(
                f"entry {position}: a sha256: digest needs 64 hex digits, got {len(hexpart)}"
            )
        try:
            return bytes.fromhex(hexpart)
        except ValueError:
            raise KeyFileError(f"entry {position}: the sha256: digest is not hex") from None
    return key_digest(key.encode())


class ApiKeys:
    """The keys table: digest -> tenant, optionally backed by a file that is re-read on change."""

    def __init__(self, table: Mapping[bytes, str], path: str | None = None) -> None:
        self.table = dict(table)
        self.path = path
        self.tenants = frozenset(self.table.values())
        self._stamp = _stamp(path) if path else None
        #: Why the last reload was refused (the old table stays in force), or None.
        self.error: str | None = None
        self.reloads = 0

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        """Read ``path`` now; :class:`KeyFileError` if it is unusable."""
        stamp = _stamp(path)
        table = _read(path)
        keys = cls(table, path)
        keys._stamp = stamp
        return keys

    def lookup(self, token: bytes) -> str | None:
        """The tenant of a presented key, or None."""
        return self.table.get(key_digest(token))

    def poll(self) -> bool:
        """Re-read the file if it changed; True when a new table is in force.

        A file that cannot be read or parsed leaves the old table in force
        (``error`` says why, without any key). Kubernetes updates a mounted
        Secret by swapping a symlink, which changes the file's inode and mtime.
        """
        if self.path is None:
            return False
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return False
        try:
            table = _read(self.path)
        except KeyFileError as exc:
            if self.error != str(exc):
                log.error("API-keys file %s not reloaded (old keys stay): %s", self.path, exc)
            self.error = str(exc)
            return False
        self._stamp = stamp
        self.error = None
        self.table = table
        self.tenants = frozenset(table.values())
        self.reloads += 1
        log.info(
            "API-keys file %s reloaded: %d keys for %d tenants",
            self.path,
            len(table),
            len(self.tenants),
        )
        return True


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _read(path: str) -> dict[bytes, str]:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise KeyFileError(f"cannot read {path}: {exc.strerror}") from None
    return parse_api_keys(data)


# ------------------------------------------------------------------ networks


def parse_networks(text: str | Iterable[str]) -> tuple[Network, ...]:
    """CIDRs from ``"10.0.0.0/8,fd00::/8"`` (or a list); a bare address is one host.

    Raises ValueError naming the entry that is not a network.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[Network] = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"not an IP network (CIDR): {item!r}") from None
    return tuple(out)


@dataclass
class TrustedNetworks:
    """Source networks whose tenant header is believed (decisions memoised per address)."""

    networks: tuple[Network, ...]

    def __post_init__(self) -> None:
        self._memo: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.networks)

    def trusts(self, peer: str | None) -> bool:
        """True if ``peer`` (an IP address as the socket reports it) is inside a network."""
        if peer is None or not self.networks:
            return False
        found = self._memo.get(peer)
        if found is not None:
            return found
        try:
            addr = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:
            found = False
        else:
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                addr = addr.ipv4_mapped
            found = any(addr.version == net.version and addr in net for net in self.networks)
        if len(self._memo) >= PEER_MEMO_MAX:
            self._memo.clear()
        self._memo[peer] = found
        return found


# ------------------------------------------------------------------ the rules


class TenantRules:
    """A request's tenant from its headers and peer, by the rules of docs/security.md.

    With an API-keys table the key alone decides (a tenant header that
    disagrees is ignored and counted); without one the tenant header is
    believed only from a trusted proxy network. A request that cannot be
    given a tenant raises :class:`Refusal`; ``on_mismatch(reason)`` counts
    the refusals and ignored headers that look like a client claiming an
    identity it does not have.
    """

    def __init__(
        self,
        header: str,
        *,
        api_keys: ApiKeys | None = None,
        trusted: TrustedNetworks | None = None,
        default_tenant: str | None = None,
        known: Iterable[str] = (),
        admit_guests: bool = False,
        on_mismatch: Callable[[str], None] | None = None,
    ) -> None:
        #: The tenant header as configured (messages) and as the server lowercases it.
        self.header = header
        self.name = header.lower().encode()
        self.api_keys = api_keys
        self.trusted = trusted or TrustedNetworks(())
        self.default_tenant = default_tenant
        #: Tenants admitted by name (empty: any valid name).
        self.known: set[str] = set(known)
        #: Whether an unlisted tenant is served as a guest (not sent to the default tenant).
        self.admit_guests = admit_guests
        self.on_mismatch = on_mismatch
        #: Tenant-header value -> tenant, for headers that were decided (cleared on change).
        self.memo: dict[bytes, str] = {}

    def set_known(self, known: Iterable[str], *, admit_guests: bool) -> None:
        """New known tenants and guest rule (the operator's quotas moved)."""
        self.known = set(known)
        self.admit_guests = admit_guests
        self.memo.clear()

    def resolve(self, headers: list[tuple[bytes, bytes]], peer: str | None) -> str:
        """The tenant of a request with these (lowercased) headers from ``peer``.

        Only request headers are read: the server drops chunked-body trailers
        before they get here.
        """
        name = self.name
        claimed: bytes | None = None
        auth: bytes | None = None
        for hname, value in headers:
            if hname == name:
                if claimed is not None and claimed != value:
                    raise self._refuse("ambiguous", 400, f"more than one {self.header} header")
                claimed = value
            elif hname == b"authorization":
                if auth is not None and auth != value and self.api_keys is not None:
                    raise self._refuse("ambiguous", 400, "more than one Authorization header")
                auth = value
        if self.api_keys is not None:
            return self._by_key(auth, claimed)
        if claimed is None:
            if self.default_tenant is not None:
                return self.default_tenant
            raise Refusal(403, f"no tenant: set the {self.header} header (or a mapped API key)")
        if not self.trusted.trusts(peer):
            raise self._refuse(
                "untrusted_header",
                403,
                f"the {self.header} header is believed only from the "
                f"--trusted-proxies networks, and this connection comes from {peer}",
            )
        tenant = self.memo.get(claimed)
        if tenant is not None:
            return tenant
        text = claimed.decode("latin-1")
        if not valid_name(text):
            raise Refusal(400, f"invalid tenant name {text[:80]!r}: use 1-63 of [A-Za-z0-9._-]")
        if self.known and text not in self.known:
            if self.admit_guests:
                pass  # admitted as a guest: its bytes come from the guest pool only
            elif self.default_tenant is not None:
                return self.default_tenant
            else:
                raise Refusal(403, f"unknown tenant {text!r}")
        if len(self.memo) < TENANT_MEMO_MAX:
            self.memo[claimed] = text
        return text

    def _by_key(self, auth: bytes | None, claimed: bytes | None) -> str:
        assert self.api_keys is not None
        if auth is None:
            if self.default_tenant is None:
                raise self._refuse(
                    "missing_key", 401, "an API key is required: Authorization: Bearer <key>"
                )
            tenant = self.default_tenant
        else:
            scheme, _, token = auth.strip().partition(b" ")
            found = self.api_keys.lookup(token.strip()) if scheme.lower() == b"bearer" else None
            if found is None:
                raise self._refuse(
                    "invalid_key", 401, "invalid API key (expected Authorization: Bearer <key>)"
                )
            tenant = found
        if claimed is not None and claimed != tenant.encode():
            # The key decides; the header is ignored, and counted: it names someone else.
            self._count("header_ignored")
        return tenant

    def _count(self, reason: str) -> None:
        if self.on_mismatch is not None:
            self.on_mismatch(reason)

    def _refuse(self, reason: str, status: int, message: str) -> Refusal:
        self._count(reason)
        extra = b'www-authenticate: Bearer realm="cachefleet"\r\n' if status == 401 else b""
        return Refusal(status, message, extra=extra)
