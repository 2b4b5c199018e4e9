"""ctxext.tasks without running lm-eval: the cell cache keeps the names task cells always had, and building a
task turns only what lm-eval's builders raise into a one-line error."""

import hashlib
import json

import pytest

from ctxext.errors import CtxextError

pytest.importorskip("lm_eval")

from ctxext.tasks.harness import TaskCellCache, TaskSpec, check_task_data  # noqa: E402


def test_task_cells_keep_their_file_names_and_format(tmp_path):
    key = {"model": {"path": "/m", "files_sha256": "ab"}, "method": {"method": "yarn", "factor": 2.0}, "length": 4096}
    # The name every task cell has had: the first 20 hex digits of the sha256 of the sorted JSON key.
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    cache = TaskCellCache(tmp_path)
    assert cache.path(key) == tmp_path / f"{name}.json"
    # A cell written by the old cache (one JSON object, no indentation) is read back.
    (tmp_path / f"{name}.json").write_text(json.dumps({"key": key, "result": {"results": {"t": {"acc,none": 1.0}}}}))
    assert cache.load(key) == {"results": {"t": {"acc,none": 1.0}}}
    assert cache.load({**key, "length": 8192}) is None
    cache.save({**key, "length": 8192}, {"results": {}})
    assert cache.load({**key, "length": 8192}) == {"results": {}}
    assert cache.requests_path(key) == str(tmp_path / "requests" / name)


class _Manager:
    def __init__(self, error):
        self.error = error

    def load(self, names):
        raise self.error


def test_what_lm_eval_raises_is_one_line_and_a_bug_surfaces():
    spec = TaskSpec("niah_single_1", "ruler")
    with pytest.raises(CtxextError, match="lm-eval could not build task 'niah_single_1' at length 4096: ValueError"):
        check_task_data(spec, _Manager(ValueError("bad config")), 4096)
    with pytest.raises(CtxextError, match="needs data that could not be fetched"):
        check_task_data(spec, _Manager(ConnectionError("no network")), 4096)
    with pytest.raises(ZeroDivisionError):
        check_task_data(spec, _Manager(ZeroDivisionError("a bug")), 4096)
