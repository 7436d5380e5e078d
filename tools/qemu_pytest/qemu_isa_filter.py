"""pytest plugin (-p qemu_isa_filter): with PYATTN_QEMU_DROP_ISA_PARAM=1, deselect the tests parametrized by
conftest's `isa` fixture. That fixture switches the kernel set in-process (_core.set_isa) for each
of generic and neon, so those tests run identically whatever PYATTN_ISA says; the PYATTN_ISA=generic
pass then runs only the tests that use the default dispatch."""

import os


def _drop_isa(config, items):
    if os.environ.get("PYATTN_QEMU_DROP_ISA_PARAM") != "1":
        return
    keep, drop = [], []
    for it in items:
        cs = getattr(it, "callspec", None)
        (drop if cs is not None and "isa" in cs.params else keep).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):  # noqa: F811 - second hook impl, runs last
    """PYATTN_QEMU_SLICE=start:stop:step keeps items[start:stop:step] of the (collection-ordered) items: a
    deterministic subset for files too slow to run whole under qemu."""
    _drop_isa(config, items)
    sl = os.environ.get("PYATTN_QEMU_SLICE")
    if not sl:
        return
    a = [int(x) if x else None for x in (sl.split(":") + ["", ""])[:3]]
    keep = items[slice(*a)]
    ids = {id(i) for i in keep}
    drop = [i for i in items if id(i) not in ids]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
