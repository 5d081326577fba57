"""Unit tests of bagualu2.budget (Algorithm 1 and deferred planning), with hand-computed examples."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bagualu2.budget import BudgetAssigner, BudgetPhase


def make(m_max_bytes=1200, m0_bytes=100, num_microbatches=6, num_warmup=4, **kwargs) -> BudgetAssigner:
    return BudgetAssigner(
        m_max_bytes=m_max_bytes, m0_bytes=m0_bytes, num_microbatches=num_microbatches, num_warmup=num_warmup,
        **kwargs)


# --------------------------------------------------------------------------------------------- warmup / steady
def test_warmup_splits_remaining_capacity_evenly():
    a = make()
    assert a.phase is BudgetPhase.WARMUP
    assert a.next_forward_budget() == 300  # 1200 // 4
    a.record_forward(0, 300)
    assert a.next_forward_budget() == 300  # (1200 - 300) // 3
    a.record_forward(1, 250)
    assert a.next_forward_budget() == 325  # (1200 - 550) // 2
    a.record_forward(2, 325)
    assert a.next_forward_budget() == 325  # (1200 - 875) // 1: the last warmup batch takes the rest
    a.record_forward(3, 300)
    assert a.in_flight_bytes == 1175
    assert a.num_launched == 4
    assert a.phase is BudgetPhase.STEADY


def test_warmup_formula_reserves_m0_for_each_remaining_batch():
    # budget = m0 + (M_max - in_flight - k * m0) // k, with floor division on a remainder.
    a = make(m_max_bytes=1000, m0_bytes=100, num_microbatches=3, num_warmup=3)
    assert a.next_forward_budget() == 100 + (1000 - 0 - 3 * 100) // 3 == 333
    a.record_forward(0, 333)
    assert a.next_forward_budget() == 100 + (1000 - 333 - 2 * 100) // 2 == 333
    a.record_forward(1, 333)
    assert a.next_forward_budget() == 334


def test_steady_gives_freed_bytes_to_next_forward():
    """All freed bytes to the next forward (no overrun to hold back)."""
    a = make()
    for mb, actual in enumerate([300, 250, 325, 300]):
        a.record_forward(mb, actual)
    a.record_backward(0)  # frees 300
    assert a.next_forward_budget() == 1200 - 875 == 325
    a.record_forward(4, 325)
    assert a.in_flight_bytes == 1200
    a.record_backward(1)  # frees the MEASURED 250 bytes, not mb 1's 300-byte budget
    assert a.next_forward_budget() == 250
    a.record_forward(5, 200)
    assert a.phase is BudgetPhase.DONE
    for mb in (2, 3, 4, 5):
        a.record_backward(mb)
    assert a.in_flight_bytes == 0
    assert a.in_flight_microbatches == ()


def test_a_steady_forward_does_not_inherit_an_overrun():
    """A warmup forward that kept more than its budget and an even share (absorbed) leaves the next one less; when
    its backward frees it, the overrun is held back from the forward after it, so the split is even again after
    one round, where Algorithm 1 as printed passes the uneven split on for the whole iteration."""
    runs = {}
    for contain in (True, False):
        a = make(num_microbatches=8, num_warmup=2, contain_overruns=contain)  # share 600
        assert a.next_forward_budget() == 600
        a.record_forward(0, 900)  # an overrun absorbed in warmup
        a.record_forward(1, a.next_forward_budget())  # 300 left
        budgets = []
        for mb in range(2, 8):
            a.record_backward(mb - 2)
            budgets.append(a.next_forward_budget())
            a.record_forward(mb, budgets[-1])
        runs[contain] = budgets
    assert runs[True] == [600, 600, 600, 600, 600, 600]  # 900 freed, 300 of it held back once
    assert runs[False] == [900, 300, 900, 300, 900, 300]
    b = make(num_microbatches=4, num_warmup=2)  # above the share but within its own budget: no overrun
    b.record_forward(0, 500)
    assert b.next_forward_budget() == 700  # the 100 mb 0 left unused passes on
    b.record_forward(1, 650)
    b.record_backward(1)
    assert b.next_forward_budget() == 700  # 1200 - 500: all 650 freed pass on
    with pytest.raises(ValueError, match="contain_overruns must be True or False"):
        make(contain_overruns=1)


def test_rebasing_overestimate_does_not_cascade():
    a = make()
    assert a.next_forward_budget() == 300
    a.record_forward(0, 100)  # used only m0 of its 300-byte budget
    # Re-based on the 100 measured bytes: (1200 - 100) // 3, not the 300 a budget-based account would give.
    assert a.next_forward_budget() == 366
    a.record_forward(1, 100)
    assert a.next_forward_budget() == 500  # (1200 - 200) // 2
    a.record_forward(2, 100)
    assert a.next_forward_budget() == 900
    a.record_forward(3, 900)
    a.record_backward(0)
    assert a.next_forward_budget() == 100  # 1200 - (100 + 100 + 900)


def test_overrun_is_recorded_and_later_budgets_shrink():
    a = make()
    a.record_forward(0, 500)  # budget was 300
    assert a.overrun_microbatches == (0,)
    assert a.next_forward_budget() == (1200 - 500) // 3 == 233
    a.record_forward(1, 1000)  # way over: in flight exceeds capacity
    assert a.in_flight_bytes == 1500
    assert a.next_forward_budget() == 0  # clamped, never negative
    assert a.overrun_microbatches == (0, 1)


def test_peek_is_idempotent_and_changes_only_on_records():
    a = make()
    assert a.next_forward_budget() == a.next_forward_budget() == 300
    a.record_forward(0, 200)
    assert a.next_forward_budget() == a.next_forward_budget() == 333


def test_all_warmup_when_num_warmup_equals_num_microbatches():
    a = make(m_max_bytes=900, m0_bytes=300, num_microbatches=3, num_warmup=3)
    for mb in range(3):
        assert a.phase is BudgetPhase.WARMUP
        assert a.next_forward_budget() == 300
        a.record_forward(mb, 300)
    assert a.phase is BudgetPhase.DONE
    assert a.in_flight_bytes == 900


def test_out_of_order_microbatches_and_zero_floor():
    a = make(m_max_bytes=10, m0_bytes=0, num_microbatches=3, num_warmup=2)
    a.record_forward(2, 5)
    a.record_forward(0, 5)
    assert a.in_flight_microbatches == (2, 0)
    a.record_backward(2)
    assert a.next_forward_budget() == 5


def test_reset_starts_a_new_iteration():
    a = make()
    for mb in range(6):
        a.record_forward(mb, 100)
    a.record_backward(0)
    a.reset()
    assert (a.num_launched, a.in_flight_bytes, a.phase) == (0, 0, BudgetPhase.WARMUP)
    assert a.overrun_microbatches == ()
    assert a.next_forward_budget() == 300
    a.record_forward(0, 100)  # allowed again after reset


def test_repr_is_one_line():
    assert "\n" not in repr(make())


# ------------------------------------------------------------------------------------------- construction errors
def test_capacity_below_floor_message_contains_both_numbers():
    with pytest.raises(ValueError) as info:
        make(m_max_bytes=1000, m0_bytes=300, num_microbatches=8, num_warmup=4)
    message = str(info.value)
    assert "\n" not in message
    assert "1000" in message and "1200" in message
    assert "m_max_bytes" in message and "m0_bytes" in message


def test_capacity_exactly_at_floor_is_allowed():
    a = make(m_max_bytes=1200, m0_bytes=300, num_microbatches=8, num_warmup=4)
    assert a.next_forward_budget() == 300


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("m_max_bytes", -1),
        ("m_max_bytes", 1.5),
        ("m_max_bytes", True),
        ("m0_bytes", -1),
        ("m0_bytes", "100"),
        ("m0_bytes", None),
        ("num_microbatches", 0),
        ("num_microbatches", False),
        ("num_warmup", 0),
        ("num_warmup", 7),
        ("num_warmup", 2.0),
    ],
)
def test_invalid_field_raises_value_error_naming_the_field(field, value):
    kwargs = dict(m_max_bytes=1200, m0_bytes=100, num_microbatches=6, num_warmup=4)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field) as info:
        BudgetAssigner(**kwargs)
    assert "\n" not in str(info.value)


def test_constructor_is_keyword_only():
    with pytest.raises(TypeError):
        BudgetAssigner(1200, 100, 6, 4)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- protocol misuse
def test_recording_a_forward_twice_raises():
    a = make()
    a.record_forward(0, 100)
    with pytest.raises(ValueError, match="already recorded"):
        a.record_forward(0, 100)
    a.record_backward(0)
    with pytest.raises(ValueError, match="already recorded"):
        a.record_forward(0, 100)


@pytest.mark.parametrize("mb", [-1, 6, 100, True, 1.0, "0"])
def test_microbatch_out_of_range_or_not_int_raises(mb):
    a = make()
    with pytest.raises(ValueError, match="microbatch"):
        a.record_forward(mb, 100)
    with pytest.raises(ValueError, match="microbatch"):
        a.record_backward(mb)


def test_record_forward_returns_the_in_flight_bytes():
    a = make()
    assert a.record_forward(0, 300) == 300 == a.in_flight_bytes
    assert a.record_forward(1, 250) == 550 == a.in_flight_bytes
    a.record_backward(0)
    assert a.record_forward(2, 100) == 350 == a.in_flight_bytes


def test_granted_budget_is_the_one_in_force_whether_or_not_it_was_asked_for():
    a = make()
    for mb in range(4):
        a.record_forward(mb, 300)
    assert a.next_forward_budget() == 0  # peeked, then a backward frees 300: the peek is stale
    a.record_backward(0)
    a.record_forward(4, 300)  # recorded without asking again: granted 300, no overrun
    assert a.overrun_microbatches == ()
    a.record_backward(1)
    assert a.next_forward_budget() == 300
    a.record_forward(5, 301)
    assert a.overrun_microbatches == (5,)


@pytest.mark.parametrize("mb", [True, 1.0, -1, 6])
def test_backward_checks_the_microbatch_before_freeing_anything(mb):
    a = make()
    a.record_forward(1, 300)  # True and 1.0 hash like 1: they must not free micro-batch 1
    with pytest.raises(ValueError, match="microbatch must be an int"):
        a.record_backward(mb)
    assert a.in_flight_microbatches == (1,) and a.in_flight_bytes == 300


@pytest.mark.parametrize("actual", [-1, 1.5, True, None])
def test_bad_actual_bytes_raises(actual):
    a = make()
    with pytest.raises(ValueError, match="actual_bytes"):
        a.record_forward(0, actual)
    assert a.num_launched == 0 and a.in_flight_bytes == 0  # nothing half-recorded


def test_backward_of_microbatch_not_in_flight_raises():
    a = make()
    with pytest.raises(ValueError, match="not in flight"):
        a.record_backward(0)
    a.record_forward(0, 100)
    a.record_backward(0)
    with pytest.raises(ValueError, match="not in flight"):
        a.record_backward(0)


def test_budget_after_all_forwards_launched_raises():
    a = make(num_microbatches=4, num_warmup=4)
    for mb in range(4):
        a.record_forward(mb, 100)
    with pytest.raises(ValueError, match="already launched"):
        a.next_forward_budget()
    a.record_backward(3)  # cooldown backwards are still fine
    with pytest.raises(ValueError):
        a.next_forward_budget()


# --------------------------------------------------------------------------------------------- deferred planning
# ------------------------------------------------------------------------------------------------- purity
def test_budget_package_imports_only_stdlib():
    package_dir = Path(__file__).resolve().parents[2] / "src" / "bagualu2" / "budget"
    for source in sorted(package_dir.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & {"torch", "numpy"}, f"{source.name} imports {roots}"
