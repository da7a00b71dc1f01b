# Included by export/llama_cpp_build.py through CMAKE_PROJECT_INCLUDE: compiles at -O1 the llama.cpp code that a
# text-only request never runs per token, and leaves everything that does at the Release -O3.
#
# Why: the build is the largest single step of a fresh CI run on a 2-core machine (about 30 minutes on a Zen 1),
# and half of its CPU time goes to llama-common, mtmd and cpp-httplib: argument parsing, chat templates (jinja),
# tool-call and JSON-schema parsers, model downloads, the multimodal encoders (never run for a text model) and the
# HTTP library. At -O1 those files compile in 40-60% less time. What the bench and the tests time stays -O3: ggml,
# libllama (graph building, the KV cache, sampling in the library), the server's slot loop (server-context), and
# common's per-token parts (common.cpp, sampling.cpp, speculative.cpp, the n-gram caches, log.cpp).
# Optimization level never changes results here: no -ffast-math either way, and ggml's kernels are untouched.
include_guard(GLOBAL)
if(CMAKE_VERSION VERSION_LESS 3.19)
  return()  # no deferred calls: everything builds at -O3, as before
endif()

function(_specquant_lean)
  foreach(target mtmd cpp-httplib)
    if(TARGET ${target})
      target_compile_options(${target} PRIVATE -O1)
    endif()
  endforeach()
  if(NOT TARGET llama-common)
    return()
  endif()
  get_target_property(sources llama-common SOURCES)
  get_target_property(dir llama-common SOURCE_DIR)
  set(lean)
  foreach(source IN LISTS sources)
    if(source MATCHES "\\.cpp$" AND NOT source MATCHES "(^|/)(common|sampling|speculative|log|ngram-[a-z]+)\\.cpp$")
      if(NOT IS_ABSOLUTE "${source}")
        set(source "${dir}/${source}")
      endif()
      list(APPEND lean "${source}")
    endif()
  endforeach()
  set_source_files_properties(${lean} TARGET_DIRECTORY llama-common PROPERTIES COMPILE_OPTIONS -O1)
endfunction()

# after the whole tree is configured, when every target exists
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _specquant_lean)
