"""`extproc bench scale --decisions-only`'s new-session rows (bound off, the previous path,
as served) are measured and printed."""

from __future__ import annotations

from extproc.bench.scale import (
    NEW_BOUND,
    NEW_BOUND_OFF,
    NEW_BOUND_OLD,
    decision_table,
    measure_decisions,
)


def test_the_new_session_rows_are_measured_and_printed() -> None:
    row = measure_decisions(4, ["pairs"], 10)
    assert set(row.new_session_us) == {NEW_BOUND_OFF, NEW_BOUND_OLD, NEW_BOUND}
    assert all(us > 0 for us in row.new_session_us.values())
    table = decision_table([row], ["pairs"])
    assert f"new session, {NEW_BOUND_OLD}" in table.splitlines()[0]
    assert table.splitlines()[2].count("µs") == 5 + 1 + 3
