#!/usr/bin/env bash
# Build llama.cpp's command-line tools once per machine, from the source vendored in the pinned llama-cpp-python
# sdist (PyPI is the only network we may use), into a cache directory that later runs reuse.
#
#   scripts/build_llama_cpp.sh            -> prints the bin directory
#   SPECQUANT_CACHE=/somewhere  ...       -> cache root (default ~/.cache/specquant)
#   LLAMA_CPP_JOBS=N                      -> parallel compile jobs (default: number of cores)
#
# CPU-only build with native flags (the binaries serve this machine). Static libraries, so the bin directory is
# self-contained. The build goes to a temporary directory and is renamed into place only when every tool built,
# so an interrupted build never leaves a half cache behind.
set -euo pipefail

VERSION=0.3.36
CACHE_ROOT=${SPECQUANT_CACHE:-$HOME/.cache/specquant}
DEST="$CACHE_ROOT/llama.cpp-$VERSION"
# llama-completion: the plain generation loop (greedy at --temp 0), the target-alone row of the bench
TOOLS=(llama-bench llama-speculative-simple llama-perplexity llama-quantize llama-imatrix llama-server llama-tokenize
       llama-completion)

have_all() {
  for t in "${TOOLS[@]}"; do [ -x "$DEST/bin/$t" ] || return 1; done
}

if have_all; then
  echo "$DEST/bin"
  exit 0
fi

for tool in cmake g++ make; do
  command -v "$tool" >/dev/null || { echo "build_llama_cpp.sh: '$tool' not found; install it (e.g. apt-get install cmake g++ make)" >&2; exit 1; }
done
PY=${PYTHON:-python3}
JOBS=${LLAMA_CPP_JOBS:-$(nproc)}

mkdir -p "$CACHE_ROOT"
WORK=$(mktemp -d "$CACHE_ROOT/.llama.cpp-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

SDIST="$CACHE_ROOT/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$WORK/dl" >&2
  mv "$WORK/dl/llama_cpp_python-$VERSION.tar.gz" "$SDIST"
fi
tar xzf "$SDIST" -C "$WORK" "llama_cpp_python-$VERSION/vendor/llama.cpp"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

start=$(date +%s)
LOG="$CACHE_ROOT/llama.cpp-$VERSION-build.log"
echo "build_llama_cpp.sh: building llama.cpp ($VERSION sdist) with $JOBS jobs, log in $LOG" >&2
if ! { cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
         -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
         -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON &&
       cmake --build "$WORK/build" --config Release -j "$JOBS" --target "${TOOLS[@]}"; } >"$LOG" 2>&1; then
  tail -n 30 "$LOG" >&2
  echo "build_llama_cpp.sh: build failed; full log in $LOG" >&2
  exit 1
fi
echo "build_llama_cpp.sh: built in $(( $(date +%s) - start )) s" >&2

mkdir -p "$WORK/out/bin"
for t in "${TOOLS[@]}"; do cp "$WORK/build/bin/$t" "$WORK/out/bin/"; done
echo "llama-cpp-python $VERSION (vendored llama.cpp), built $(date -u +%FT%TZ) on $(uname -m)" > "$WORK/out/BUILD_INFO"
rm -rf "$DEST"
mv "$WORK/out" "$DEST"
echo "$DEST/bin"
