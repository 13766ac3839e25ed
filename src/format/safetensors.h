// safetensors (HF checkpoints): one file, or a folder of shards listed by model.safetensors.index.json.
// Memory-mapped and validated like the GGUF reader: header length and JSON, dtypes, shapes against byte
// ranges, ranges inside the file and not overlapping; errors name the file and the tensor.
#pragma once

#include "util/file.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

enum class StDtype { F64, F32, F16, BF16, F8_E4M3, F8_E8M0, U8, I8, I16, I32, I64, BOOL };

std::string_view st_dtype_name(StDtype dtype);
size_t st_dtype_size(StDtype dtype);

struct StTensor {
    std::string name;
    StDtype dtype = StDtype::F32;
    std::vector<int64_t> shape;  // torch order: shape[0] is the outermost axis
    const uint8_t * data = nullptr;
    size_t n_bytes = 0;
    const std::string * file = nullptr;  // the shard it lives in

    int64_t n_elements() const;
};

class SafetensorsSet {
  public:
    // `path` is a .safetensors file, or a folder holding model.safetensors.index.json (shards) or a single
    // model.safetensors.
    static SafetensorsSet open(const std::string & path);

    const std::vector<StTensor> & tensors() const { return tensors_; }
    const StTensor * find(std::string_view name) const;
    const StTensor & get(std::string_view name) const;  // throws naming the tensor when missing
    const std::map<std::string, std::string> & metadata() const { return metadata_; }

  private:
    void add_file(const std::string & path);

    std::vector<std::unique_ptr<MappedFile>> files_;
    std::vector<std::unique_ptr<std::string>> file_names_;
    std::vector<StTensor> tensors_;
    std::map<std::string, size_t, std::less<>> index_;
    std::map<std::string, std::string> metadata_;
};

}  // namespace dsv4
