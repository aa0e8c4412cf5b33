"""The rerun of a `server` test after tritonserver 2.51's own abort (rerun_on_upstream_abort.py): only then, once."""
import os

import pytest

pytestmark = pytest.mark.unit

TESTS = '''
import pytest

pytestmark = pytest.mark.server
runs = {"aborted once": 0}
ABORT = "terminate called after throwing an instance of 'boost::interprocess::lock_exception'"


def test_aborted_once(tmp_path):
    runs["aborted once"] += 1
    if runs["aborted once"] == 1:
        (tmp_path / "server.log").write_text(ABORT)
        assert False, "Stream removed"


def test_aborted_every_time(tmp_path):
    (tmp_path / "server.log").write_text(ABORT)
    assert False, "aborted again"


def test_fails_without_an_abort(tmp_path):
    (tmp_path / "server.log").write_text("I1125 ... successfully loaded 'llm'")
    assert False, "a failure of ours"
'''


def test_only_a_failure_with_the_upstream_abort_in_a_log_is_run_again_and_only_once(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    pytester.makeini("[pytest]\nmarkers =\n    server: starts a tritonserver\n")
    pytester.makepyfile(test_served=TESTS)
    result = pytester.runpytest_subprocess("-p", "rerun_on_upstream_abort")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*run again after tritonserver 2.51's own abort*",
                                 "test_served.py::test_aborted_once: *Stream removed*",
                                 "test_served.py::test_aborted_every_time: *aborted again*"])
    assert "test_fails_without_an_abort:" not in result.stdout.str()
