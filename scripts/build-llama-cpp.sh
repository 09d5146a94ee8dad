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
if [ -x "$BUILD/bin/llama-server" ] && [ -f "$BUILD/bin/libllama.so" ] && grep -q "GGML_NATIVE:BOOL=OFF" "$BUILD/CMakeCache.txt"; then
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
# Not -march=native: this VM advertises AMX, but its first tile instruction (ldtilecfg) dies
# with SIGILL, and GGML_NATIVE turns on ggml's AMX kernels. Everything else the CPU has is on.
avx512=OFF
grep -q avx512_vnni /proc/cpuinfo && avx512=ON
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512="$avx512" -DGGML_AVX512_VNNI="$avx512" -DGGML_AVX512_VBMI="$avx512" -DGGML_AVX512_BF16="$avx512" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
cmake --build "$BUILD" -j "$(nproc)" --target llama-server llama-bench llama
ls "$BUILD/bin"
