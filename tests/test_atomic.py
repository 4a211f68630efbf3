"""Atomic writes: complete file or none, and the umask's mode rather than mkstemp's 0600."""

import os
import stat

import pytest

from runtime.utils.atomic import atomic_path, atomic_write_text, umask_mode

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast


def test_written_file_gets_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        target = atomic_write_text(tmp_path / "a.json", "{}\n")
        assert stat.S_IMODE(target.stat().st_mode) == 0o644 == umask_mode()
    finally:
        os.umask(old)
    assert target.read_text() == "{}\n"


def test_failure_leaves_old_file_and_no_temp(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
