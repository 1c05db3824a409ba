"""The session header's free-space line under the temporary directory (tests/conftest.py)."""

from __future__ import annotations

import shutil
from collections import namedtuple
from types import SimpleNamespace

from tests import conftest

Usage = namedtuple("Usage", "total used free")


def _config(basetemp=None):
    return SimpleNamespace(getoption=lambda name, default=None: basetemp if name == "basetemp" else default)


def test_a_disk_with_room_gets_one_line_naming_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * 2**30, 20 * 2**30, 80 * 2**30))
    lines = conftest.pytest_report_header(_config(str(tmp_path / "not-made-yet")))
    assert lines == [
        f"temporary directory: {tmp_path / 'not-made-yet'}, 80.0 GiB free "
        f"(a whole run holds up to {conftest.PEAK_TMP_GIB} GiB)"
    ]


def test_a_short_disk_gets_a_warning_that_says_what_to_do(tmp_path, monkeypatch):
    free = conftest.PEAK_TMP_GIB * 2**30  # enough for the peak alone, not twice it
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * 2**30, 100 * 2**30 - free, free))
    lines = conftest.pytest_report_header(_config(str(tmp_path)))
    assert len(lines) == 2
    assert lines[1].startswith(f"WARNING: {tmp_path} has {conftest.PEAK_TMP_GIB:.1f} GiB free")
    assert "--basetemp" in lines[1] and "No space left on device" in lines[1]


def test_the_real_disk_is_measured_where_the_directory_will_be(tmp_path):
    (line, *_) = conftest.pytest_report_header(_config(str(tmp_path / "a" / "b")))
    free_gib = shutil.disk_usage(tmp_path).free / 2**30
    reported = float(line.split(", ")[1].split(" GiB")[0])
    assert abs(reported - free_gib) < 1.0  # other tests write meanwhile
