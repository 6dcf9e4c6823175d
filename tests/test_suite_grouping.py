"""The default run's `--dist loadgroup` (Makefile) keeps each `xdist_group` in one worker
process, so fits and launches cached per process are made once; pytest-xdist does that by
suffixing a grouped test's node id with ``@<group>``, and a pytest that ignores the suffix
scatters the groups silently."""

import pytest


@pytest.mark.xdist_group("grouping_check")
def test_a_grouped_test_carries_its_group_under_loadgroup(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run with pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@grouping_check"), request.node.nodeid
