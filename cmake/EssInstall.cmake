# `cmake --install` puts the public headers (include/ess), the two libraries and a CMake
# package under the prefix; consumers write
#   find_package(ess CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE ess::runtime)   # or ess::analysis, or ess::c (the C ABI)
# (examples/consumer/ is such a project; CI builds it against an installed tree).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(ess_installed ess_runtime ess_analysis)
if(ESS_WITH_CAPI)
  list(APPEND ess_installed ess_c)
endif()
install(TARGETS ${ess_installed} EXPORT essTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ess ${PROJECT_BINARY_DIR}/src/runtime/generated/include/ess
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT essTargets NAMESPACE ess:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ess)

set(ESS_PACKAGE_WITH_CUDA ${ESS_WITH_CUDA})
set(ESS_PACKAGE_WITH_CAPI ${ESS_WITH_CAPI})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/essConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/essConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ess)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/essConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/essConfig.cmake ${PROJECT_BINARY_DIR}/essConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ess)
