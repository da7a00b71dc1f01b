"""llama.cpp's command-line tools, built on first use into `${SPECQUANT_CACHE:-~/.cache/specquant}/llama.cpp-<v>/bin`.

Who needs them: `specquant bench --engine llama.cpp`, benchmarks/llama_cpp_quality.py and the llama.cpp tests
(`scripts/setup.sh --test` builds them up front); `find_tool` in export/llama_cpp.py builds them the first time one
is asked for. The main job (`specquant demo`) never does, so the plain setup does not build them.

Source: the llama.cpp vendored in the pinned llama-cpp-python sdist, fetched with `pip download` (PyPI is the only
network we may use) and kept beside the build. CPU-only with native flags (the binaries serve this machine), static
libraries so the bin directory is self-contained.

Why this is Python and not only a shell script: it ships inside the package, so a non-editable install finds it,
and it turns cmake's output into one progress line with an ETA (`Progress`).

Safe for concurrent processes: an exclusive lock beside the cache makes a second process wait for the first build
and then reuse it; the build runs in a temporary directory that is renamed into place only when every tool built,
so an interrupted build leaves no half cache. Nothing is deleted that this builder did not create: an existing
install directory is replaced only when its BUILD_INFO says a build wrote it.

    python -m specquant.export.llama_cpp_build [--jobs N]   # prints the bin directory (LLAMA_CPP_JOBS=N also works)
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.util.cpu import cpu_flags
from specquant.util.files import cache_root

VERSION = "0.3.36"  # llama-cpp-python sdist whose vendored llama.cpp is built; gguf-py in pyproject.toml matches it
# llama-completion: the plain generation loop (greedy at --temp 0), the target-alone row of the bench
TOOLS = ("llama-bench", "llama-speculative-simple", "llama-perplexity", "llama-quantize", "llama-imatrix",
         "llama-server", "llama-tokenize", "llama-completion")
# -O1 for the code no text request runs per token (arg parsing, chat templates, parsers, mtmd, the HTTP library): the
# file says what and why; what the bench and tests time stays -O3
LEAN_CMAKE = Path(__file__).with_name("llama_cpp_lean.cmake")
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", f"-DCMAKE_PROJECT_INCLUDE={LEAN_CMAKE}")
# On a CPU with AMX, -march=native compiles ggml's AMX matmul, and that one crashed (general protection fault in
# ggml_backend_amx_mul_mat) on prompts of two or more tokens through Q4_0 files (the test suite's models, hidden
# sizes 64 to 384: llama-bench pp, llama-completion, llama-perplexity, llama-speculative-simple) on an Intel Xeon
# with AMX-INT8 (Sapphire Rapids class), the 4B-shape file too, while an AMX tile multiply of our own ran right on that
# machine: llama.cpp issue 20824 ("segfault in ggml_backend_amx_mul_mat", machine-dependent, closed unfixed).
# There the build names the CPU's vector extensions one by one instead (GGML_NATIVE off) and leaves AMX out; it
# keeps every other kernel, the repacked Q4_0 GEMMs included. Other CPUs build with -march=native as before.
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
# /proc/cpuinfo flags -> ggml's CMake switch (ggml/src/ggml-cpu/CMakeLists.txt, the non-native x86 branch)
X86_SWITCHES = (("sse4_2", "GGML_SSE42"), ("f16c", "GGML_F16C"), ("fma", "GGML_FMA"), ("bmi2", "GGML_BMI2"),
                ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("avx_vnni", "GGML_AVX_VNNI"),
                ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                ("avx512_bf16", "GGML_AVX512_BF16"))
AVX512_BASE = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # what GGML_AVX512 compiles for


def cmake_options(flags: frozenset[str] | set[str] | None = None) -> tuple[tuple[str, ...], str]:
    """(the configure options, the install directory's suffix) for a CPU with these flags (AMX_FLAGS above)."""
    flags = (cpu_flags() or frozenset()) if flags is None else flags  # None: no /proc/cpuinfo, nothing assumed
    if not flags & set(AMX_FLAGS):
        return CMAKE_OPTIONS, ""
    switches = [f"-D{name}={'ON' if flag in flags else 'OFF'}" for flag, name in X86_SWITCHES]
    switches.append(f"-DGGML_AVX512={'ON' if all(f in flags for f in AVX512_BASE) else 'OFF'}")
    switches += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    options = tuple(o.replace("-DGGML_NATIVE=ON", "-DGGML_NATIVE=OFF") for o in CMAKE_OPTIONS)
    return options + tuple(switches), "-noamx"


BUILD_INFO = "BUILD_INFO"  # written last into every install directory: what says this builder made it
HOW = "`python -m specquant.export.llama_cpp_build` builds them"


def install_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / f"llama.cpp-{VERSION}{cmake_options()[1]}"


def missing_tools(bin_dir: Path) -> list[str]:
    return [t for t in TOOLS if not os.access(bin_dir / t, os.X_OK)]


def ensure_built(root: Path | None = None, jobs: int | None = None, stream=None) -> Path:
    """The bin directory holding every tool in TOOLS, built first (progress on `stream`, default stderr) when a
    tool is missing. Another process building at the same time is waited for, not raced."""
    root = root or cache_root()
    bin_dir = install_dir(root) / "bin"
    if not missing_tools(bin_dir):
        return bin_dir
    stream = stream or sys.stderr
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".llama.cpp-{VERSION}.lock", "w")
    except OSError as e:
        raise SpecquantError(f"llama.cpp cache {str(root)!r} cannot be written ({e.strerror}); set SPECQUANT_CACHE "
                             "to a writable directory") from e
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"llama.cpp: another process is building it into {root}; waiting for it", file=stream, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if missing_tools(bin_dir):  # the other process may have built it meanwhile
            build(root, jobs, stream)
    return bin_dir


def generator_options() -> tuple[str, ...]:
    """cmake's generator: Ninja when a `ninja` is found (beside this Python, e.g. the venv's from the `ninja` wheel
    that setup.sh installs, or on PATH), else cmake's default, Makefiles; a CMAKE_GENERATOR the user set is kept.
    Why Ninja: the same compile commands (same flags, same objects) finish sooner on few cores, because Ninja starts a
    target's objects while the libraries it links are still building, where Makefiles wait for them, so cores sit
    idle less often (docs/BENCH.md, "CI time")."""
    if os.environ.get("CMAKE_GENERATOR"):
        return ()
    ninja = shutil.which("ninja", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    return ("-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}") if ninja else ()


def check_build_tools() -> None:
    """One error naming the first missing build tool (a C++ compiler: $CXX, c++, g++ or clang++; make where no
    ninja is found)."""
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    runner = [] if generator_options() else [("make", ["make"])]
    for need, names in (("cmake", ["cmake"]), *runner, ("a C++ compiler", compilers)):
        if not any(shutil.which(n) for n in names):
            raise SpecquantError(f"building llama.cpp's tools needs {need} ({' or '.join(names)} not found on "
                                 "PATH); install it (e.g. apt-get install cmake g++, and make or `pip install "
                                 "ninja`), or pass --llama-cpp DIR holding prebuilt binaries")


def build(root: Path, jobs: int | None = None, stream=None) -> Path:
    """Download (once), configure and build TOOLS into install_dir(root); returns its bin directory. The caller
    holds the lock (ensure_built)."""
    stream = stream or sys.stderr
    check_build_tools()
    dest = install_dir(root)
    if dest.exists() and not (dest / BUILD_INFO).is_file():
        raise SpecquantError(f"{dest} exists but no llama.cpp build wrote it (no {BUILD_INFO}); move it away, or "
                             "set SPECQUANT_CACHE to another directory")
    jobs = jobs or _env_jobs() or len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix=".llama.cpp-build.", dir=root))
    try:
        src = _source(root, work, stream)
        log_path = root / f"llama.cpp-{VERSION}-build.log"
        print(f"llama.cpp: configuring {VERSION} (log in {log_path})", file=stream, flush=True)
        with open(log_path, "w") as log:
            options, flavour = cmake_options()
            if flavour:
                print("llama.cpp: this CPU has AMX; building without ggml's AMX matmul, which crashes here "
                      "(export/llama_cpp_build.py, AMX_FLAGS)", file=stream, flush=True)
            generator = generator_options()
            _run(["cmake", "-S", src, "-B", work / "build", *generator, *options], log, log_path, stream)
            progress = Progress(count_steps(work / "build", TOOLS), stream)
            runner = "ninja" if generator else os.environ.get("CMAKE_GENERATOR", "make")
            print(f"llama.cpp: building {len(TOOLS)} tools with {jobs} jobs ({runner})", file=stream, flush=True)
            _run(["cmake", "--build", work / "build", "--config", "Release", "-j", str(jobs), "--target", *TOOLS],
                 log, log_path, stream, progress.feed)
        progress.finish()
        out = work / "out"
        (out / "bin").mkdir(parents=True)
        for t in TOOLS:
            shutil.copy2(work / "build" / "bin" / t, out / "bin" / t)
        (out / BUILD_INFO).write_text(f"llama-cpp-python {VERSION} (vendored llama.cpp), built "
                                      f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {os.uname().machine}\n")
        _install(out, dest, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the temporary directory this call made, nothing else
    print(f"llama.cpp: tools in {dest / 'bin'}", file=stream, flush=True)
    return dest / "bin"


def _env_jobs() -> int | None:
    value = os.environ.get("LLAMA_CPP_JOBS")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise SpecquantError(f"LLAMA_CPP_JOBS={value!r} must be a positive integer (parallel compile jobs)")
    return int(value)


def _source(root: Path, work: Path, stream) -> Path:
    """The vendored llama.cpp tree, extracted under `work` from the cached sdist (downloaded first if absent)."""
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        print(f"llama.cpp: downloading the llama-cpp-python {VERSION} sdist from PyPI", file=stream, flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                               f"llama-cpp-python=={VERSION}", "-d", str(work / "dl")], capture_output=True, text=True)
        got = work / "dl" / sdist.name
        if proc.returncode or not got.is_file():
            why = (proc.stderr.strip().splitlines() or ["no file"])[-1]
            raise SpecquantError(f"pip download llama-cpp-python=={VERSION} failed ({why}); download {sdist.name} "
                                 f"from PyPI into {root} yourself, or pass --llama-cpp DIR holding prebuilt binaries")
        os.replace(got, sdist)  # same filesystem: the cache never holds a half download
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for member in tar:  # one pass over the gzip stream
            if member.name.startswith(prefix):
                tar.extract(member, work, **_SAFE)
    return work / prefix


def _refuse_unsafe(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's "data" filter for the Pythons before 3.11.4 that lack it: no absolute paths, nothing outside."""
    parts = Path(member.name).parts
    if member.name.startswith("/") or ".." in parts or member.isdev() or (
            (member.issym() or member.islnk()) and (member.linkname.startswith("/") or ".." in member.linkname)):
        raise SpecquantError(f"unsafe member {member.name!r} in the llama-cpp-python sdist; delete it and retry")
    return member


_SAFE = {"filter": "data" if hasattr(tarfile, "data_filter") else _refuse_unsafe}


def _run(cmd: list, log, log_path: Path, stream, on_line=None) -> None:
    """Run cmd with its output appended to `log`, each line also given to `on_line`; a failure raises with the
    log's tail on `stream`."""
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    # its own process group, so an interrupt here stops make and the compilers too, not only cmake
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    tail = []
    try:
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line])[-30:]
            if on_line:
                on_line(line)
    except BaseException:  # Ctrl-C: the caller removes the temporary directory once nothing writes into it
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    if proc.wait():
        log.flush()
        stream.write("".join(tail))
        raise SpecquantError(f"building llama.cpp failed ({Path(str(cmd[0])).name} exit {proc.returncode}); "
                             f"full log in {log_path}")


def _install(out: Path, dest: Path, work: Path) -> None:
    """Rename `out` to `dest`. An incomplete earlier build (BUILD_INFO checked by build()) is moved into `work`
    first, so it goes with the temporary directory."""
    if dest.exists():
        dest.rename(work / "old")
    out.rename(dest)


# --- progress ----------------------------------------------------------------------------------------------------

# Makefiles: "[ 45%] Building CXX object ...", "[ 58%] Linking CXX static library ...", "[ 60%] Built target x"
# (the last is not a step). The percentage restarts for each target on the command line, so it cannot give an ETA;
# the steps are counted against count_steps() instead. Ninja (CMAKE_GENERATOR=Ninja): "[103/228] Building ...".
_MAKE_STEP = re.compile(r"^\[\s*\d+%\] (?!Built target )\S")
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\] ")


def count_steps(build_dir: Path, targets) -> int | None:
    """How many "[NN%] ..." step lines a Makefiles build of `targets` prints from scratch: the progress messages in
    the build.make of every target they depend on (CMakeFiles/Makefile2 holds the graph). None when the build
    directory is not a Makefiles one."""
    try:
        graph = (build_dir / "CMakeFiles" / "Makefile2").read_text()
    except OSError:
        return None
    rules = dict(re.findall(r"^([\w.+-]+): (\S+\.dir)/rule$", graph, re.M))
    deps: dict[str, list[str]] = {}
    for target_dir, dep in re.findall(r"^(\S+\.dir)/all: (\S+\.dir)/all$", graph, re.M):
        deps.setdefault(target_dir, []).append(dep)
    todo, seen = [rules[t] for t in targets if t in rules], set()
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo += deps.get(d, [])
    total = 0
    for d in seen:
        try:
            total += len(re.findall(r'cmake_echo_color .*--progress-num=\S* "', (build_dir / d / "build.make")
                                    .read_text()))
        except OSError:
            return None
    return total or None


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """cmake's output lines -> "llama.cpp build: 45% (103/228 steps), 5m12s elapsed, about 6m20s left" on `stream`:
    rewritten in place on a terminal, otherwise one line per 5% so a log stays short. The ETA assumes the steps
    left take as long on average as the steps done."""

    def __init__(self, total: int | None, stream=None, clock=time.monotonic):
        self.total, self.done = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.clock, self.start = clock, clock()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.printed_bucket = -1

    def feed(self, line: str) -> str | None:
        """Count one output line; returns the progress line when it was printed."""
        m = _NINJA_STEP.match(line)
        if m:
            self.done, self.total = int(m.group(1)), int(m.group(2))
        elif _MAKE_STEP.match(line):
            self.done += 1
        else:
            return None
        text = self.line()
        bucket = int(100 * self.fraction() // 5) if self.fraction() is not None else self.done // 20
        if self.tty:
            self.stream.write(f"\r{text}\033[K")
        elif bucket > self.printed_bucket:
            self.stream.write(text + "\n")
        else:
            return None
        self.printed_bucket = bucket
        self.stream.flush()
        return text

    def fraction(self) -> float | None:
        return min(self.done / self.total, 1.0) if self.total else None  # a miscount never shows past 100%

    def line(self) -> str:
        elapsed = self.clock() - self.start
        f = self.fraction()
        if f is None:
            return f"llama.cpp build: {self.done} steps, {_clock(elapsed)} elapsed"
        text = f"llama.cpp build: {f:.0%} ({self.done}/{self.total} steps), {_clock(elapsed)} elapsed"
        return text + (f", about {_clock(elapsed * (1 - f) / f)} left" if self.done >= 3 else "")

    def finish(self) -> None:
        text = f"llama.cpp build: done, {self.done} steps in {_clock(self.clock() - self.start)}"
        self.stream.write(("\r" + text + "\033[K\n") if self.tty else text + "\n")
        self.stream.flush()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # a BaseException: _run stops cmake, build() removes its temporary directory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specquant.export.llama_cpp_build", description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: LLAMA_CPP_JOBS or the "
                                                           "cores this process may use)")
    args = ap.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        print(f"error: --jobs {args.jobs} must be a positive integer", file=sys.stderr)
        return 2
    try:
        print(ensure_built(jobs=args.jobs))
    except SpecquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # SIGTERM (scripts/setup.sh stopping its other steps when one failed) as Ctrl-C: cmake's process group is
    # stopped and the temporary build directory removed, instead of a build going on with no one waiting for it
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
