# CUDA toolkit discovery, pinned to one toolkit root.
#
# Machines with two CUDA installs build fine and then crash at the first kernel when the binary picks up the other
# toolkit's runtime at load time. So: the toolkit root is derived from the nvcc that CMake chose, cached, used for
# headers and libraries, written into the RPATH, and checked after every link (cmake/CheckCudaRuntime.cmake).

enable_language(CUDA)
get_filename_component(_nvcc_bin_dir "${CMAKE_CUDA_COMPILER}" DIRECTORY)
get_filename_component(_nvcc_root "${_nvcc_bin_dir}" DIRECTORY)
get_filename_component(_nvcc_root "${_nvcc_root}" REALPATH)
set(DSV4_CUDA_ROOT "${_nvcc_root}" CACHE PATH "CUDA toolkit root pinned from the chosen nvcc")
set(CUDAToolkit_ROOT "${DSV4_CUDA_ROOT}")
find_package(CUDAToolkit REQUIRED)

get_filename_component(_tk_inc "${CUDAToolkit_INCLUDE_DIRS}" REALPATH)
if(NOT _tk_inc MATCHES "^${DSV4_CUDA_ROOT}")
  message(FATAL_ERROR "CUDA headers at ${_tk_inc} are not under the pinned toolkit ${DSV4_CUDA_ROOT}")
endif()
if(NOT CUDAToolkit_VERSION VERSION_EQUAL CMAKE_CUDA_COMPILER_VERSION)
  message(FATAL_ERROR "nvcc ${CMAKE_CUDA_COMPILER_VERSION} and the toolkit ${CUDAToolkit_VERSION} disagree")
endif()

set(CMAKE_CUDA_ARCHITECTURES ${DSV4_CUDA_ARCHITECTURES})
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
# The runtime library directories of the pinned toolkit go first in every binary's RPATH.
set(DSV4_CUDA_LIB_DIRS ${CUDAToolkit_LIBRARY_DIR} ${DSV4_CUDA_ROOT}/lib ${DSV4_CUDA_ROOT}/lib64)
list(REMOVE_DUPLICATES DSV4_CUDA_LIB_DIRS)
set(CMAKE_BUILD_RPATH ${DSV4_CUDA_LIB_DIRS})
set(CMAKE_INSTALL_RPATH ${DSV4_CUDA_LIB_DIRS})

# Adds a post-link check that `target` resolves libcudart/libcublas from the pinned toolkit.
function(dsv4_check_cuda_runtime target)
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -DBINARY=$<TARGET_FILE:${target}> -DCUDA_ROOT=${DSV4_CUDA_ROOT}
            -P ${CMAKE_SOURCE_DIR}/cmake/CheckCudaRuntime.cmake
    VERBATIM)
endfunction()
