"""tools/icount.py's gate (the CI instruction-count phase): which moves of a count fail it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("icount", Path(__file__).resolve().parent.parent / "tools" / "icount.py")
icount = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(icount)

ENV = {"isa": "avx2", "threads": 1, "python": "3.11.7", "numpy": "2.4.6", "compiler": "gcc 12.2.0"}


def _run(total, core, **env):
    return {**ENV, **env, "regions": {"decode_paged": {"what": "", "reps": 1, "total": total, "core": core}}}


BASE = {"env": ENV, "regions": {"decode_paged": {"total": 1000, "core": 800}}}


@pytest.mark.parametrize(
    "total, core, fails",
    [
        (1000, 800, False),
        (1019, 815, False),  # within 2% both ways
        (985, 785, False),
        (1020, 816, False),  # exactly the margin: "more than" it fails
        (1000, 784, False),
        (1000, 817, True),  # the core grew past the margin
        (1030, 800, True),  # the total grew past it
        (1000, 783, True),  # the core fell past it: work the compiler dropped (prefetches, 3bca3d5)
        (900, 800, False),  # the total may fall: a faster Python layer
    ],
)
def test_gate_margin(total, core, fails):
    lines, failures = icount.gate(_run(total, core), BASE, 0.02)
    assert bool(failures) == fails, (lines, failures)
    if fails:
        assert "decode_paged" in failures[0]
        assert ("under" in failures[0]) == (core < 800)


def test_gate_other_compiler_not_gated():
    lines, failures = icount.gate(_run(2000, 100, compiler="gcc 13.1.0"), BASE, 0.02)
    assert not failures
    assert any("not gated" in x for x in lines)


def test_gate_other_numpy_gates_core_only():
    _, failures = icount.gate(_run(2000, 800, numpy="1.26.4"), BASE, 0.02)
    assert not failures
    _, failures = icount.gate(_run(1000, 700, numpy="1.26.4"), BASE, 0.02)
    assert failures and "core" in failures[0]


def test_gate_region_missing_from_the_run_fails():
    base = {"env": ENV, "regions": {**BASE["regions"], "decode_streamed": {"total": 10, "core": 8}}}
    _, failures = icount.gate(_run(1000, 800), base, 0.02)
    assert failures == ["decode_streamed: in the baseline, not counted by this run"]


def test_baseline_matches_the_regions_counted():
    """The committed baseline has a count for every region the script counts, and no other,
    the prefetched decodes (where dropped prefetches show) among them."""
    import json
    import re

    counted = re.findall(r'^    \("(\w+)", "', icount.CHILD, flags=re.M)
    base = json.loads(icount.BASELINE.read_text())
    assert sorted(counted) == sorted(base["regions"])
    assert {"decode_streamed", "decode_paged", "prefill", "prefill_causal"} <= set(counted)
    assert all(r["total"] > 0 and r["core"] > 0 for r in base["regions"].values())
