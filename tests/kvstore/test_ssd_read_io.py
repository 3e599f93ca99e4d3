"""preadv_full (scatter reads that resume short reads), prefetch (advice only) and ReadBuffers (reuse)."""

import os
import threading

import pytest

from flashtier.kvstore.ssd import read_io as ssd_read_io
from flashtier.kvstore.ssd.read_buffers import ReadBuffers
from flashtier.kvstore.ssd.read_io import prefetch, preadv_full

DATA = bytes(range(256)) * 40  # 10,240 B


@pytest.fixture
def fd(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    yield fd
    os.close(fd)


def views(*sizes):
    bufs = [bytearray(n) for n in sizes]
    return bufs, [memoryview(b) for b in bufs]


def test_scatter_fills_each_view_in_order(fd):
    bufs, vs = views(3, 0, 100, 1)
    assert preadv_full(fd, vs, 7) == 104
    assert b"".join(bufs) == DATA[7:111] and [len(b) for b in bufs] == [3, 0, 100, 1]


def test_end_of_file_returns_fewer_bytes(fd):
    bufs, vs = views(50, 50)
    assert preadv_full(fd, vs, len(DATA) - 60) == 60
    assert bytes(bufs[0]) == DATA[-60:-10] and bytes(bufs[1][:10]) == DATA[-10:] and bufs[1][10:] == bytes(40)
    assert preadv_full(fd, views(5)[1], len(DATA) + 5) == 0


def test_short_reads_are_resumed_mid_view(fd, monkeypatch):
    real, calls = os.preadv, []

    def trickle(f, vs, off):  # at most 7 bytes per call, into the first view, as an interrupted read could
        calls.append(len(vs))
        return real(f, [vs[0][:7]], off)

    monkeypatch.setattr(os, "preadv", trickle)
    bufs, vs = views(20, 9, 30)
    assert preadv_full(fd, vs, 1000) == 59
    assert b"".join(bufs) == DATA[1000:1059] and len(calls) > 5


def test_more_views_than_iov_max_take_several_calls(fd, monkeypatch):
    monkeypatch.setattr(ssd_read_io, "_IOV_MAX", 4)
    bufs, vs = views(*[3] * 11)
    assert preadv_full(fd, vs, 2) == 33 and b"".join(bufs) == DATA[2:35]


def test_errors_propagate(fd):
    with pytest.raises(OSError):
        preadv_full(-1, views(4)[1], 0)
    os.close(os.dup(fd))  # a valid fd stays valid
    prefetch(-1, 0, 10)  # advice on a bad descriptor is ignored, not raised
    prefetch(fd, 0, 0)
    prefetch(fd, 100, 1000)


def test_read_buffers_are_reused_and_capped():
    pool = ReadBuffers(64, keep=1)
    with pool.lease() as a:
        a[:3] = b"abc"
        with pool.lease() as b:
            assert a is not b and len(b) == 64
    assert pool.idle == 1  # the second one given back was dropped
    with pool.lease() as c:
        assert c is b or c is a
        assert pool.idle == 0
    with pytest.raises(ValueError, match="size"):
        ReadBuffers(0)
    with pytest.raises(ValueError, match="keep"):
        ReadBuffers(8, keep=-1)


def test_read_buffers_are_never_shared_between_threads():
    pool, seen, lock = ReadBuffers(16, keep=2), [], threading.Lock()
    barrier = threading.Barrier(4)

    def lease():
        with pool.lease() as buf:
            barrier.wait(5)  # all four hold a buffer at once
            with lock:
                seen.append(id(buf))

    threads = [threading.Thread(target=lease) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(set(seen)) == 4 and pool.idle == 2
