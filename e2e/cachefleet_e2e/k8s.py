"""The Kubernetes API without a cluster: kmock's emulator made fit for kopf.

Used by the operator tests and by ``cachefleet demo``. :class:`Emulator`
fixes what the stock ``kmock.KubernetesEmulator`` lacks for kopf (see
shared/TESTING.md): it stamps uid / resourceVersion / generation /
creationTimestamp, names objects created with ``generateName`` (Events),
applies JSON patches (answering 422 when a ``test`` op fails), bumps
``generation`` on spec changes, and names the kind of list responses.
:func:`run_emulator` serves it from its own thread and event loop;
:func:`run_operator` runs kopf with cachefleet's handlers in another.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp.web
import attrs
import httpx
import kmock

#: Bound on every start-up wait, seconds.
STARTUP_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
#: Pause after the watch opened, so the emulator's stream is attached.
WATCH_SETTLE_S = 0.3


class EmulatorError(RuntimeError):
    """The emulator or the operator thread did not come up."""


class JsonPatchTestFailed(Exception):
    pass


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def apply_json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 subset kopf uses: test, add, replace, remove."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = _pointer(op["path"])
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1] if parts else ""
        kind = op["op"]
        if kind == "test":
            current = None
            with contextlib.suppress(KeyError, IndexError, ValueError, TypeError):
                current = parent[int(last)] if isinstance(parent, list) else parent[last]
            if current != op.get("value"):
                raise JsonPatchTestFailed(op["path"])
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
    return doc


def merge_diff(old: Any, new: Any) -> Any:
    """A merge patch turning ``old`` into ``new`` (``None`` deletes a key)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    out: dict[str, Any] = {}
    for key, value in new.items():
        if key not in old:
            out[key] = value
        elif old[key] != value:
            out[key] = merge_diff(old[key], value)
    for key in old:
        if key not in new:
            out[key] = None
    return out


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """KubernetesEmulator with the metadata and patch semantics kopf relies on."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)
    #: (action, plural) of every Kubernetes request seen, for the fixtures' waits.
    seen: list[tuple[Any, str]] = attrs.field(factory=list, init=False)
    #: The Authorization header of every request (None when absent), for login tests.
    authorizations: list[str | None] = attrs.field(factory=list, init=False)

    def _next_version(self) -> str:
        return str(next(self._versions))

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") == "/api/v1/namespaces" and raw_request.method == "GET":
            served: aiohttp.web.StreamResponse = await self._serve_namespaces(raw_request)
            return served  # (the stock parser fails on this path)
        response: aiohttp.web.StreamResponse = await super().__call__(raw_request)
        return response

    async def _serve_namespaces(
        self, raw_request: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        """``GET /api/v1/namespaces``: the namespaces that hold objects, plus ``default``.

        A watch is held open (nothing changes) until the client goes or its
        ``timeoutSeconds`` (bounded) pass, as a real API server would.
        """
        self.authorizations.append(raw_request.headers.get("Authorization"))
        if raw_request.query.get("watch") in {"true", "1"}:
            response = aiohttp.web.StreamResponse()
            await response.prepare(raw_request)
            timeout = min(float(raw_request.query.get("timeoutSeconds", 60)), 60.0)
            await asyncio.sleep(timeout)
            return response
        names = {"default"} | {ns for (_r, ns, _n) in list(self.objects) if ns}
        items = [{"metadata": {"name": ns, "uid": ns}} for ns in sorted(names)]
        return aiohttp.web.json_response(
            {
                "kind": "NamespaceList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": self._next_version()},
                "items": items,
            }
        )

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        if request.resource is not None:
            self.seen.append((request.action, request.resource.plural))
        self.authorizations.append(request.headers.get("Authorization"))
        if request.resource is not None and request.action == kmock.action.CREATE:
            data = copy.deepcopy(request.data or {})
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault(
                "creationTimestamp",
                datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
            meta["resourceVersion"] = self._next_version()
            meta["generation"] = 1
            object.__setattr__(request, "data", data)
        elif (
            request.resource is not None
            and request.action == kmock.action.UPDATE
            and request.name is not None
        ):
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                current = copy.deepcopy(self.objects[key].raw)
                if isinstance(request.data, list):
                    try:
                        target = apply_json_patch(current, request.data)
                    except JsonPatchTestFailed as exc:
                        return aiohttp.web.json_response(
                            {
                                "kind": "Status",
                                "apiVersion": "v1",
                                "status": "Failure",
                                "reason": "Invalid",
                                "message": f"test failed at {exc}",
                                "code": 422,
                            },
                            status=422,
                        )
                    merge = merge_diff(current, target)
                else:
                    merge = copy.deepcopy(request.data or {})
                if request.subresource == "status":
                    merge = {"status": merge.get("status")} if "status" in merge else {}
                elif "status" in merge and self._has_status_subresource(request.resource):
                    del merge["status"]  # like the API server: status only via /status
                meta = merge.setdefault("metadata", {}) or {}
                merge["metadata"] = meta
                meta["resourceVersion"] = self._next_version()
                spec_patch = merge.get("spec")
                if spec_patch is not None and merge_diff(
                    current.get("spec"), _merged(current.get("spec"), spec_patch)
                ):
                    meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
                object.__setattr__(request, "data", merge)
        return await super()._handle(request)

    def _has_status_subresource(self, resource: Any) -> bool:
        for declared in self.resources:
            if declared == resource:
                return "status" in self.resources[declared].subresources
        return False

    async def _serve_list(self, request: Any) -> Any:
        payload: Any = await super()._serve_list(request)
        info = self.resources.get(request.resource, None)
        kind = getattr(info, "kind", None) or "Object"
        group, version = request.resource.group, request.resource.version
        payload["kind"] = f"{kind}List"
        payload["apiVersion"] = f"{group}/{version}" if group else version
        payload["metadata"] = {"resourceVersion": self._next_version()}
        return payload

    async def _serve_version(self, request: Any) -> Any:
        payload: Any = await super()._serve_version(request)
        payload["groupVersion"] = payload["groupVersion"].lstrip("/")
        return payload


def _merged(old: Any, patch: Any) -> Any:
    if not (isinstance(old, dict) and isinstance(patch, dict)):
        return patch
    out = dict(old)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(old.get(key), value)
    return out


def declare_resources(emulator: Emulator) -> None:
    emulator.resources["cachefleet.io/v1alpha1/inferencecaches"] = kmock.ResourceInfo(
        kind="InferenceCache",
        singular="inferencecache",
        namespaced=True,
        verbs={"list", "watch", "get", "patch", "create", "delete", "update"},
        subresources={"status"},
    )
    emulator.resources["cachefleet.io/v1alpha1/cacheinvalidations"] = kmock.ResourceInfo(
        kind="CacheInvalidation",
        singular="cacheinvalidation",
        namespaced=True,
        verbs={"list", "watch", "get", "patch", "create", "delete", "update"},
        subresources={"status"},
    )
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs={"list", "watch", "get"}
    )
    emulator.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs={"create", "list", "get"}
    )


class EmulatorHandle:
    """The running emulator: its URL, its objects, and a synchronous client."""

    def __init__(self, emulator: Emulator, url: str, tls_port: int | None = None) -> None:
        self.emulator = emulator
        self.url = url
        #: Port of the HTTPS listener (``run_emulator(tls=...)``), as in-cluster clients need.
        self.tls_port = tls_port
        self.http = httpx.Client(base_url=url, timeout=5.0)

    def watch_opened(self, plural: str) -> bool:
        return (kmock.action.WATCH, plural) in list(self.emulator.seen)

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(path, json=body)
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    def get(self, path: str) -> dict[str, Any] | None:
        response = self.http.get(path)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.patch(
            path, json=body, headers={"Content-Type": "application/merge-patch+json"}
        )
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    def delete(self, path: str) -> None:
        self.http.delete(path).raise_for_status()

    def events(self) -> list[dict[str, Any]]:
        out = []
        for (resource, _ns, _name), obj in list(self.emulator.objects.items()):
            if resource.plural == "events" and not obj.deleted:
                out.append(dict(obj.raw))
        return out


def _run_in_thread(
    name: str, main: Callable[[threading.Event, asyncio.AbstractEventLoop], Any]
) -> tuple[threading.Thread, threading.Event]:
    """Run ``main`` on a new event loop in a daemon thread.

    The loop ends as :func:`asyncio.run` ends one: what ``main`` left running
    (an HTTP server's request handlers, a client's watch) is cancelled and
    awaited before the loop closes, not destroyed pending.
    """
    stop = threading.Event()

    def target() -> None:
        with asyncio.Runner() as runner:
            runner.run(main(stop, runner.get_loop()))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread, stop


def _server_tls(tls: tuple[str, str]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*tls)
    return context


@contextlib.contextmanager
def run_emulator(tls: tuple[str, str] | None = None) -> Iterator[EmulatorHandle]:
    """A KubernetesEmulator on 127.0.0.1 in its own thread, stopped on exit.

    With ``tls=(cert_file, key_file)`` the same emulator is also served over
    HTTPS on another port (``handle.tls_port``): an in-cluster client only
    speaks HTTPS.
    """
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main(stop: threading.Event, loop: asyncio.AbstractEventLoop) -> None:
        # Served by plain aiohttp runners rather than kmock.Server: that one also patches
        # aiohttp's resolver for the whole process, and two emulators whose lives overlap
        # (a fixture's and a fleet's, in different threads) then exit out of order and
        # leave their sessions and handlers unclosed. Clients here use the URL, not a name.
        async with Emulator() as emu:
            declare_resources(emu)
            runners: list[aiohttp.web.ServerRunner] = []
            try:
                for context in (None, _server_tls(tls)) if tls is not None else (None,):
                    runner = aiohttp.web.ServerRunner(aiohttp.web.Server(emu))
                    runners.append(runner)
                    await runner.setup()
                    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
                box["emulator"] = emu
                box["url"] = f"http://127.0.0.1:{runners[0].addresses[0][1]}"
                if tls is not None:
                    box["tls_port"] = runners[1].addresses[0][1]
                ready.set()
                await asyncio.to_thread(stop.wait)
            finally:
                for runner in runners:
                    await runner.cleanup()

    thread, stop = _run_in_thread("kmock-emulator", main)
    if not ready.wait(STARTUP_TIMEOUT_S):
        stop.set()
        raise EmulatorError("the Kubernetes emulator did not start")
    handle = EmulatorHandle(box["emulator"], box["url"], box.get("tls_port"))
    try:
        yield handle
    finally:
        handle.http.close()
        stop.set()
        thread.join(STOP_TIMEOUT_S)


def write_kubeconfig(path: str, server: str, token: str, namespace: str = "default") -> None:
    """A kubeconfig for ``server`` with a bearer ``token`` (as kubectl and the operator read it)."""
    import yaml

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "emulator", "user": {"token": token}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
            }
        ],
    }
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f)


#: Where the login handler points kopf (set by :func:`run_operator`).
_TARGET: dict[str, str] = {}
_REGISTERED: list[bool] = []


def _register_activities() -> None:
    """Login to the emulator and quick settings, registered once on kopf's default registry."""
    if _REGISTERED:
        return
    import kopf

    @kopf.on.login(id="cachefleet-emulator-login")
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=_TARGET["url"], insecure=True)

    @kopf.on.startup(id="cachefleet-emulator-settings")
    def quick(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = True
        settings.watching.reconnect_backoff = 0.5
        settings.watching.server_timeout = 30
        settings.networking.request_timeout = 10

    _REGISTERED.append(True)


@contextlib.contextmanager
def run_operator(
    emulator: EmulatorHandle, namespaces: list[str], memo: dict[str, Any]
) -> Iterator[None]:
    """kopf with cachefleet's handlers against ``emulator`` in its own thread.

    Returns once kopf's watch is open; stops kopf on exit (before the
    emulator goes away, as kopf requires).
    """
    import kopf

    import cachefleet_operator.handlers  # noqa: F401  (registers the handlers)

    _register_activities()
    ready = threading.Event()
    stop_flag = threading.Event()
    _TARGET["url"] = emulator.url
    registry = kopf.get_default_registry()

    async def main(stop: threading.Event, loop: asyncio.AbstractEventLoop) -> None:
        await kopf.operator(
            registry=registry,
            namespaces=namespaces,
            standalone=True,
            memo=kopf.Memo(**memo),
            stop_flag=stop_flag,
            ready_flag=ready,
        )

    thread, _ = _run_in_thread("kopf-operator", main)
    try:
        if not ready.wait(STARTUP_TIMEOUT_S):
            raise EmulatorError("kopf did not get ready")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not emulator.watch_opened("inferencecaches"):
            if time.monotonic() > deadline:
                raise EmulatorError("kopf never opened its watch on the emulator")
            time.sleep(0.05)
        time.sleep(WATCH_SETTLE_S)
        yield
    finally:
        stop_flag.set()
        thread.join(STOP_TIMEOUT_S)
