# The Python wheel's layout (ESS_PYTHON_WHEEL=ON, set by pyproject.toml through scikit-build-core),
# installed as the component `python`, the only one the wheel takes:
#   <platlib>/ess/libess.so   the C ABI, beside the package that loads it (python/ess/_lib.py);
#   <scripts>/ess             the `ess` program, which pip puts on PATH (the environment's bin/).
# The Python sources themselves are copied by scikit-build-core (wheel.packages).
if(NOT ESS_WITH_CAPI)
  message(FATAL_ERROR "ESS_PYTHON_WHEEL=ON needs the C ABI (libess.so): dlpack's header was not found "
                      "(Debian libdlpack-dev; scripts/setup.sh installs it)")
endif()
if(NOT DEFINED SKBUILD_PLATLIB_DIR OR NOT DEFINED SKBUILD_SCRIPTS_DIR)
  message(FATAL_ERROR "ESS_PYTHON_WHEEL=ON is set by the Python build (pip install . at the repository "
                      "root); a CMake build alone installs with cmake --install")
endif()

# One file, libess.so: a wheel stores symlinks as copies, so no libess.so.1 -> libess.so.0.1.0
# chain; the package loads the library by its path, not by its soname.
set_property(TARGET ess_c PROPERTY VERSION)
set_property(TARGET ess_c PROPERTY SOVERSION)
# The installed files find what they link outside the system's directories (the CUDA toolkit's
# libcudart and, for `ess`, libcublas) where the build found it; nothing else.
set_target_properties(ess_c ess PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)

install(TARGETS ess_c LIBRARY DESTINATION ${SKBUILD_PLATLIB_DIR}/ess COMPONENT python)
install(TARGETS ess RUNTIME DESTINATION ${SKBUILD_SCRIPTS_DIR} COMPONENT python)
