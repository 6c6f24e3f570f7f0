#!/usr/bin/env bash
# Build SuffixDecoding's drafter (arctic-inference 0.3.0, Apache-2.0) for the bench only:
# the standalone C++ suffix tree (csrc/suffix_decoding, nanobind) and its Python driver
# (arctic_inference/suffix_decoding/cache.py), nothing else of arctic-inference.
# Output: $PREFIX/arctic_inference/suffix_decoding/{_C*.so, cache.py, ...}; put $PREFIX on
# PYTHONPATH (bench/suffix_replay.py --peer-dir does). Never a dependency of the library.
#
#   bash bench/peers/build_suffix_decoding.sh [PREFIX]     # default /tmp/suffix-decoding-peer
# Needs: curl, cmake >= 3.18, a C++20 compiler, pip (installs nanobind into $PREFIX/pydeps).
set -euo pipefail
PREFIX=${1:-/tmp/suffix-decoding-peer}
VERSION=0.3.0
URL=https://files.pythonhosted.org/packages/63/c1/573fa2f00097cd9cc1167b31fd900b2482f58f3491867cebdd5516626533/arctic_inference-${VERSION}.tar.gz
SHA256=7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36
PY=${PYTHON:-python}
mkdir -p "$PREFIX"
cd "$PREFIX"
SDIST=arctic_inference-${VERSION}.tar.gz
[ -f "$SDIST" ] || curl -sSfL --max-time 120 -o "$SDIST" "$URL"
echo "$SHA256  $SDIST" | sha256sum -c -
rm -rf src && mkdir src && tar xzf "$SDIST" -C src --strip-components=1 \
  arctic_inference-${VERSION}/csrc/suffix_decoding arctic_inference-${VERSION}/arctic_inference/suffix_decoding
"$PY" -m pip install --quiet --target "$PREFIX/pydeps" 'nanobind>=2.0'
export PYTHONPATH="$PREFIX/pydeps${PYTHONPATH:+:$PYTHONPATH}"
cmake -S src/csrc/suffix_decoding -B build -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")"
cmake --build build -j "${JOBS:-2}"
mkdir -p arctic_inference/suffix_decoding
touch arctic_inference/__init__.py
cp src/arctic_inference/suffix_decoding/*.py arctic_inference/suffix_decoding/
cp build/_C*.so arctic_inference/suffix_decoding/
PYTHONPATH="$PREFIX" "$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('ok', SuffixDecodingCache)"
