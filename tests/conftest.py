"""Shared pytest configuration for the pyattn test suite.

* ``isa`` fixture: parametrized over the SIMD kernels this CPU can run
  (``pyattn._core.available_isas()``), so every parity test runs once per path.
* hypothesis profile: few examples, no deadline, derandomized (fixed seeds).
  Set ``PYATTN_HYPOTHESIS_PROFILE=thorough`` for a longer, random run.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

# Make tests/_helpers.py importable whatever pytest's import mode is.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci",
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.register_profile(
        "thorough",
        max_examples=500,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.load_profile(os.environ.get("PYATTN_HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


from _helpers import ISAS  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_blas_thread():
    """One BLAS thread for NumPy (the reference's matmuls) beside pyattn's OpenMP team: on 2
    cores, the two spinning pools made whole modules up to 3x slower. Needs threadpoolctl (in the
    test extra); without it nothing changes."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(params=ISAS)
def isa(request):
    """Switch pyattn to one SIMD kernel for the duration of a test, then restore it."""
    name = request.param
    if name == "default":
        yield name
        return
    from pyattn import _core

    old = _core.isa()
    _core.set_isa(name)
    try:
        assert _core.isa() == name
        yield name
    finally:
        _core.set_isa(old)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id: fixed, but different per test."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
