#include "engine/build_info.h"

namespace dsv4 {

const char * build_version() { return DSV4_VERSION; }
const char * build_commit() { return DSV4_GIT_COMMIT; }
const char * build_backends() { return DSV4_BACKENDS; }

}  // namespace dsv4
