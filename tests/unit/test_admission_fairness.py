"""Fair queuing of parked Standard requests (adapt/flows.py) and its use by admission."""

from __future__ import annotations

from collections import Counter

import pytest

from cachefleet_common.classes import BEST_EFFORT, GUARANTEED, STANDARD, capped_class
from cachefleet_common.modelserver import ModelServerMetrics
from cachefleet_sidecar.adapt import flows
from cachefleet_sidecar.adapt.admission import REASON_QUEUE_FULL, Admission, AdmissionConfig
from cachefleet_sidecar.adapt.flows import FairQueue, Flow

DEADLINE = 100.0


def pop_all(q: FairQueue[str]) -> list[str]:
    out: list[str] = []
    while q:
        item = q.pop()
        assert item is not None
        out.append(item)
    return out


def test_a_tenant_with_one_request_is_not_served_behind_anothers_fifty() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(50):
        q.push(f"A{i}", Flow("A"), DEADLINE)
    q.push("B0", Flow("B"), DEADLINE)
    order = pop_all(q)
    assert order.index("B0") <= 1  # B's first request goes at A's first turn, at the latest
    assert [x for x in order if x.startswith("A")] == [f"A{i}" for i in range(50)]  # FIFO in A


def test_weights_share_the_releases() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(40):
        q.push(f"A{i}", Flow("A", weight=3.0), DEADLINE)
        q.push(f"B{i}", Flow("B", weight=1.0), DEADLINE)
    first = Counter(x[0] for x in pop_all(q)[:40])
    assert first["A"] == 30
    assert first["B"] == 10


def test_a_fractional_weight_is_a_fraction() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(30):
        q.push(f"A{i}", Flow("A", weight=0.5), DEADLINE)
        q.push(f"B{i}", Flow("B"), DEADLINE)
    first = Counter(x[0] for x in pop_all(q)[:30])
    assert first["B"] == 20
    assert first["A"] == 10


def test_fairness_ids_split_their_tenants_share_and_never_add_to_it() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(10):  # A's client invents ten fairness ids
        for j in range(5):
            q.push(f"A{i}.{j}", Flow("A", f"id{i}"), DEADLINE)
    for j in range(50):
        q.push(f"B{j}", Flow("B"), DEADLINE)
    order = pop_all(q)
    assert Counter(x[0] for x in order[:20]) == {"A": 10, "B": 10}
    # within A, the ids take turns: each of the ten ids had one release in A's first ten
    a_first = [x for x in order if x.startswith("A")][:10]
    assert sorted(x.split(".")[0] for x in a_first) == [f"A{i}" for i in range(10)]


def test_an_idle_tenant_banks_no_credit() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(20):
        q.push(f"A{i}", Flow("A"), DEADLINE)
    for _ in range(10):  # A alone for ten releases
        q.pop()
    for i in range(10):
        q.push(f"B{i}", Flow("B"), DEADLINE)
    following = pop_all(q)[:10]
    assert Counter(x[0] for x in following) == {"A": 5, "B": 5}  # alternate: no catching up


def test_expire_takes_the_oldest_across_tenants_and_charges_nobody() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("A0", Flow("A"), 1.0)
    q.push("B0", Flow("B"), 2.0)
    q.push("A1", Flow("A"), 3.0)
    q.push("B1", Flow("B"), 4.0)
    assert q.expire(2.5) == ["A0", "B0"]
    assert len(q) == 2
    assert q.queued("A") == 1
    assert pop_all(q) == ["A1", "B1"]


def test_expiry_after_releases_evictions_and_removals_keeps_arrival_order() -> None:
    q: FairQueue[str] = FairQueue()
    names = [f"{t}{i}" for i in range(100) for t in "ABC"]  # arrival order A0 B0 C0 A1 ...
    for n, name in enumerate(names):
        q.push(name, Flow(name[0], weight=2.0 if name[0] == "A" else 1.0), float(n))
    released = {q.pop() for _ in range(200)}  # the arrival order compacts on the way
    evicted = q.evict_for(Flow("D"))
    assert evicted is not None
    left = [n for n in names if n not in released and n != evicted]
    assert q.remove(left[10])
    expected = left[:10] + left[11:]
    assert len(expected) == 98
    assert q.expire(1e9) == expected
    assert len(q) == 0
    assert len(q._arrivals) == 0  # white box: nothing that left is kept


def test_remove_by_identity_and_unknown_items() -> None:
    q: FairQueue[object] = FairQueue()
    a, b = object(), object()
    q.push(a, Flow("A"), DEADLINE)
    q.push(b, Flow("A"), DEADLINE)
    assert q.remove(a)
    assert not q.remove(a)
    assert not q.remove(object())
    assert q.pop() is b
    assert q.pop() is None


def test_a_full_queue_evicts_the_newest_of_the_heaviest_tenant_for_another() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push(f"A{i}", Flow("A"), DEADLINE)
    assert q.evict_for(Flow("A")) is None  # A's own newcomer: refused
    assert q.evict_for(Flow("B")) == "A3"
    q.push("B0", Flow("B"), DEADLINE)
    q.push("A4", Flow("A"), DEADLINE)
    assert q.evict_for(Flow("B")) == "A4"  # A holds 3 + 1, B would hold 2
    q.push("B1", Flow("B"), DEADLINE)
    assert q.evict_for(Flow("B")) is None  # 3 and 2: B's third would be the heaviest
    assert q.evict_for(Flow("C", weight=0.1)) is None  # 1 / 0.1 = 10 places' worth


def test_drain_is_arrival_order_and_resets() -> None:
    q: FairQueue[str] = FairQueue()
    for name in ("A0", "B0", "A1"):
        q.push(name, Flow(name[0]), DEADLINE)
    assert q.drain() == ["A0", "B0", "A1"]
    assert len(q) == 0
    assert q.tenants == 0
    assert q.pop() is None


def test_idle_history_stays_bounded_however_many_fairness_ids() -> None:
    q: FairQueue[int] = FairQueue()
    q.push(-1, Flow("A", "keep"), DEADLINE)  # keeps the busy period open
    for i in range(3 * flows.MAX_IDLE_FLOWS):
        q.push(i, Flow("A", f"user-{i}"), DEADLINE)
        q.push(i, Flow("B"), DEADLINE)
        q.pop()
        q.pop()
    state = q._tenants["A"]  # white box: the bound is on memory
    assert len(state.tags.finish) <= flows.MAX_IDLE_FLOWS


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, ""),
        (b"", ""),
        (b"  user-7 ", "user-7"),
        ("team/a:1", "team/a:1"),
        (b"x" * flows.MAX_FAIRNESS_ID, "x" * flows.MAX_FAIRNESS_ID),
        (b"x" * (flows.MAX_FAIRNESS_ID + 1), ""),
        (b"bad\x00id", ""),
        ("caf\u00e9", ""),
    ],
)
def test_fairness_id_of_a_header_value(raw: bytes | str | None, expected: str) -> None:
    assert flows.fairness_id(raw) == expected


def test_weights_are_bounded() -> None:
    assert flows.bounded_weight(None) == flows.DEFAULT_WEIGHT
    assert flows.bounded_weight(float("nan")) == flows.DEFAULT_WEIGHT
    assert flows.bounded_weight(0.0) == flows.MIN_WEIGHT
    assert flows.bounded_weight(1e9) == flows.MAX_WEIGHT


@pytest.mark.parametrize(
    ("tenant", "objective", "expected"),
    [
        (GUARANTEED, BEST_EFFORT, BEST_EFFORT),
        (GUARANTEED, STANDARD, STANDARD),
        (STANDARD, GUARANTEED, STANDARD),  # never raised
        (BEST_EFFORT, GUARANTEED, BEST_EFFORT),
        (None, GUARANTEED, None),  # a tenant without a class is Standard: not raised either
        (None, BEST_EFFORT, BEST_EFFORT),
        (GUARANTEED, None, GUARANTEED),
    ],
)
def test_an_objective_lowers_a_class_and_never_raises_it(
    tenant: str | None, objective: str | None, expected: str | None
) -> None:
    assert capped_class(tenant, objective) == expected


# ---------------------------------------------------------------- admission with flows


def saturated(config: AdmissionConfig) -> Admission:
    adm = Admission(config)
    adm.observe(ModelServerMetrics(waiting=config.max_waiting), 0.0)
    assert adm.saturated
    return adm


def test_admission_releases_b_before_as_tenth() -> None:
    adm = saturated(AdmissionConfig(max_waiting=4, standard_queue=64))
    for i in range(50):
        assert adm.decide(STANDARD, 0.0, f"A{i}", flow=Flow("A")).action == "wait"
    assert adm.decide(STANDARD, 0.0, "B0", flow=Flow("B")).action == "wait"
    released: list[object] = []
    for t in range(1, 30):  # readings with room for one more each
        adm.observe(ModelServerMetrics(waiting=3), float(t))
        released += adm.release()
    assert "B0" in released
    assert released.index("B0") < released.index("A9")


def test_admission_a_full_queue_hands_a_place_to_another_tenant() -> None:
    adm = saturated(AdmissionConfig(max_waiting=4, standard_queue=3))
    for i in range(3):
        adm.decide(STANDARD, 0.0, f"A{i}", flow=Flow("A"))
    refused = adm.decide(STANDARD, 0.0, "A3", flow=Flow("A"))
    assert (refused.action, refused.status, refused.reason) == ("refuse", 429, REASON_QUEUE_FULL)
    assert adm.take_evicted() == []
    assert adm.decide(STANDARD, 0.0, "B0", flow=Flow("B")).action == "wait"
    assert adm.take_evicted() == ["A2"]
    assert adm.take_evicted() == []
    assert adm.queued == 3
    assert adm.full_decision().status == 429
    assert adm.describe()["queued_tenants"] == 2


# ---------------------------------------------------------------- the sidecar's flags


def test_the_sidecar_flags_give_weights_and_objectives() -> None:
    from cachefleet_sidecar.config import parse_args

    config = parse_args(
        [
            "--admission-fairness-weights",
            "team-a=3, team-b=0.5",
            "--admission-objectives",
            "batch=BestEffort,chat=Guaranteed",
        ]
    )
    assert config.tenancy.admission_weights == {"team-a": 3.0, "team-b": 0.5}
    assert config.tenancy.admission_objectives == {"batch": "BestEffort", "chat": "Guaranteed"}
    assert parse_args([]).tenancy.admission_weights == {}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--admission-fairness-weights", "team-a=0"], "--admission-fairness-weights: team-a"),
        (["--admission-fairness-weights", "team-a=x"], "--admission-fairness-weights: team-a"),
        (["--admission-fairness-weights", "team-a"], "expected name=value"),
        (["--admission-fairness-weights", "a=1,a=2"], "given twice"),
        (["--admission-objectives", "batch=Gold"], "--admission-objectives: batch"),
    ],
)
def test_bad_sidecar_flags_are_refused_naming_them(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachefleet_sidecar.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert needle in capsys.readouterr().err
