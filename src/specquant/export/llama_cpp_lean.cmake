# Included by export/llama_cpp_build.py through CMAKE_PROJECT_INCLUDE: makes llama.cpp's build cheaper in CPU time
# without changing what any token runs through.
#
# Why: the build is the largest single step of a fresh CI run on a 2-core machine (about 30 minutes on a Zen 1).
# Two levers, both measured in docs/BENCH.md ("CI time"):
#  1. -O1 for the code a text-only request never runs per token: common's argument, chat-template (jinja), tool-call
#     and JSON-schema parsers and model downloads, mtmd (the multimodal encoders, never run for a text model), the
#     HTTP library, and single load-time, unused or untimed files of ggml, libllama, the server and the tools (listed
#     below). At -O1 those files compile in 35-60% less time. What the bench and the tests time stays -O3: ggml's
#     graph, backends and kernels, libllama's per-token files (the context, batches, graph building and every
#     model's graph, the KV and recurrent caches, sampling, the vocabulary), the server (its slot loop in
#     server-context), and common's per-token parts (common.cpp, sampling.cpp, speculative.cpp, the n-gram caches,
#     log.cpp). Optimization level never changes results here: no -ffast-math either way, and ggml's kernels are
#     untouched.
#  2. Unity builds (CMake's UNITY_BUILD) for llama-common (16 sources per translation unit: all in one, jinja's
#     value.cpp meets a specialization after its instantiation), mtmd and server-context (each one unit). Their
#     files are many, and most of each one's compile time goes to the same heavy headers (nlohmann's json.hpp, the
#     server's and common's own); batched, those are parsed once per batch. Ninja (llama_cpp_build.generator_options)
#     starts these units while the libraries they link still build, so one large unit leaves no core idle at the
#     end. llama.cpp itself builds libllama's model files this way (src/CMakeLists.txt) and keeps its core files
#     out; so do we. Files that do not compile batched stay alone: common/json.cpp (explicit specializations after a
#     batched file's instantiation) and mtmd-helper*.cpp (they refuse mtmd's internal headers, which a batch brings
#     in).
include_guard(GLOBAL)
if(CMAKE_VERSION VERSION_LESS 3.19)
  return()  # no deferred calls: everything builds as llama.cpp's own CMake files say
endif()

function(_specquant_sources target regex out)
  # the absolute paths of target's sources whose path matches regex
  get_target_property(sources ${target} SOURCES)
  get_target_property(dir ${target} SOURCE_DIR)
  set(found)
  foreach(source IN LISTS sources)
    if(source MATCHES "${regex}")
      if(NOT IS_ABSOLUTE "${source}")
        set(source "${dir}/${source}")
      endif()
      list(APPEND found "${source}")
    endif()
  endforeach()
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

function(_specquant_pair pair target_out value_out)
  # "target:value" -> the two halves
  string(REPLACE ":" ";" pair "${pair}")
  list(GET pair 0 target)
  list(GET pair 1 value)
  set(${target_out} "${target}" PARENT_SCOPE)
  set(${value_out} "${value}" PARENT_SCOPE)
endfunction()

function(_specquant_lean)
  foreach(target mtmd cpp-httplib llama-common)
    if(TARGET ${target})
      target_compile_options(${target} PRIVATE -O1)  # after Release's -O3: the last -O wins
    endif()
  endforeach()
  # single files of the -O3 targets that no token's work runs through (a step enters llama-model.cpp only for
  # build_graph's switch to its architecture's builder): libllama's model loading and saving, chat templates,
  # grammars, LoRA adapters, the quantizer (llama-quantize only) and the caches of architectures we never export
  # (DeepSeek's sparse attention, GLM5's indexer); ggml's GGUF parser (load time), its multi-device meta backend and
  # its optimizer (training); the server's multi-model router; the tools' own code where it is not timed: llama-bench's
  # (its timed loop is libllama's llama_decode), the imatrix collector's and perplexity's statistics, the quantize
  # tool's arguments. libllama's core files are already out of its unity batches. Its graph builders (models/*.cpp,
  # batched 16 to a file) stay -O3: -O1 for the architectures we never export saved next to nothing once ours had
  # to compile alone (docs/BENCH.md, "CI time").
  foreach(target_files
      "llama:llama-(model|model-loader|model-saver|arch|chat|grammar|adapter|quant)"
      "llama:llama-(kv-cache-(dsa|dsa-iswa|msa|dsv4)|memory-hybrid-idx)" "ggml-base:gguf|ggml-backend-meta|ggml-opt"
      "llama-server-impl:server-models" "llama-bench-impl:llama-bench" "llama-imatrix:imatrix"
      "llama-perplexity-impl:perplexity" "llama-quantize-impl:quantize")
    _specquant_pair("${target_files}" target names)
    if(TARGET ${target})
      _specquant_sources(${target} "(^|/)(${names})\\.cpp$" cold)
      set_source_files_properties(${cold} TARGET_DIRECTORY ${target} PROPERTIES COMPILE_OPTIONS -O1)
    endif()
  endforeach()
  foreach(target_batch llama-common:16 mtmd:64 server-context:64)
    _specquant_pair("${target_batch}" target batch)
    if(TARGET ${target})
      set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${batch})
    endif()
  endforeach()
  if(TARGET llama-common)
    # common's per-token files back at -O3, each compiled alone (CMake keeps a file with its own options out of a
    # batch anyway; saying so keeps the intent visible)
    _specquant_sources(llama-common "(^|/)(common|sampling|speculative|log|ngram-[a-z]+)\\.cpp$" per_token)
    set_source_files_properties(${per_token} TARGET_DIRECTORY llama-common
                                PROPERTIES COMPILE_OPTIONS -O3 SKIP_UNITY_BUILD_INCLUSION ON)
    _specquant_sources(llama-common "(^|/)json\\.cpp$" alone)
    set_source_files_properties(${alone} TARGET_DIRECTORY llama-common PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
  if(TARGET mtmd)
    _specquant_sources(mtmd "(^|/)mtmd-helper[a-z-]*\\.cpp$" alone)
    set_source_files_properties(${alone} TARGET_DIRECTORY mtmd PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
endfunction()

# after the whole tree is configured, when every target exists
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _specquant_lean)
