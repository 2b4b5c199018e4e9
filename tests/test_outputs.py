"""The one I/O module: atomic files and directories, the overwrite marker, the cell cache, the content fingerprint."""

import hashlib
import json
import os
import stat

import pytest

from ctxext.errors import CtxextError
from ctxext.outputs import (
    MARKER,
    CellCache,
    atomic_file,
    atomic_output_dir,
    atomic_write_text,
    check_output_dir,
    write_json,
)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "results.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError), atomic_file(target) as staging:
        staging.write_text("half")
        raise RuntimeError("interrupted")
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    with pytest.raises(ValueError):  # NaN is refused before anything is written
        write_json(target, {"v": float("nan")})
    assert json.loads(target.read_text()) == {"v": 1}


def test_new_files_and_directories_follow_the_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        with atomic_output_dir(tmp_path / "out") as staging:
            (staging / "f").write_text("y")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750


def test_overwrite_replaces_only_what_ctxext_wrote(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(out) as staging:
        (staging / "first.txt").write_text("1")
    assert (out / MARKER).is_file()
    with pytest.raises(CtxextError, match="use --overwrite"):
        check_output_dir(out)
    with atomic_output_dir(out, overwrite=True) as staging:
        (staging / "second.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "second.txt"])

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(CtxextError, match="not written by ctxext"), atomic_output_dir(foreign, overwrite=True):
        pass
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "out"]  # no staging directory left behind


def test_cell_names_are_the_sha256_of_the_sorted_key(tmp_path):
    # The oracle: the naming rule written out by hand (it names the committed comparison cells and the task cells).
    cache = CellCache(tmp_path, {"model": "abc", "dtype": "bf16"}, digits=24)
    key = {"length": 16384, "config": {"method": "yarn", "factor": 2.0}, "keys": [(0.1, 12345)]}
    full = {"model": "abc", "dtype": "bf16", **key}
    expected = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:24]
    assert cache.get(key) is None
    record = cache.put(key, {"nll_sum": 1.5, "tokens": 3})
    assert cache.path(key).name == f"{expected}.json"
    assert cache.get(key) == record and record["nll_sum"] == 1.5
    assert cache.get({**key, "length": 32768}) is None
    other_context = CellCache(tmp_path, {"model": "xyz", "dtype": "bf16"})
    assert other_context.get(key) is None


def test_a_damaged_or_foreign_cell_is_computed_again(tmp_path):
    cache = CellCache(tmp_path)
    cache.put({"a": 1}, {"value": 2})
    path = cache.path({"a": 1})
    path.write_text("{not json")
    assert cache.get({"a": 1}) is None
    path.write_text(json.dumps({"key": {"a": 999}, "value": 2}))  # a file whose key is not the one asked for
    assert cache.get({"a": 1}) is None
    assert CellCache(None).put({"a": 1}, {"value": 2})["value"] == 2 and CellCache(None).get({"a": 1}) is None
