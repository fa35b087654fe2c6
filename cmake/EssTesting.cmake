# Test helpers. Tests live per part under tests/, and each op's tests beside its sources
# (src/runtime/ops/<op>/).
find_package(GTest REQUIRED)
include(GoogleTest)

# ess_add_test(<name> <sources...> [LABELS <label>] [PREFIX <prefix>])
# One GoogleTest binary; each TEST becomes a ctest test (gtest_discover_tests), its name
# prefixed with PREFIX when given (the host runs of the GPU tests share their test names).
# Tests see the public headers, the internal ones (src/) and the test support (src/testing,
# ess_testing, on the runtime alone); a test of a higher layer links that layer itself.
function(ess_add_test name)
  cmake_parse_arguments(T "" "PREFIX" "LABELS" ${ARGN})
  add_executable(${name} ${T_UNPARSED_ARGUMENTS})
  target_link_libraries(${name} PRIVATE ess_testing ess_runtime GTest::gtest GTest::gtest_main ess_flags)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  target_compile_definitions(${name} PRIVATE ESS_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  # One label per test: gtest_discover_tests passes its PROPERTIES through a command line
  # and a generated script, which split a label list (CMake 3.25), so a test carries its
  # own label (gpu, property, soak) or "unit".
  list(LENGTH T_LABELS n_labels)
  if(n_labels GREATER 1)
    message(FATAL_ERROR "ess_add_test(${name}): one label per test, got ${T_LABELS}")
  endif()
  set(label unit)
  if(n_labels EQUAL 1)
    set(label ${T_LABELS})
  endif()
  gtest_discover_tests(${name} TEST_PREFIX "${T_PREFIX}" PROPERTIES LABELS ${label} DISCOVERY_TIMEOUT 60)
endfunction()

# A kernel's cases (<op>_cases.h, written once against a backend; testing/backend.h)
# run twice:
#   cuda_<op>_host_test  the CPU reference stands in for the device; label unit; always built
#                        (ASan build included), test names prefixed "host.";
#   cuda_<op>_test       the device; label gpu; built with the CUDA target; skips without one.
# ess_add_kernel_test(<op> [HOST <libs...>] [DEVICE <libs...>])
function(ess_add_kernel_test op)
  cmake_parse_arguments(K "" "" "HOST;DEVICE" ${ARGN})
  ess_add_test(cuda_${op}_host_test ${op}_host_test.cc PREFIX "host.")
  target_link_libraries(cuda_${op}_host_test PRIVATE ${K_HOST})
  if(ESS_WITH_CUDA)
    ess_add_test(cuda_${op}_test ${op}_test.cc LABELS gpu)
    target_link_libraries(cuda_${op}_test PRIVATE ${K_DEVICE})
  endif()
endfunction()

# ess_add_emulation_test(<name> <sources...> [PREFIX <prefix>])
# A kernel's own device code (its CTA program, written against a primitives policy) run on
# the CPU by the CTA emulator (src/testing/emulator/cta_emulator.h), label emulation. Its fibers
# are Boost.Context's (libboost-context-dev), which AddressSanitizer does not follow: not in
# the sanitizer build.
find_package(Boost 1.74 CONFIG QUIET COMPONENTS context)
if(NOT Boost_context_FOUND)
  message(STATUS "ESS: Boost.Context not found (libboost-context-dev): the emulation tests are not built")
endif()
function(ess_add_emulation_test name)
  if(ESS_SANITIZE OR NOT Boost_context_FOUND)
    return()
  endif()
  cmake_parse_arguments(E "" "PREFIX" "" ${ARGN})
  if(E_PREFIX)
    ess_add_test(${name} ${E_UNPARSED_ARGUMENTS} LABELS emulation PREFIX ${E_PREFIX})
  else()
    ess_add_test(${name} ${E_UNPARSED_ARGUMENTS} LABELS emulation)
  endif()
  target_link_libraries(${name} PRIVATE Boost::context)
endfunction()

# ess_add_emulated_cuda_test(<name> <sources...> [STREAM_ORDERS <order>...])
# A GPU test's own source (cuda_<op>_test's) built against the emulated CUDA target
# (src/testing/emulated_cuda): the backend's host code and launches run on the CPU, each kernel's
# CTA program on the CTA emulator. Label emulation; test names prefixed "emulated_cuda.".
# STREAM_ORDERS (streams.h: lazy:SEED): the tests run again under each order, named
# "emulated_cuda.StreamOrder.<order>." (ctest -L emulation -R StreamOrder).
function(ess_add_emulated_cuda_test name)
  if(ESS_SANITIZE OR NOT Boost_context_FOUND)
    return()
  endif()
  cmake_parse_arguments(E "" "" "STREAM_ORDERS" ${ARGN})
  add_executable(${name} ${E_UNPARSED_ARGUMENTS})
  target_link_libraries(${name} PRIVATE ess_cuda_emulated ess_runtime_host GTest::gtest GTest::gtest_main ess_flags)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  target_compile_definitions(${name} PRIVATE ESS_SOURCE_DIR="${PROJECT_SOURCE_DIR}" ESS_EMULATED_CUDA=1)
  gtest_discover_tests(${name} TEST_PREFIX "emulated_cuda." PROPERTIES LABELS emulation DISCOVERY_TIMEOUT 60)
  foreach(order IN LISTS E_STREAM_ORDERS)
    string(REPLACE ":" "" tag "${order}")
    gtest_discover_tests(${name} TEST_PREFIX "emulated_cuda.StreamOrder.${tag}."
      PROPERTIES LABELS emulation ENVIRONMENT "ESS_EMU_STREAM_ORDER=${order}" DISCOVERY_TIMEOUT 60)
  endforeach()
endfunction()
