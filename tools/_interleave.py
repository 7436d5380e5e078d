"""The timing loop the tools' one-process A/Bs share: each call once untimed, then every call in
turn, round after round, for `seconds`, so that a noisy machine moves them all alike."""

from __future__ import annotations

import time
from typing import Callable


def interleaved(fs: dict[str, Callable[[], object]], seconds: float) -> dict[str, list[float]]:
    """{name: the seconds of each timed call of fs[name]}, the calls interleaved round by round."""
    ts: dict[str, list[float]] = {n: [] for n in fs}
    for f in fs.values():
        f()
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        for n, f in fs.items():
            t0 = time.perf_counter()
            f()
            ts[n].append(time.perf_counter() - t0)
    return ts
