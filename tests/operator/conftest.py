"""Fixtures for operator tests: kmock's KubernetesEmulator and kopf, each in its own thread.

* ``emulator`` runs :class:`cachefleet_e2e.k8s.Emulator` (the emulator made fit
  for kopf) in a thread with its own event loop on loopback and yields an
  :class:`EmulatorHandle` with a small synchronous client.
* ``operator_factory`` starts kopf (our handlers) in another thread against
  the emulator with a given Reconciler, waits until its watch is open, and
  stops it before the emulator goes away.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cachefleet_e2e.k8s import (
    EmulatorError,
    EmulatorHandle,
    run_emulator,
    run_operator,
)
from cachefleet_operator.reconcile import Reconciler

NAMESPACE = "default"
IC_PATH = f"/apis/cachefleet.io/v1alpha1/namespaces/{NAMESPACE}/inferencecaches"

__all__ = ["IC_PATH", "NAMESPACE", "EmulatorHandle", "OperatorFactory", "wait_for"]


@pytest.fixture
def emulator() -> Iterator[EmulatorHandle]:
    """A KubernetesEmulator on 127.0.0.1 in its own thread."""
    try:
        with run_emulator() as handle:
            yield handle
    except EmulatorError as exc:
        pytest.fail(str(exc))


OperatorFactory = Callable[[Reconciler], None]


@pytest.fixture
def operator_factory(emulator: EmulatorHandle) -> Iterator[OperatorFactory]:
    """``start(reconciler)``: kopf with our handlers against the emulator, stopped at teardown."""
    import contextlib

    with contextlib.ExitStack() as stack:

        def start(reconciler: Reconciler) -> None:
            try:
                stack.enter_context(run_operator(emulator, [NAMESPACE], {"reconciler": reconciler}))
            except EmulatorError as exc:
                pytest.fail(str(exc))

        yield start


def wait_for(
    predicate: Callable[[], Any], timeout_s: float, message: str, interval_s: float = 0.1
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s: {message} (last: {last!r})")
