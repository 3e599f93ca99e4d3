"""``flashtier plan`` (serve's command line, the memory plan printed) and serve's refusal of a plan that does not fit:
one line naming the flag, exit status 2, before anything loads."""

from __future__ import annotations

import json

import pytest

from flashtier.server.cli import main


def test_plan_prints_the_table_and_fits(capsys):
    rc = main(["plan", "--preset", "tiny", "--device", "cpu", "--host-memory", "64GiB", "--no-kv-persist"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("memory plan: tiny (preset tiny), cpu float32")
    assert "routed experts" in out and "KV pool" in out and "DOES NOT FIT" not in out


def test_plan_json_for_a_gpu_size(capsys):
    rc = main(["plan", "--preset", "tiny", "--gpu-memory", "1GiB", "--host-memory", "64GiB", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 1 and plan["fits"] is False  # the CUDA runtime estimate alone is 1 GiB
    assert plan["device_type"] == "cuda" and plan["misfit"]["flag"] == "--tensor-parallel-size"
    assert plan["ranks"][0]["need"] > plan["gpu_memory"] == 1 << 30


@pytest.mark.parametrize("blocks", ["100", str(10**12)], ids=["fits", "too-many-blocks"])
def test_serve_refuses_a_plan_that_does_not_fit(capsys, blocks):
    """On the CPU only host memory is checked: 10^12 blocks of the tiny layout (8,480 B each) need ~7.7 PiB, refused
    with one line naming --num-blocks and exit 2 before the app starts; 100 blocks fit (checked with ``plan``, which
    runs the same evaluation and exits 0)."""
    if blocks == "100":
        rc = main(["plan", "--preset", "tiny", "--device", "cpu", "--num-blocks", blocks, "--no-kv-persist"])
        assert rc == 0
        return
    rc = main(["serve", "--preset", "tiny", "--device", "cpu", "--num-blocks", blocks, "--no-kv-persist"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1
    assert err[0].startswith(f"flashtier: error: --num-blocks {blocks}: the memory plan needs ")
    assert err[0].endswith("; lower --num-blocks")
