"""The ``flashtier`` command line: inspect (roles + KV accounting) and generate."""

import json
import os
import subprocess
import sys

import pytest

from flashtier.server.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    # one torch thread: on 2 shared cores a second intra-op thread spins (70 s instead of 20 s per run)
    return subprocess.run([sys.executable, "-m", "flashtier.server.cli", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_inspect_real_geometry_json():
    proc = _run("inspect", "--preset", "v4.1-flash", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    kv = data["kv"]
    assert kv["global_bytes_per_token"] == 890
    assert kv["swa_bytes_per_slot"] == 528
    assert kv["swa_bytes_per_sequence"] == 40 * 128 * 528
    assert kv["snapshot_bytes"] == 20 * 128 * 528 + 3 * 2 * 512 * 4 + 128 * 4 * (5120 + 1) * 4  # + replay tail
    layers = data["layers"]
    assert len(layers) == 40 and layers[0] == {"index": 0, "part": "encoder", "role": "swa", "ratio": 0}
    roles = {row["index"]: (row["part"], row["role"], row["ratio"]) for row in layers}
    assert roles[2] == ("encoder", "full", 2) and roles[7] == ("encoder", "reuse", 2)
    assert roles[20] == ("decoder", "full", 1) and roles[24] == ("decoder", "reindex", 1)
    assert roles[39] == ("decoder", "reuse", 1) and roles[19] == ("encoder", "reuse", 2)


def test_inspect_reads_a_model_dir_config(tmp_path, capsys):
    from flashtier.engine.model.config import preset

    (tmp_path / "config.json").write_text(json.dumps({"text_config": preset("v4.1-flash").to_hf_dict()}))
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"]["global_bytes_per_token"] == 890


def test_inspect_unknown_preset_is_a_clear_error(capsys):
    assert main(["inspect", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_generate_tiny_is_deterministic():
    """Seeded sampling (greedy would be deterministic with any seed handling): two runs, the same text."""
    args = ("generate", "--preset", "tiny", "--prompt", "Hello, world", "--max-tokens", "8",
            "--temperature", "0.8", "--seed", "3")
    a, b = _run(*args), _run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_serve_setting_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """In-process: a bad setting found after parsing (SettingsError) is one line and status 2, before any engine."""
    monkeypatch.setenv("FLASHTIER_CACHE_DIR", str(tmp_path))
    (tmp_path / "file").write_text("x")
    built = []
    assert main(["serve", "--kv-dir", str(tmp_path / "file")], engine_factory=built.append) == 2
    err = capsys.readouterr().err
    assert err == (f"flashtier: error: --kv-dir {tmp_path / 'file'}: is a file, not a directory; pass a directory "
                   "(it is created when missing), or run without the SSD tier: --no-kv-persist\n")
    assert not built
    with pytest.raises(SystemExit) as info:
        main(["serve", "--no-such-flag"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "flashtier: error: unrecognized arguments: --no-such-flag\n"
