// safetensors: an 8-byte little-endian header length, a JSON header (dtype, shape, byte range
// of every tensor, optional string metadata), then the raw row-major little-endian data.
#include "flexdemo/checkpoint.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace flexdemo::train {
namespace {

const std::pair<const char*, at::ScalarType> kDtypes[] = {
    {"F32", at::kFloat}, {"F64", at::kDouble}, {"BF16", at::kBFloat16},
    {"I64", at::kLong},  {"I32", at::kInt},    {"U8", at::kByte}};

const char* dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : kDtypes) {
    if (type == t) return name;
  }
  throw std::invalid_argument(std::string("safetensors: unsupported dtype ") + c10::toString(t));
}

at::ScalarType dtype_of(const std::string& name, const std::string& path) {
  for (const auto& [n, type] : kDtypes) {
    if (name == n) return type;
  }
  throw std::invalid_argument(path + ": unsupported safetensors dtype " + name);
}

}  // namespace

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = uint64_t(t.numel()) * t.element_size();
    header[name] = {{"dtype", dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(t);
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // align the data to 8 bytes
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  {
    std::ofstream out(tmp, std::ios::binary);
    uint8_t len[8];
    for (int b = 0; b < 8; ++b) len[b] = uint8_t(uint64_t(json.size()) >> (8 * b));
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(json.data(), std::streamsize(json.size()));
    for (const at::Tensor& t : data) {
      out.write(static_cast<const char*>(t.data_ptr()),
                std::streamsize(t.numel() * t.element_size()));
    }
    if (!out) throw std::runtime_error("cannot write " + tmp);
  }
  if (const int fd = ::open(tmp.c_str(), O_RDONLY); fd >= 0) {  // on disk before it is named
    ::fsync(fd);
    ::close(fd);
  }
  std::filesystem::rename(tmp, path);
}

NamedTensors read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("cannot read " + path);
  const uint64_t file_size = std::filesystem::file_size(path);
  uint8_t len[8] = {};
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t header_size = 0;
  for (int b = 0; b < 8; ++b) header_size |= uint64_t(len[b]) << (8 * b);
  if (!in || header_size > file_size - 8)
    throw std::invalid_argument(path + ": not a safetensors file");
  std::string json(header_size, '\0');
  in.read(json.data(), std::streamsize(header_size));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(json);
  } catch (const std::exception&) {
    throw std::invalid_argument(path + ": corrupt safetensors header");
  }
  const uint64_t data_size = file_size - 8 - header_size;
  NamedTensors out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    const at::ScalarType type = dtype_of(info.at("dtype").get<std::string>(), path);
    const std::vector<int64_t> shape = info.at("shape").get<std::vector<int64_t>>();
    const auto range = info.at("data_offsets").get<std::vector<uint64_t>>();
    at::Tensor t = at::empty(shape, type);
    const uint64_t bytes = uint64_t(t.numel()) * t.element_size();
    if (range.size() != 2 || range[1] > data_size || range[1] - range[0] != bytes) {
      throw std::invalid_argument(path + ": tensor " + name + " has an inconsistent byte range");
    }
    in.seekg(std::streamoff(8 + header_size + range[0]));
    in.read(static_cast<char*>(t.data_ptr()), std::streamsize(bytes));
    if (!in) throw std::invalid_argument(path + ": truncated at tensor " + name);
    out.push_back({name, t});
  }
  return out;
}

}  // namespace flexdemo::train
