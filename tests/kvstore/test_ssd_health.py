"""SSD tier faults: write errors injected at the system calls (ENOSPC on pwrite, EROFS on create, EIO on
fsync and pread) are counted by cause and logged once per state change, recoveries included; admission
refusals apart from I/O failures; the start-up scan summary; private file modes whatever the umask."""

import errno
import logging
import os
import stat

import pytest

from flashtier.kvstore.ssd.health import ADMISSION_QUIET_S
from flashtier.kvstore.ssd.store import PutResult, SSDStore

from .ssd_store_support import (  # noqa: F401 - clock and open_store are fixtures
    LIFETIME,
    REC,
    T0,
    clock,
    config,
    flip,
    key,
    open_store,
    payload,
    put_all,
    seg_files,
)

SSD_LOG = "flashtier.kvstore.ssd"


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == SSD_LOG and r.levelno == logging.WARNING]


def failing(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def put_many(store, keys):
    return [store.put(k, payload(k)) for k in keys]


def test_write_faults_are_counted_by_cause_and_said_once_per_change(open_store, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=SSD_LOG)
    s = open_store(budget=100 * REC)
    assert put_all(s, [key(0)]) == [PutResult.STORED]
    real_open, real_pwrite, real_fsync = os.open, os.pwrite, os.fsync

    monkeypatch.setattr(os, "pwrite", failing(errno.ENOSPC))
    assert put_many(s, [key(i) for i in range(1, 6)]) == [PutResult.FAILED] * 5
    assert s.flush()  # nothing new to make durable
    assert [w.split(": ", 1)[1][:9] for w in warnings(caplog)] == ["disk full"]

    monkeypatch.setattr(os, "pwrite", real_pwrite)
    read_only = failing(errno.EROFS)
    monkeypatch.setattr(os, "open", lambda p, flags, *a: (read_only if flags & os.O_CREAT else real_open)(p, flags, *a))
    assert len(seg_files(s)) == 1  # a clean ENOSPC kept the segment: no empty file per failed write
    assert put_many(s, [key(i) for i in range(20, 23)]) == [PutResult.STORED] * 3  # fills segment 1
    assert put_many(s, [key(i) for i in range(6, 9)]) == [PutResult.FAILED] * 3  # each tries a new segment

    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "fsync", failing(errno.EIO))
    assert put_many(s, [key(9)]) == [PutResult.STORED]
    assert not s.flush()  # the fsyncs of segments 1 and 2 and of the directory fail
    st = s.stats()
    assert (st.write_errors_disk_full, st.write_errors_unwritable, st.write_errors_io, st.write_errors) == (5, 3, 3, 11)
    assert st.admission_refusals == 0 and st.read_errors == 0

    monkeypatch.setattr(os, "fsync", real_fsync)
    assert put_all(s, [key(10), key(11)]) == [PutResult.STORED] * 2
    assert put_all(s, [key(12)]) == [PutResult.STORED]  # ok stays ok: nothing more to say
    said = warnings(caplog)
    assert len(said) == 4, said
    assert "disk full (append failed" in said[0] and "No space left" in said[0]
    assert "directory not writable (create failed" in said[1]
    assert "write I/O error (fsync failed" in said[2]
    assert "writes recovered after 3 failed writes (write I/O error)" in said[3]
    assert s.get_many([key(0), key(3), key(7), key(22), key(11)]) == [payload(key(0)), None, None, payload(key(22)),
                                                                        payload(key(11))]  # fmt: skip
    s.check_integrity(deep=True)


def test_refusals_are_not_io_failures_and_are_said_once(open_store, clock, caplog):
    caplog.set_level(logging.INFO, logger=SSD_LOG)
    s = open_store()  # 12 records fit: three segments of 4, written 10 s apart
    for seg in range(3):
        assert put_all(s, [key(4 * seg + i) for i in range(4)]) == [PutResult.STORED] * 4
        clock.advance(10)
    clock.t = T0 + LIFETIME - 1
    assert put_many(s, [key(100), key(101), key(102)]) == [PutResult.REFUSED] * 3
    clock.t = T0 + LIFETIME  # the first segment expired: 4 writes fit, the 5th is refused again
    assert put_many(s, [key(i) for i in range(100, 105)]) == [PutResult.STORED] * 4 + [PutResult.REFUSED]
    assert len(warnings(caplog)) == 1  # saturated all along: no "admitted" / "refused" flapping
    clock.advance(10 + ADMISSION_QUIET_S)  # the second segment expired; a minute without a refusal
    assert put_many(s, [key(200), key(201)]) == [PutResult.STORED] * 2
    st = s.stats()
    assert (st.admission_refusals, st.write_errors, st.read_errors) == (4, 0, 0)
    said = warnings(caplog)
    assert len(said) == 2 and "budget is full of records inside their lifetime" in said[0]
    assert "writes are admitted again (no refusal for 70 s)" in said[1]


def test_read_errors_are_misses_counted_and_said_once(open_store, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=SSD_LOG)
    s = open_store()
    keys = [key(i) for i in range(3)]
    put_all(s, keys)
    real_pread, real_preadv = os.pread, os.preadv
    monkeypatch.setattr(os, "pread", failing(errno.EIO))
    monkeypatch.setattr(os, "preadv", failing(errno.EIO))  # get_many reads with preadv
    assert s.get_many(keys) == [None] * 3 and s.get(keys[0]) is None  # one coalesced pread, then one more
    monkeypatch.setattr(os, "pread", real_pread)
    monkeypatch.setattr(os, "preadv", real_preadv)
    assert s.get_many(keys) == [payload(k) for k in keys]
    st = s.stats()
    assert (st.read_errors, st.misses, st.hits, st.write_errors, st.corrupt_records) == (2, 4, 3, 0, 0)
    said = warnings(caplog)
    assert len(said) == 2 and "read I/O error" in said[0] and "reads recovered" in said[1]


def test_start_up_logs_one_scan_summary(open_store, clock, tmp_path, caplog):
    s = open_store()
    keys = [key(i) for i in range(8)]  # two full segments of 4 records
    put_all(s, keys)
    flip(s, keys[5], 0)  # the magic of the second record of segment 2: a corrupt header
    s.close()
    with open(s.segment_path(2), "ab") as f:
        f.write(bytes(30))  # zero fill: a torn tail
    clock.advance(100.0)
    caplog.set_level(logging.INFO, logger=SSD_LOG)
    caplog.clear()  # only the re-open's lines
    s2 = open_store()
    lines = [r for r in caplog.records if r.name == SSD_LOG]
    assert [r.levelname for r in lines] == ["INFO"]
    text = lines[0].getMessage()
    assert text.startswith(f"SSD tier {tmp_path / 'ssd'}: 2 segments, 7 entries, 830 B on disk (700 B live); ")
    assert "scan dropped 30 torn bytes and 1 corrupt records; oldest entry 100 s old" in text
    st = s2.stats()
    assert (st.torn_bytes, st.corrupt_records, st.entries, st.oldest_entry_age_s) == (30, 1, 7, 100.0)


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o377])
def test_files_are_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with SSDStore(config(tmp_path)) as s:
            assert put_all(s, [key(i) for i in range(5)]) == [PutResult.STORED] * 5  # two segments
    finally:
        os.umask(old)
    ssd = tmp_path / "ssd"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ssd.iterdir()}
    assert stat.S_IMODE(ssd.stat().st_mode) == 0o700
    assert modes == {"LOCK": 0o600, "000000000001.seg": 0o600, "000000000002.seg": 0o600}


def test_an_existing_directory_keeps_its_mode_with_a_warning(tmp_path, caplog):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    os.chmod(ssd, 0o755)
    caplog.set_level(logging.INFO, logger=SSD_LOG)
    with SSDStore(config(tmp_path)):
        pass
    assert stat.S_IMODE(ssd.stat().st_mode) == 0o755
    assert stat.S_IMODE((ssd / "LOCK").stat().st_mode) == 0o600
    said = warnings(caplog)
    assert len(said) == 1 and "directory mode is 755" in said[0]
