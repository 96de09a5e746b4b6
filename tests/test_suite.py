"""The suite's own arrangements hold: tests of one xdist group share one worker."""

import pytest


@pytest.mark.xdist_group("suite")
def test_xdist_groups_reach_the_scheduler(request):
    """``make test`` runs ``--dist loadgroup``: pytest-xdist appends each test's group to its
    id, and the scheduler keeps a group on one worker. A pytest whose ids drop that suffix
    (9.2 with pytest-xdist 3.8) spreads every group over both workers: module fixtures made
    twice, multi-process runs on top of each other."""
    if not getattr(request.config.option, "loadgroup", False):  # set on xdist's workers
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@suite"), request.node.nodeid


@pytest.fixture(scope="module")
def module_fixture():
    return object()


def test_tests_of_a_module_fixture_share_one_worker(request, module_fixture):
    """A test that uses a module-scoped fixture joins its module's xdist group (conftest's
    ``pytest_itemcollected``), so the fixture is made on one worker only."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@tests.test_suite"), request.node.nodeid
