#!/usr/bin/env bash
# Builds llama.cpp (the anchor of the engine's cpu backend) from the source vendored in the
# llama-cpp-python sdist, into .cache/llama.cpp — never into the repository. Idempotent.
# Gives: .cache/llama.cpp/build/bin/{llama-server,llama-bench,libllama.so} and the sdist's
# pure-Python `llama_cpp` package (used with LLAMA_CPP_LIB_PATH by the fixture script).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DIR="$PWD/.cache/llama.cpp"
SRC="$DIR/llama_cpp_python-$VERSION"
BUILD="$DIR/build"
if [ -x "$BUILD/bin/llama-server" ] && [ -f "$BUILD/bin/libllama.so" ]; then
  echo "llama.cpp already built in $BUILD"
  exit 0
fi
mkdir -p "$DIR"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
  python3 -m pip download --quiet --no-deps --no-build-isolation --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$DIR" || python3 -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$DIR"
  tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi
command -v cmake >/dev/null || scripts/setup.sh
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$BUILD" -j "$(nproc)" --target llama-server llama-bench llama
ls "$BUILD/bin"
