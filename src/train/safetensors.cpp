// safetensors: an 8-byte little-endian header length, a JSON header (dtype, shape, byte range
// of every tensor, optional string metadata), then the raw row-major little-endian data.
#include "flexdemo/safetensors.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace flexdemo::train {
namespace {

const std::pair<const char*, at::ScalarType> kDtypes[] = {
    {"F32", at::kFloat}, {"F64", at::kDouble}, {"BF16", at::kBFloat16}, {"F16", at::kHalf},
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
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
}

std::vector<std::string> safetensors_names(const std::string& path) {
  auto bad = [&](const std::string& why) { return std::invalid_argument(path + ": " + why); };
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(path, error);
  std::ifstream in(path, std::ios::binary);
  if (error || !in) throw std::invalid_argument("cannot read " + path);
  uint8_t length[8] = {};
  if (size < 8 || !in.read(reinterpret_cast<char*>(length), 8)) {
    throw bad("not a safetensors file (shorter than its 8-byte header length)");
  }
  uint64_t header_size = 0;
  for (int b = 0; b < 8; ++b) header_size |= uint64_t(length[b]) << (8 * b);
  if (header_size > size - 8) throw bad("not a safetensors file (header longer than the file)");
  std::string header(header_size, '\0');
  if (!in.read(header.data(), std::streamsize(header_size))) throw bad("cannot read its header");
  std::vector<std::string> names;
  try {
    const nlohmann::json parsed = nlohmann::json::parse(header);
    if (!parsed.is_object()) throw bad("the safetensors header is not a JSON object");
    for (const auto& item : parsed.items()) {
      if (item.key() != "__metadata__") names.push_back(item.key());
    }
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("corrupt safetensors header (") + e.what() + ")");
  }
  return names;
}

NamedTensors parse_safetensors(const uint8_t* data, size_t size, const std::string& name) {
  auto bad = [&](const std::string& why) { return std::invalid_argument(name + ": " + why); };
  if (size < 8) throw bad("not a safetensors file (shorter than its 8-byte header length)");
  uint64_t header_size = 0;
  for (int b = 0; b < 8; ++b) header_size |= uint64_t(data[b]) << (8 * b);
  if (header_size > size - 8) throw bad("not a safetensors file (header longer than the file)");
  const uint8_t* body = data + 8 + header_size;
  const uint64_t data_size = size - 8 - header_size;
  NamedTensors out;
  try {
    const nlohmann::json header =
        nlohmann::json::parse(data + 8, data + 8 + header_size, nullptr, /*exceptions=*/true);
    if (!header.is_object()) throw bad("the safetensors header is not a JSON object");
    for (const auto& item : header.items()) {
      const std::string& tensor = item.key();
      const nlohmann::json& info = item.value();
      if (tensor == "__metadata__") continue;
      // Every number is checked to be an integer first: converting another JSON number (1e118)
      // to an integer type is undefined behaviour.
      auto integers = [&](const char* field) {
        const nlohmann::json& list = info.at(field);
        if (!list.is_array()) throw bad("tensor " + tensor + ": " + field + " is not a list");
        for (const auto& v : list) {
          if (!v.is_number_integer()) {
            throw bad("tensor " + tensor + ": " + field + " holds a non-integer");
          }
        }
        return list;
      };
      const at::ScalarType type = dtype_of(info.at("dtype").get<std::string>(), name);
      const std::vector<int64_t> shape = integers("shape").get<std::vector<int64_t>>();
      const nlohmann::json offsets = integers("data_offsets");
      for (const auto& v : offsets) {
        if (!v.is_number_unsigned()) throw bad("tensor " + tensor + " has a negative offset");
      }
      const auto range = offsets.get<std::vector<uint64_t>>();
      // The byte count, checked against the file before anything is allocated.
      uint64_t bytes = c10::elementSize(type);
      for (int64_t d : shape) {
        if (d < 0 || (d > 0 && bytes > data_size / uint64_t(d))) {
          throw bad("tensor " + tensor + " has an impossible shape");
        }
        bytes *= uint64_t(d);
      }
      if (range.size() != 2 || range[0] > range[1] || range[1] > data_size ||
          range[1] - range[0] != bytes) {
        throw bad("tensor " + tensor + " has an inconsistent byte range");
      }
      at::Tensor t = at::empty(shape, type);
      if (bytes > 0) std::memcpy(t.data_ptr(), body + range[0], bytes);
      out.push_back({tensor, t});
    }
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("corrupt safetensors header (") + e.what() + ")");
  }
  return out;
}

}  // namespace flexdemo::train
