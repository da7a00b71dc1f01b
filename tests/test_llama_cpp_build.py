"""llama.cpp's tools on first use (export/llama_cpp_build.py): the progress line and its ETA, the step count against
a real (tiny) Makefiles build, the build-on-first-use path with a fake builder, the lock, and what is never deleted.

No test here builds llama.cpp: the real build is `scripts/setup.sh --test`'s, checked by tests/test_export_llama_cpp.py.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.export import llama_cpp_build as lb
from specquant.export.llama_cpp import find_tool

# real lines from a Makefiles build of the tools (percentages restart for each target named; "Built target" is no
# step; compiler warnings are interleaved)
CANNED_MAKE_LOG = """\
[  0%] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o
[  0%] Building CXX object common/CMakeFiles/llama-common-base.dir/build-info.cpp.o
[  2%] Linking CXX static library libllama-common-base.a
[  2%] Built target llama-common-base
/src/ggml.c:123:5: warning: unused variable 'x' [-Wunused-variable]
  123 |     int x;
      |         ^
[  4%] Building CXX object ggml/src/CMakeFiles/ggml-base.dir/ggml.cpp.o
[  4%] Building CXX object vendor/cpp-httplib/CMakeFiles/cpp-httplib.dir/httplib.cpp.o
[  9%] Linking CXX static library libggml-base.a
[  9%] Built target ggml-base
[ 97%] Built target llama-common
[100%] Building CXX object tools/completion/CMakeFiles/llama-completion-impl.dir/completion.cpp.o
[100%] Linking CXX static library libllama-completion-impl.a
[100%] Built target llama-completion-impl
[  2%] Built target llama-common-base
[100%] Building CXX object tools/completion/CMakeFiles/llama-completion.dir/main.cpp.o
[100%] Linking CXX executable ../../bin/llama-completion
[100%] Built target llama-completion
"""
CANNED_STEPS = 10  # the lines above that are steps: Building / Linking, not "Built target" or the warning


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_counts_make_steps_and_projects_the_rest():
    clock, stream = FakeClock(), io.StringIO()
    progress = lb.Progress(40, stream, clock)
    printed = []
    for line in CANNED_MAKE_LOG.splitlines(keepends=True):
        clock.now += 6  # 6 s per output line
        printed.append(progress.feed(line))
    assert progress.done == CANNED_STEPS
    # 10 of 40 steps after 19 lines x 6 s: 25%, and the other 30 steps at the same pace take 3 x 114 s
    assert progress.line() == "llama.cpp build: 25% (10/40 steps), 1m54s elapsed, about 5m42s left"
    # not a terminal: the first step, then one line per 5% reached (steps 2, 4, 6, 8, 10 of 40), not one per step
    lines = stream.getvalue().splitlines()
    assert [p for p in printed if p] == lines and len(lines) == 6
    assert lines[:2] == ["llama.cpp build: 2% (1/40 steps), 6s elapsed",  # no ETA from fewer than 3 steps
                         "llama.cpp build: 5% (2/40 steps), 12s elapsed"]
    assert lines[-1] == "llama.cpp build: 25% (10/40 steps), 1m48s elapsed, about 5m24s left"  # its 18th line


def test_progress_reads_ninja_counts_and_rewrites_a_terminal_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    clock, stream = FakeClock(), Tty()
    progress = lb.Progress(None, stream, clock)
    clock.now += 30
    progress.feed("[3/12] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o\n")
    clock.now += 30
    assert progress.feed("[6/12] Linking CXX static library src/libllama.a\n") == \
        "llama.cpp build: 50% (6/12 steps), 1m00s elapsed, about 1m00s left"
    assert progress.feed("FAILED: not a step\n") is None
    progress.finish()
    out = stream.getvalue()
    assert out.count("\r") == 3 and "\n" not in out[:-1] and out.endswith("done, 6 steps in 1m00s\033[K\n")


def test_progress_without_a_count_shows_steps_and_time_only():
    clock, stream = FakeClock(), io.StringIO()
    progress = lb.Progress(None, stream, clock)
    for line in CANNED_MAKE_LOG.splitlines():
        progress.feed(line)
    assert progress.line() == f"llama.cpp build: {CANNED_STEPS} steps, 0s elapsed"


TINY_PROJECT = """\
cmake_minimum_required(VERSION 3.14)
project(tiny C)
add_library(base STATIC a.c b.c)
add_library(mid STATIC c.c)
target_link_libraries(mid PUBLIC base)
add_executable(one one.c)
target_link_libraries(one PRIVATE mid)
add_executable(two two.c)
target_link_libraries(two PRIVATE base)
add_executable(other other.c)
"""


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("make") and shutil.which("cc")),
                    reason="needs cmake, make and cc (what the llama.cpp build needs too)")
@pytest.mark.parametrize("targets", [("one", "two"), ("two",)])
def test_count_steps_equals_the_step_lines_of_a_real_makefiles_build(tmp_path, targets):
    """The count from the generated Makefiles is the number of step lines the build then prints, for targets that
    share a library (built once, then only "Built target") and leaving out one not asked for."""
    src = _tiny_project(tmp_path)
    env = {**os.environ, "CMAKE_GENERATOR": "Unix Makefiles"}
    subprocess.run(["cmake", "-S", src, "-B", tmp_path / "b"], check=True, capture_output=True, env=env)
    total = lb.count_steps(tmp_path / "b", targets)
    out = subprocess.run(["cmake", "--build", tmp_path / "b", "-j", "2", "--target", *targets], check=True,
                         capture_output=True, text=True, env=env).stdout
    progress = lb.Progress(total, io.StringIO())
    for line in out.splitlines():
        progress.feed(line)
    # one: base (a.o, b.o, link), mid (c.o, link), one.o + link; two: two.o + link; `other` is never built
    assert total == progress.done == {("one", "two"): 9, ("two",): 5}[targets]


def _tiny_project(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(TINY_PROJECT)
    for name in ("a", "b", "c"):
        (src / f"{name}.c").write_text(f"int {name}(void) {{ return 1; }}\n")
    for name in ("one", "two", "other"):
        (src / f"{name}.c").write_text("int main(void) { return 0; }\n")
    return src


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("cc")), reason="needs cmake and cc")
def test_a_real_ninja_build_reaches_its_own_step_count(tmp_path, monkeypatch):
    """Where a ninja is found (the test extras install the wheel), the build configures with Ninja and the
    progress line follows ninja's own "[N/M]" counts to the end."""
    monkeypatch.delenv("CMAKE_GENERATOR", raising=False)
    generator = lb.generator_options()
    if not generator:
        pytest.skip("no ninja beside this Python or on PATH (pip install ninja)")
    src = _tiny_project(tmp_path)
    subprocess.run(["cmake", "-S", src, "-B", tmp_path / "b", *generator], check=True, capture_output=True)
    assert (tmp_path / "b" / "build.ninja").is_file() and lb.count_steps(tmp_path / "b", ["one"]) is None
    out = subprocess.run(["cmake", "--build", tmp_path / "b", "-j", "2", "--target", "one", "two"], check=True,
                         capture_output=True, text=True).stdout
    progress = lb.Progress(None, io.StringIO())
    for line in out.splitlines():
        progress.feed(line)
    # a.o, b.o, c.o, one.o, two.o, the two libraries and the two executables; `other` is never built
    assert progress.done == progress.total == 9 and progress.fraction() == 1.0


def test_generator_is_ninja_where_one_is_found_and_make_is_needed_only_without(tmp_path, monkeypatch):
    """Ninja beside this Python (a venv's, from the wheel) or on PATH; a CMAKE_GENERATOR the user set wins; with no
    ninja, cmake's default (Makefiles) and then make is a required build tool, named in one line."""
    venv_bin, other = tmp_path / "venv" / "bin", tmp_path / "other"
    venv_bin.mkdir(parents=True)
    other.mkdir()
    for name in ("cmake", "c++"):
        (other / name).symlink_to("/bin/true")
    monkeypatch.setenv("PATH", str(other))
    monkeypatch.delenv("CMAKE_GENERATOR", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert lb.generator_options() == ()
    with pytest.raises(SpecquantError, match=r"needs make \(make not found on PATH\)"):
        lb.check_build_tools()
    (venv_bin / "ninja").symlink_to("/bin/true")
    assert lb.generator_options() == ("-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={venv_bin / 'ninja'}")
    lb.check_build_tools()  # no make needed
    monkeypatch.setenv("CMAKE_GENERATOR", "Unix Makefiles")
    assert lb.generator_options() == ()
    (venv_bin / "ninja").unlink()
    monkeypatch.delenv("CMAKE_GENERATOR")
    (other / "ninja").symlink_to("/bin/true")
    assert lb.generator_options() == ("-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={other / 'ninja'}")


LEAN_PROJECT = """cmake_minimum_required(VERSION 3.14)
project(llama.cpp CXX)
set(CMAKE_BUILD_TYPE Release)
add_subdirectory(common)
add_library(mtmd STATIC clip.cpp mtmd.cpp mtmd-helper.cpp)
add_library(ggml-base STATIC ggml-backend.cpp gguf.cpp ggml-opt.cpp)
add_library(llama STATIC llama-context.cpp llama-kv-cache.cpp llama-memory-hybrid.cpp llama-model.cpp
            llama-model-loader.cpp llama-kv-cache-dsv4.cpp llama-memory-hybrid-idx.cpp)
add_library(server-context STATIC server-context.cpp server-task.cpp)
add_library(llama-server-impl STATIC server.cpp server-models.cpp)
add_library(llama-bench-impl STATIC llama-bench.cpp)
add_library(llama-imatrix STATIC imatrix.cpp)
add_library(llama-perplexity-impl STATIC perplexity.cpp)
add_library(llama-quantize-impl STATIC quantize.cpp)
"""


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("c++")), reason="needs cmake and a C++ compiler")
def test_lean_build_batches_and_lowers_only_code_no_request_runs_per_token(tmp_path):
    """llama_cpp_lean.cmake, included as the real build includes it, on a project with llama.cpp's target and file
    names: mtmd and common's parsers compile at -O1 after Release's -O3 (the last -O wins), batched 8 to a unity
    file; common's per-token files (common, sampling, speculative, log, the n-gram caches) and libllama's keep -O3,
    each alone, while its load-time and unused files, ggml's GGUF parser and optimizer, the server's model router
    and the tools' own untimed files (llama-bench, imatrix, perplexity, quantize) go to -O1; server-context's files
    keep -O3, batched; the files that do not compile batched (common/json.cpp, mtmd-helper.cpp) stay alone."""
    import json
    import re

    src = tmp_path / "src"
    (src / "common" / "jinja").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(LEAN_PROJECT)
    per_token = ["common.cpp", "sampling.cpp", "speculative.cpp", "log.cpp", "ngram-cache.cpp"]
    lean = ["arg.cpp", "chat.cpp", "jinja/value.cpp", "json-schema-to-grammar.cpp"]
    common = per_token + lean + ["json.cpp"]
    (src / "common" / "CMakeLists.txt").write_text(f"add_library(llama-common STATIC {' '.join(common)})\n")
    # hot llama-kv-cache and llama-memory-hybrid begin as cold names do: the patterns must tell them apart
    hot = ["llama-context.cpp", "llama-kv-cache.cpp", "llama-memory-hybrid.cpp", "server.cpp", "ggml-backend.cpp"]
    cold = ["llama-model.cpp", "llama-model-loader.cpp", "llama-kv-cache-dsv4.cpp", "llama-memory-hybrid-idx.cpp",
            "server-models.cpp", "llama-bench.cpp", "gguf.cpp", "ggml-opt.cpp", "imatrix.cpp", "perplexity.cpp",
            "quantize.cpp"]
    others = ["clip.cpp", "mtmd.cpp", "mtmd-helper.cpp", "server-context.cpp", "server-task.cpp", *hot, *cold]
    for i, name in enumerate([f"common/{n}" for n in common] + others):
        (src / name).write_text(f"int f{i}() {{ return {i}; }}\n")  # distinct names: batched files must link
    include = next(o for o in lb.CMAKE_OPTIONS if o.startswith("-DCMAKE_PROJECT_INCLUDE="))
    assert lb.LEAN_CMAKE.is_file()
    subprocess.run(["cmake", "-S", src, "-B", tmp_path / "b", include, "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"],
                   check=True, capture_output=True)
    flags, batched = {}, set()
    for entry in json.loads((tmp_path / "b" / "compile_commands.json").read_text()):
        level = [w for w in entry["command"].split() if w.startswith("-O")][-1]
        file = Path(entry["file"])
        members = [Path(p) for p in re.findall(r'#include "([^"]+)"', file.read_text())] \
            if file.name.startswith("unity_") else [file]
        for m in members:
            name = m.relative_to(src).as_posix()
            flags[name] = level
            if len(members) > 1:
                batched.add(name)
    assert {f: o for f, o in flags.items() if o == "-O1"} == {
        f: "-O1" for f in ["clip.cpp", "mtmd.cpp", "mtmd-helper.cpp", "common/json.cpp", *cold]
        + [f"common/{n}" for n in lean]}
    assert all(flags[f"common/{n}"] == "-O3" for n in per_token) and all(flags[f] == "-O3" for f in hot)
    assert batched == {"clip.cpp", "mtmd.cpp", "server-context.cpp", "server-task.cpp"} | {f"common/{n}" for n in lean}


def test_count_steps_is_none_outside_a_makefiles_tree(tmp_path):
    assert lb.count_steps(tmp_path, lb.TOOLS) is None


# --- on first use --------------------------------------------------------------------------------------------------


def fake_build(calls, delay=0.0):
    def build(root, jobs=None, stream=None):
        calls.append(root)
        time.sleep(delay)
        dest = lb.install_dir(root)
        (dest / "bin").mkdir(parents=True)
        for t in lb.TOOLS:
            (dest / "bin" / t).write_text("#!/bin/sh\n")
            (dest / "bin" / t).chmod(0o755)
        (dest / lb.BUILD_INFO).write_text("fake\n")
        return dest / "bin"
    return build


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQUANT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_find_tool_builds_on_first_use_then_reuses(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(lb, "build", fake_build(calls))
    path = find_tool("llama-quantize")
    assert path == lb.install_dir(cache) / "bin" / "llama-quantize" and os.access(path, os.X_OK)
    assert calls == [cache]
    assert find_tool("llama-completion").parent == path.parent and calls == [cache]  # built once


def test_given_bin_dir_is_never_built_into(cache, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(lb, "build", fake_build(calls))
    with pytest.raises(SpecquantError, match="'llama-quantize' not found in --llama-cpp") as e:
        find_tool("llama-quantize", tmp_path / "mine")
    assert "\n" not in str(e.value) and calls == [] and not cache.exists()


def test_a_tool_the_build_does_not_make_is_named(cache, monkeypatch):
    monkeypatch.setattr(lb, "build", fake_build([]))
    with pytest.raises(SpecquantError, match="'llama-cli' is not one the build cache holds"):
        find_tool("llama-cli")


def test_concurrent_first_uses_build_once(cache, monkeypatch):
    """The second caller waits on the lock while the first builds, then finds the tools (flock conflicts between
    two open() calls even in one process, so threads stand in for processes)."""
    calls, results, stream = [], [], io.StringIO()
    monkeypatch.setattr(lb, "build", fake_build(calls, delay=0.5))
    threads = [threading.Thread(target=lambda: results.append(lb.ensure_built(stream=stream))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert calls == [cache] and len(results) == 2 and results[0] == results[1]
    assert "another process is building it" in stream.getvalue()


def test_missing_build_tool_is_one_line_and_nothing_is_left(cache, monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "cmake" else real_which(name))
    with pytest.raises(SpecquantError, match=r"needs cmake \(cmake not found on PATH\); install it") as e:
        find_tool("llama-bench")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in cache.iterdir()) == [f".llama.cpp-{lb.VERSION}.lock"]


# --- a whole build with a fake cmake ---------------------------------------------------------------------------


FAKE_CMAKE = """\
#!/bin/sh
# configure: cmake -S SRC -B DIR ...; build: cmake --build DIR ... --target T...
if [ "$1" = -S ]; then
  [ -f "$2/CMakeLists.txt" ] || { echo "no CMakeLists.txt in $2"; exit 1; }
  mkdir -p "$4"; echo "-- Configuring done"; exit 0
fi
dir=$2; shift 2
while [ "$1" != --target ]; do shift; done; shift
mkdir -p "$dir/bin"
for t in "$@"; do
  echo "[ 50%] Building CXX object tools/$t/main.cpp.o"
  printf '#!/bin/sh\\necho %s\\n' "$t" > "$dir/bin/$t"; chmod +x "$dir/bin/$t"
  echo "[100%] Built target $t"
done
"""


@pytest.fixture
def fake_toolchain(cache, tmp_path, monkeypatch):
    """A cached sdist holding vendor/llama.cpp/CMakeLists.txt and a `cmake` on PATH that "builds" every tool."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(FAKE_CMAKE)
    (bin_dir / "cmake").chmod(0o755)
    for name in ("make", "c++"):
        (bin_dir / name).symlink_to("/bin/true")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("CXX", raising=False)
    cache.mkdir()
    top = f"llama_cpp_python-{lb.VERSION}"
    tree = tmp_path / "sdist" / top
    (tree / "vendor" / "llama.cpp").mkdir(parents=True)
    (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text("project(x)\n")
    (tree / "setup.py").write_text("")
    with tarfile.open(cache / f"{top}.tar.gz", "w:gz") as tar:
        tar.add(tree, arcname=top)
    return cache


def test_build_installs_every_tool_and_removes_only_its_temporary_dir(fake_toolchain):
    stream = io.StringIO()
    bin_dir = lb.ensure_built(stream=stream)
    assert not lb.missing_tools(bin_dir)
    assert subprocess.run([bin_dir / "llama-server"], capture_output=True, text=True).stdout == "llama-server\n"
    assert (bin_dir.parent / lb.BUILD_INFO).read_text().startswith(f"llama-cpp-python {lb.VERSION}")
    assert not list(fake_toolchain.glob(".llama.cpp-build.*"))
    err = stream.getvalue()
    assert f"({len(lb.TOOLS)}/{len(lb.TOOLS)} steps)" not in err  # no Makefile2 in the fake: no count, no ETA
    assert f"done, {len(lb.TOOLS)} steps" in err and f"tools in {bin_dir}" in err


def test_incomplete_earlier_build_is_replaced(fake_toolchain):
    dest = lb.install_dir(fake_toolchain)
    (dest / "bin").mkdir(parents=True)
    (dest / lb.BUILD_INFO).write_text("an older build\n")
    (dest / "bin" / "llama-bench").write_text("old")
    lb.ensure_built(stream=io.StringIO())
    assert not lb.missing_tools(dest / "bin") and (dest / "bin" / "llama-bench").read_text() != "old"


def test_bad_job_count_is_one_line(fake_toolchain, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_JOBS", "two")
    with pytest.raises(SpecquantError, match="LLAMA_CPP_JOBS='two' must be a positive integer"):
        lb.ensure_built(stream=io.StringIO())
    assert not list(fake_toolchain.glob(".llama.cpp-build.*"))


def test_install_dir_no_build_wrote_is_refused_and_kept(fake_toolchain):
    dest = lb.install_dir(fake_toolchain)
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(SpecquantError, match="no llama.cpp build wrote it"):
        lb.ensure_built(stream=io.StringIO())
    assert [p.name for p in dest.iterdir()] == ["notes.txt"] and (dest / "notes.txt").read_text() == "mine"
    assert not list(fake_toolchain.glob(".llama.cpp-build.*"))


def test_failed_build_names_the_log_and_leaves_no_cache(fake_toolchain, tmp_path):
    (tmp_path / "fakebin" / "cmake").write_text("#!/bin/sh\necho 'error: boom'\nexit 3\n")
    stream = io.StringIO()
    with pytest.raises(SpecquantError, match=r"building llama.cpp failed \(cmake exit 3\); full log in") as e:
        lb.ensure_built(stream=stream)
    assert "error: boom" in stream.getvalue() and "error: boom" in Path(str(e.value).split()[-1]).read_text()
    assert not lb.install_dir(fake_toolchain).exists() and not list(fake_toolchain.glob(".llama.cpp-build.*"))


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"  # a zombie has stopped
    except (FileNotFoundError, IndexError):
        return False


def test_interrupt_stops_the_whole_build_process_group(tmp_path):
    """Ctrl-C while cmake runs stops its children too (make, the compilers), so nothing keeps writing into the
    temporary directory the caller then removes."""
    pid_file = tmp_path / "child.pid"

    def interrupt(line):
        raise KeyboardInterrupt

    with open(tmp_path / "log", "w") as log, pytest.raises(KeyboardInterrupt):
        # the shell exits at once; its child, like make under cmake, goes on unless its group is stopped
        lb._run(["sh", "-c", f"sleep 60 >/dev/null & echo $! > {pid_file}; echo started"], log, tmp_path / "log",
                io.StringIO(), interrupt)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child)


def test_sigterm_stops_the_module_build_and_leaves_nothing(fake_toolchain, tmp_path):
    """`python -m specquant.export.llama_cpp_build` stopped by SIGTERM (scripts/setup.sh stops its background
    steps so when another failed) stops cmake's process group and removes its temporary directory, as Ctrl-C does."""
    pid_file = tmp_path / "make.pid"
    (tmp_path / "fakebin" / "cmake").write_text(
        FAKE_CMAKE.replace('mkdir -p "$dir/bin"', f'sleep 60 & echo $! > {pid_file}; wait; mkdir -p "$dir/bin"'))
    proc = subprocess.Popen([sys.executable, "-m", "specquant.export.llama_cpp_build"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    assert list(fake_toolchain.glob(".llama.cpp-build.*"))  # building
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child)
    assert not list(fake_toolchain.glob(".llama.cpp-build.*")) and not lb.install_dir(fake_toolchain).exists()


def test_old_python_tar_check_refuses_paths_out_of_the_tree():
    ok = tarfile.TarInfo("llama_cpp_python-x/vendor/llama.cpp/a.c")
    assert lb._refuse_unsafe(ok, "/tmp") is ok
    for name in ("/etc/passwd", "llama_cpp_python-x/../../evil"):
        with pytest.raises(SpecquantError, match="unsafe member"):
            lb._refuse_unsafe(tarfile.TarInfo(name), "/tmp")
    link = tarfile.TarInfo("llama_cpp_python-x/vendor/link")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc"
    with pytest.raises(SpecquantError, match="unsafe member"):
        lb._refuse_unsafe(link, "/tmp")


# --- the commands ----------------------------------------------------------------------------------------------


def test_export_for_llama_cpp_builds_nothing_and_says_how(cache, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(lb, "build", fake_build(calls))
    assert main(["export", "--target", "tiny-draft", "--out", str(tmp_path / "g"), "--for", "llama.cpp"]) == 0
    out = capsys.readouterr().out
    assert calls == [] and "python -m specquant.export.llama_cpp_build" in out and str(lb.install_dir()) in out
    lb.ensure_built()
    assert main(["export", "--target", "tiny-draft", "--out", str(tmp_path / "g"), "--for", "llama.cpp",
                 "--overwrite"]) == 0
    assert f"llama.cpp's tools: {lb.install_dir() / 'bin'}" in capsys.readouterr().out


def test_bench_engine_llama_cpp_checks_input_before_building(cache, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(lb, "build", fake_build(calls))
    assert main(["bench", "--engine", "llama.cpp", "--target", str(tmp_path / "nope"), "--draft", "tiny-draft",
                 "--out", str(tmp_path / "b")]) == 2
    assert calls == [] and "nope" in capsys.readouterr().err


def test_module_main_prints_the_bin_directory(cache, monkeypatch, capsys):
    monkeypatch.setattr(lb, "build", fake_build([]))
    assert lb.main([]) == 0
    assert capsys.readouterr().out.strip() == str(lb.install_dir() / "bin")
    assert lb.main(["--jobs", "0"]) == 2 and "--jobs 0" in capsys.readouterr().err


# --- which flags the build configures with ---------------------------------------------------------------------

ZEN3 = {"sse4_2", "f16c", "fma", "bmi2", "avx", "avx2"}
SPR = ZEN3 | {"avx_vnni", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni",
              "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}


def test_cpu_without_amx_builds_native():
    assert lb.cmake_options(ZEN3) == (lb.CMAKE_OPTIONS, "")
    assert "-DGGML_NATIVE=ON" in lb.CMAKE_OPTIONS
    assert lb.cmake_options(set()) == (lb.CMAKE_OPTIONS, "")  # no /proc/cpuinfo: nothing assumed


def test_cpu_with_amx_names_its_extensions_and_leaves_amx_out():
    options, suffix = lb.cmake_options(SPR)
    assert suffix == "-noamx"
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_NATIVE=ON" not in options
    for on in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
               "GGML_AVX512_VBMI", "GGML_AVX_VNNI"):
        assert f"-D{on}=ON" in options, on
    for off in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert f"-D{off}=OFF" in options, off
    # every other configure option is the native build's
    assert set(lb.CMAKE_OPTIONS) - {"-DGGML_NATIVE=ON"} <= set(options)
    # an AMX CPU without the full AVX-512 base does not get GGML_AVX512
    options, _ = lb.cmake_options(SPR - {"avx512vl"})
    assert "-DGGML_AVX512=OFF" in options


def test_install_dir_names_the_amx_free_build(monkeypatch, tmp_path):
    monkeypatch.setattr(lb, "cpu_flags", lambda: SPR)
    assert lb.install_dir(tmp_path).name == f"llama.cpp-{lb.VERSION}-noamx"
    monkeypatch.setattr(lb, "cpu_flags", lambda: ZEN3)
    assert lb.install_dir(tmp_path).name == f"llama.cpp-{lb.VERSION}"
