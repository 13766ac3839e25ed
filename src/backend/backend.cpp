#include "backend/backend.h"

#include "util/error.h"

namespace dsv4 {

Tensor make_tensor(GgmlType type, void * data, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    Tensor t;
    t.type = type;
    t.data = data;
    t.ne[0] = ne0;
    t.ne[1] = ne1;
    t.ne[2] = ne2;
    t.ne[3] = ne3;
    return t;
}

Tensor row_view(const Tensor & t, int64_t first, int64_t count) {
    DSV4_CHECK(first >= 0 && count >= 0 && first + count <= t.rows(), "row view [{}, {}) outside {} rows", first,
               first + count, t.rows());
    Tensor v = make_tensor(t.type, static_cast<uint8_t *>(t.data) + size_t(first) * t.row_bytes(), t.ne[0], count);
    return v;
}

Tensor reshape(const Tensor & t, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    DSV4_CHECK(ne0 * ne1 * ne2 * ne3 == t.n_elements(), "reshape of {} elements to {}x{}x{}x{}", t.n_elements(), ne0,
               ne1, ne2, ne3);
    return make_tensor(t.type, t.data, ne0, ne1, ne2, ne3);
}

}  // namespace dsv4
