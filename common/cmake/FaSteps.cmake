# fa_add_step(<name> [ARCH <arch>] [SMEM_LIMITS <bytes>...] [ENVS <VAR=value>...]): turns the
# step folder that calls it into
#   - a static library fa_step_<name> built from kernel.cu, linked into libfa,
#   - a runner program <name> (common/src/tools/runner_main.cpp),
#   - an entry of the GPU conformance suite (ctest label "gpu") and of the benchmark.
# ARCH is for steps written for one GPU architecture, e.g. `ARCH 90a` (wgmma, setmaxnreg):
# their library is compiled for exactly -gencode=arch=compute_<arch>,code=sm_<arch>, whatever
# CMAKE_CUDA_ARCHITECTURES says, so every build (CI's sm_80 one too) compiles it; the step
# registers the compute capability it needs (FA_REGISTER_STEP_FOR_SM) and is skipped with one
# line on other GPUs. host.sass.<name> then checks its machine code (fa_add_sass_check).
# SMEM_LIMITS is for steps that pick their tile shapes by the GPU's shared memory
# (fa::smem_per_block_optin): per limit, the step's conformance suite runs again with
# FA_SMEM_LIMIT=<bytes>, i.e. with the shapes a GPU with that much shared memory per block
# gets; gpu.smem_limit.<name> checks that a limit too small for any shape is refused
# with a clear error, so that the limited runs cannot silently run the large shapes, and
# gpu.smem_limit_invalid.<name> that a malformed value is an error, not ignored.
# ENVS is for a step's knobs that change which kernels run (e.g. 07's FA_BWD_TAIL_SPLIT=4, its
# last-wave split forced at the suite's small shapes): per setting, the conformance suite runs
# again under it, as gpu.conformance.<name>.<VAR>_<value>.
# The C API finds the step through a generated table (fa_write_registry below).
function(fa_add_step name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "ARCH" "SMEM_LIMITS;ENVS")
  string(MAKE_C_IDENTIFIER "fa_step_${name}" symbol)
  set(lib fa_step_${name})
  add_library(${lib} STATIC ${CMAKE_CURRENT_SOURCE_DIR}/kernel.cu)
  target_compile_definitions(${lib} PRIVATE FA_STEP_NAME="${name}" FA_STEP_SYMBOL=${symbol})
  target_link_libraries(${lib} PRIVATE fa_step_options)
  set_target_properties(${lib} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  if(arg_ARCH)
    fa_set_cuda_arch(${lib} ${arg_ARCH})
  endif()
  target_link_libraries(fa PRIVATE ${lib})
  set_property(GLOBAL APPEND PROPERTY FA_STEP_NAMES ${name})
  set_property(GLOBAL APPEND PROPERTY FA_STEP_SYMBOLS ${symbol})

  add_executable(${name} ${FA_COMMON_DIR}/src/tools/runner_main.cpp)
  target_compile_definitions(${name} PRIVATE FA_RUNNER_STEP="${name}")
  target_link_libraries(${name} PRIVATE fa_harness)

  if(FA_BUILD_TESTS)
    add_test(NAME gpu.conformance.${name}
             COMMAND fa_gpu_tests --gtest_filter=*/${name}*:*.${name}*)
    # A step for one architecture has no tests on other GPUs (fa_gpu_tests says so).
    set_tests_properties(gpu.conformance.${name} PROPERTIES LABELS gpu
                         SKIP_REGULAR_EXPRESSION "No CUDA device;Skipping the tests of ${name}:")
    foreach(limit IN LISTS arg_SMEM_LIMITS)
      add_test(NAME gpu.conformance.${name}.smem_${limit}
               COMMAND fa_gpu_tests --gtest_filter=*/${name}*:*.${name}*)
      set_tests_properties(gpu.conformance.${name}.smem_${limit} PROPERTIES LABELS gpu
                           SKIP_REGULAR_EXPRESSION "No CUDA device"
                           ENVIRONMENT "FA_SMEM_LIMIT=${limit}")
    endforeach()
    foreach(setting IN LISTS arg_ENVS)
      string(MAKE_C_IDENTIFIER "${setting}" tag)
      add_test(NAME gpu.conformance.${name}.${tag}
               COMMAND fa_gpu_tests --gtest_filter=*/${name}*:*.${name}*)
      set_tests_properties(gpu.conformance.${name}.${tag} PROPERTIES LABELS gpu
                           SKIP_REGULAR_EXPRESSION "No CUDA device" ENVIRONMENT "${setting}")
    endforeach()
    if(arg_SMEM_LIMITS)
      fa_add_smem_limit_check(gpu.smem_limit.${name} ${name} 1024
                              "bytes of shared memory per block.*FA_SMEM_LIMIT")
      fa_add_smem_limit_check(gpu.smem_limit_invalid.${name} ${name} 96k
                              "FA_SMEM_LIMIT=96k: expected a positive number")
    endif()
  endif()
endfunction()

# Compiles CUDA target <target> for exactly one architecture, e.g. 90a:
# -gencode=arch=compute_90a,code=sm_90a instead of CMAKE_CUDA_ARCHITECTURES.
function(fa_set_cuda_arch target arch)
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES OFF)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_${arch},code=sm_${arch}>)
endfunction()

# host.sass.<name>: disassembles the library of step <name> (cuobjdump, no GPU needed) and
# fails unless every regex of REQUIRE occurs in its machine code and no regex of FORBID does,
# e.g. REQUIRE HGMMA FORBID HMMA: the step runs on warpgroup MMA, not on mma.sync. BETWEEN
# <from> <to> <regex> <min>: every stretch of code from an instruction starting with <from> to
# the next starting with <to> holds at least <min> instructions matching <regex> (CheckSass.cmake).
function(fa_add_sass_check name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "REQUIRE;FORBID;BETWEEN")
  if(NOT FA_BUILD_TESTS)
    return()
  endif()
  find_program(FA_CUOBJDUMP cuobjdump HINTS ${CUDAToolkit_BIN_DIR})
  string(REPLACE ";" "|" require "${arg_REQUIRE}")
  string(REPLACE ";" "|" forbid "${arg_FORBID}")
  string(REPLACE ";" "|" between "${arg_BETWEEN}")
  add_test(NAME host.sass.${name}
           COMMAND ${CMAKE_COMMAND} -DCUOBJDUMP=${FA_CUOBJDUMP} -DLIB=$<TARGET_FILE:fa_step_${name}>
                   -DREQUIRE=${require} -DFORBID=${forbid} -DBETWEEN=${between}
                   -P ${FA_COMMON_DIR}/cmake/CheckSass.cmake)
  set_tests_properties(host.sass.${name} PROPERTIES LABELS host)
endfunction()

# A GPU test that runs the step's backward once with FA_SMEM_LIMIT=<value> and passes only
# if the output matches <regex> (the launcher's message for that limit).
function(fa_add_smem_limit_check test step value regex)
  add_test(NAME ${test} COMMAND ${step} --backward --seqlen 256 --no-ceilings --warmup 0 --repeats 1)
  set_tests_properties(${test} PROPERTIES LABELS gpu ENVIRONMENT "FA_SMEM_LIMIT=${value}"
                       PASS_REGULAR_EXPRESSION "${regex}"
                       SKIP_REGULAR_EXPRESSION "no usable CUDA GPU")
endfunction()

# Writes the table of registered steps into libfa (called once, after every folder is read).
function(fa_write_registry)
  get_property(names GLOBAL PROPERTY FA_STEP_NAMES)
  get_property(symbols GLOBAL PROPERTY FA_STEP_SYMBOLS)
  set(decls "")
  set(entries "")
  foreach(symbol IN LISTS symbols)
    string(APPEND decls "extern \"C\" const fa::Step ${symbol};\n")
    string(APPEND entries "    &${symbol},\n")
  endforeach()
  set(text "// Generated by CMake (common/cmake/FaSteps.cmake). Do not edit.\n")
  string(APPEND text "#include \"fa/registry.h\"\n\n${decls}\nnamespace fa {\n")
  string(APPEND text "const Step* const kRegisteredSteps[] = {\n${entries}    nullptr};\n")
  string(APPEND text "}  // namespace fa\n")
  file(CONFIGURE OUTPUT ${FA_REGISTRY_SOURCE} CONTENT "${text}")
endfunction()
