"""bench_e2e.py's report: each method's speedup is taken against the right plain engine."""

import os
from pathlib import Path

import pytest

from helpers.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_e2e.py"


@pytest.fixture(scope="module")
def bench():
    saved = dict(os.environ)  # the script sets its benchmark defaults on import
    try:
        yield load_script(SCRIPT, "bench_e2e_under_test")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _row(bench, method, rates):
    return bench._row("served", method, 0.0, 1, sum(rates), float(len(rates)), [10.0], 0, 0,
                      rates)


def test_mp_servers_are_compared_with_the_plain_mp_server(bench):
    rows = [_row(bench, "no_spec", [30.0, 30.0]), _row(bench, "dflash2_adaptive", [33.0, 36.0]),
            _row(bench, "no_spec_mp", [20.0, 25.0]),
            _row(bench, "dflash2_adaptive_mp", [30.0, 25.0])]
    bench.add_speedups(rows)
    got = {r["method"]: r for r in rows}
    assert got["dflash2_adaptive"]["speedup_by_round"] == pytest.approx([1.1, 1.2])
    assert got["dflash2_adaptive_mp"]["speedup_by_round"] == pytest.approx([1.5, 1.0])
    assert got["dflash2_adaptive_mp"]["speedup"] == pytest.approx(55 / 45)
    assert got["no_spec_mp"]["speedup"] == pytest.approx(1.0)
    table = bench.markdown(rows, ["no_spec", "dflash2_adaptive", "no_spec_mp",
                                  "dflash2_adaptive_mp"])
    assert "| dflash2_adaptive_mp | 27.5 (1.22x 1.00-1.50) |" in table
    assert "| no_spec_mp | 22.5 (1.00x) |" in table  # a baseline shows no spread


def test_suffixes_name_the_base_method(bench):
    assert bench.base_method("dflash2_adaptive_mp") == "dflash2_adaptive"
    assert bench.base_method("dflash2_onednn") == "dflash2"
    assert bench.spec_config("dflash2_adaptive_mp", _Args())[1] == "1"
    assert bench.spec_config("no_spec_mp", _Args()) == (None, "0")


class _Args:
    k, drafter, dflash_drafter = 7, "DRAFTER", "TWIN"
