"""`extproc bench profile` charges perf's shared objects to the layers its table names."""

from __future__ import annotations

import pytest

from extproc.bench import profile

# The shape of `perf report --sort dso --stdio --no-children -g none` (perf 6.1).
REPORT = """\
# To display the perf.data header info, please use --header/--header-only options.
#
# Total Lost Samples: 0
#
# Samples: 4K of event 'cpu-clock:ppp'
# Event count (approx.): 1002000000
#
# Overhead  Shared Object
# ........  ....................
#
    35.88%  [kernel.kallsyms]
    18.99%  cygrpc.cpython-311-x86_64-linux-gnu.so
    20.00%  libpython3.11.so.1.0
    13.04%  python3.11
     3.29%  _message.abi3.so
     3.44%  loop.cpython-311-x86_64-linux-gnu.so
     5.13%  libc.so.6
     0.22%  _hashlib.cpython-311-x86_64-linux-gnu.so
"""


@pytest.mark.parametrize(
    ("dso", "layer"),
    [
        ("[kernel.kallsyms]", "kernel"),
        ("[vdso]", "kernel"),
        ("cygrpc.cpython-311-x86_64-linux-gnu.so", "grpc C core"),
        ("libpython3.11.so.1.0", "CPython interpreter"),
        ("python3.11", "CPython interpreter"),
        ("_message.abi3.so", "protobuf"),
        ("loop.cpython-311-x86_64-linux-gnu.so", "event loop"),
        ("libc.so.6", "libc / allocator"),
        ("orjson.cpython-311-x86_64-linux-gnu.so", "JSON (orjson / msgspec)"),
        ("_hashlib.cpython-311-x86_64-linux-gnu.so", "other"),
    ],
)
def test_each_shared_object_has_its_layer(dso: str, layer: str) -> None:
    assert profile.layer_of(dso) == layer


def test_the_report_splits_into_layers_that_sum_to_its_total() -> None:
    shares = profile.split_by_layer(REPORT)
    assert shares["kernel"] == pytest.approx(35.88)
    assert shares["CPython interpreter"] == pytest.approx(33.04)
    assert shares["grpc C core"] == pytest.approx(18.99)
    assert shares["other"] == pytest.approx(0.22)
    assert sum(shares.values()) == pytest.approx(99.99)
    assert profile._perf_samples(REPORT) == 4000


def test_the_table_turns_shares_into_microseconds_per_request() -> None:
    prof = profile.Profile("header", 5000, 850.0, 17.5, 800.0, 590.0, 4000)
    prof.shares = profile.split_by_layer(REPORT)
    lines = profile.table([profile.Profile("envoy", 30000, 5000.0, 2.7, None, 155.0), prof])
    assert "| envoy | 5000 | 2.700 | - | 155 |" in lines
    assert "| kernel | 35.9 / 287 |" in lines
