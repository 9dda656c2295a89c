"""`--dist loadgroup` for pytest 9: `@pytest.mark.xdist_group(NAME)` puts a module's tests that share an expensive
module-scoped fixture on one xdist worker, so the fixture is made once. pytest-xdist (3.8) marks them by appending
`@NAME` to `item._nodeid`, which pytest 9 no longer reads (a node's id is `item._id`): every group was ignored and each
such fixture made on both workers (the sweep's grid twice, 110 s each). This hook appends the group to the id pytest
reads, once, where xdist has not (a later xdist that does it itself leaves nothing to do here)."""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):  # set by xdist on its workers under --dist loadgroup
        return
    try:
        from _pytest.nodes import coerce_node_id  # pytest 9's, where the id lives
    except ImportError:  # pytest 8: item._nodeid is the id, and xdist's own marking works
        return

    for item in items:
        names = sorted({m.args[0] if m.args else m.kwargs.get("name", "default")
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
