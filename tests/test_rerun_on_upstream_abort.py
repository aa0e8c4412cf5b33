"""The rerun of a `server` test after tritonserver 2.51's own abort (rerun_on_upstream_abort.py): only then, once."""
import os

import pytest

pytestmark = pytest.mark.unit

TESTS = '''
import pytest

pytestmark = pytest.mark.server
runs = {"aborted once": 0}
ABORT = "terminate called after throwing an instance of 'boost::interprocess::lock_exception'"


def test_fails_without_an_abort(tmp_path):
    (tmp_path / "server.log").write_text("I1125 ... successfully loaded 'llm'")
    assert False, "a failure of ours"


def test_aborted_once(tmp_path):
    runs["aborted once"] += 1
    if runs["aborted once"] == 1:
        (tmp_path / "server.log").write_text(ABORT)
        assert False, "Stream removed"


def test_aborted_every_time(tmp_path):
    (tmp_path / "server.log").write_text(ABORT)
    assert False, "aborted again"


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """A stand-in for a module's tritonserver: alive until it aborts."""
    server = {"log": tmp_path_factory.mktemp("module_server") / "server.log", "alive": True}
    server["log"].write_text("I1125 ... started")
    return server


def test_module_server_aborts_after_its_answer(module_server):
    if runs.setdefault("module", 0) == 0:
        runs["module"] = 1
        with open(module_server["log"], "a") as f:
            f.write(ABORT)
        module_server["alive"] = False
    assert True


def test_module_server_serves_the_next_test(module_server):
    assert module_server["alive"], "Socket closed"


def test_module_server_serves_the_one_after(module_server):
    assert module_server["alive"], "Socket closed"
'''


def test_only_a_failure_with_the_upstream_abort_in_a_log_is_run_again_and_only_once(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    pytester.makeini("[pytest]\nmarkers =\n    server: starts a tritonserver\n")
    pytester.makepyfile(test_served=TESTS)
    result = pytester.runpytest_subprocess("-p", "rerun_on_upstream_abort")
    result.assert_outcomes(passed=4, failed=2)
    # The module's server died after a test that passed: the next test fails, runs again with a new one, and so
    # does the module's rest.
    result.stdout.fnmatch_lines(["*run again after tritonserver 2.51's own abort*",
                                 "test_served.py::test_aborted_once: *Stream removed*",
                                 "test_served.py::test_aborted_every_time: *aborted again*",
                                 "test_served.py::test_module_server_serves_the_next_test: *Socket closed*"])
    assert "test_fails_without_an_abort:" not in result.stdout.str()
