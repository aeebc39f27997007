"""bench overhead's page-fault and memory columns (the large-body measurement method)."""

from __future__ import annotations

import mmap
import os

from extproc.bench.overhead import WrkResult, summarize, tree_minor_faults, tree_rss_mb


def test_fresh_memory_counts_one_minor_fault_per_page() -> None:
    size = 8 << 20
    before = tree_minor_faults(os.getpid())
    with mmap.mmap(-1, size) as fresh:
        for offset in range(0, size, mmap.PAGESIZE):
            fresh[offset] = 1
        after = tree_minor_faults(os.getpid())
    # THP could map it in fewer faults; the kernel here hands out 4 KiB pages (madvise mode).
    assert after - before >= size // mmap.PAGESIZE // 2
    assert tree_rss_mb(os.getpid()) > 1


def _result(setup: str, size: str, conns: int, faults: float | None) -> WrkResult:
    cpu = None if setup == "envoy" else 500.0
    rss = None if setup == "envoy" else 150.0
    return WrkResult(setup, size, conns, 100, 50.0, 1.0, 2.0, 0, cpu, 0, faults, rss)


def test_summary_reports_faults_and_rss_per_processor() -> None:
    results = [
        _result(setup, size, 1, None if setup == "envoy" else faults)
        for size, faults in (("1KB", 0.0), ("4MiB", 2048.0))
        for setup in ("envoy", "bare", "extproc", "header")
    ]
    lines = summarize(results)
    head = next(i for i, line in enumerate(lines) if "minor page faults" in line)
    assert "bare / extproc / header" in lines[head]
    assert lines[head + 2] == "| 1KB | 1 | 0 / 0 / 0 | 150 / 150 / 150 |"
    assert lines[head + 3] == "| 4MiB | 1 | 2048 / 2048 / 2048 | 150 / 150 / 150 |"


def test_allocator_table_sets_each_processor_beside_itself_on_glibc() -> None:
    results = [
        _result(setup, "4MiB", 1, 2048.0 if setup.endswith("@glibc") else 3.0)
        for setup in ("envoy", "bare", "extproc", "bare@glibc", "extproc@glibc")
    ]
    results[3].proc_cpu_us_per_req = 1000.0  # bare on glibc's defaults: twice the CPU
    lines = summarize(results)
    head = next(i for i, line in enumerate(lines) if "| allocator |" in line)
    assert lines[head + 2 : head + 6] == [
        "| bare | 4MiB | 1 | tuned | 500 | 1.00 | 3 | 150 |",
        "| bare | 4MiB | 1 | glibc | 1000 | 2.00 | 2048 | 150 |",
        "| extproc | 4MiB | 1 | tuned | 500 | 1.00 | 3 | 150 |",
        "| extproc | 4MiB | 1 | glibc | 500 | 1.00 | 2048 | 150 |",
    ]


def test_header_growth_is_also_given_net_of_the_idle_rate() -> None:
    small = WrkResult("header", "1KB", 1, 5000, 1000.0, 1.0, 2.0, 0, 500.0, 0, 0.0, 90.0, 4.0)
    large = WrkResult("header", "16MiB", 1, 100, 20.0, 50.0, 60.0, 0, 1000.0, 0, 0.0, 90.0, 4.0)
    lines = summarize([small, large])
    # 4 ms/s of idle CPU is 4 us of a request at 1,000/s and 200 us of one at 20/s.
    assert (
        "header path, 16MiB ÷ 1KB CPU per request at 1 connections: 2.00"
        " (1.61 net of the processor's idle CPU, 4.0 ms/s: 800 against 496 us)"
    ) in lines
