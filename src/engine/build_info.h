// What this binary was built from: version, git commit and compiled-in backends (set by CMake).
#pragma once

#include <string>

namespace dsv4 {

const char * build_version();
const char * build_commit();
const char * build_backends();  // e.g. "cpu, cuda (sm_90a sm_120 sm_121)"

}  // namespace dsv4
