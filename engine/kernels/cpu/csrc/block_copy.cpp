// Copies of whole KV-cache block rows that take the bytes' CRC32C on the way (one pass over memory).
//
// A KV transfer moves a chunk of block rows (one row = one block of one layer's K or V: block_size x
// heads x head_dim elements, 12 KiB for SmolLM2 in float32) from the paged cache into a wire
// message, and checksums the bytes with CRC32C. Done as separate passes (gather into a buffer,
// CRC32C over it, copy it into the message) each pass streams the whole chunk from memory; here
// each row is copied and then checksummed while it is still in L1/L2, so memory is streamed once.
//
// The CRC32C itself is computed by the caller's function (google-crc32c's
// `crc32c_extend(crc, data, n)`, the hardware instruction with its 3-stream interleave, passed in
// as an address): these loops only order the rows, so the checksum is exactly that of the
// chunk's C-order bytes, the same as one call over a contiguous copy.
//
// gather_framed: rows[:, index] (bytes) appended to a prefix, into one new Python `bytes` object
// (what gRPC Python sends), with the payload's CRC32C written big-endian into the prefix at
// crc_pos (the 4 bytes of a msgpack uint32 placeholder). gather_crc: rows[:, index] into a given
// contiguous tensor, returning its CRC32C (a tensor sent outside the message).
#include "torch_ext.h"
#include <Python.h>

#include <cstdint>
#include <cstring>

namespace {

using CrcExtend = uint32_t (*)(uint32_t, const uint8_t*, size_t);

CrcExtend crc_function(int64_t address) {
  TORCH_CHECK(address != 0, "crc32c_extend: a null function address");
  return reinterpret_cast<CrcExtend>(static_cast<uintptr_t>(address));
}

// rows: [planes, num_rows, row_bytes] uint8 with contiguous rows; index: [n] int64 in [0, num_rows)
void check_rows(const torch::Tensor& rows, const torch::Tensor& index) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == torch::kUInt8 && rows.dim() == 3 &&
                  rows.stride(2) == 1,
              "rows must be a CPU uint8 [planes, num_rows, row_bytes] tensor with contiguous rows, got ",
              rows.scalar_type(), " ", rows.sizes(), " strides ", rows.strides());
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == torch::kLong && index.dim() == 1 &&
                  index.is_contiguous() && index.numel() > 0,
              "index must be a non-empty contiguous CPU int64 [n] tensor, got ", index.scalar_type(), " ",
              index.sizes());
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t j = 0; j < index.numel(); ++j)
    TORCH_CHECK(idx[j] >= 0 && idx[j] < rows.size(1), "index[", j, "] = ", idx[j], " outside [0, ",
                rows.size(1), ")");
}

// dst <- rows[:, index] (planes * n rows of row_bytes, in that order), returning their CRC32C
uint32_t gather_rows(const torch::Tensor& rows, const torch::Tensor& index, uint8_t* dst, CrcExtend extend) {
  const uint8_t* base = rows.data_ptr<uint8_t>();
  const int64_t* idx = index.data_ptr<int64_t>();
  const int64_t planes = rows.size(0), n = index.numel(), row_bytes = rows.size(2);
  const int64_t s0 = rows.stride(0), s1 = rows.stride(1);
  uint32_t crc = 0;
  py::gil_scoped_release nogil;  // dst is the caller's alone until it returns
  for (int64_t i = 0; i < planes; ++i)
    for (int64_t j = 0; j < n; ++j, dst += row_bytes) {
      std::memcpy(dst, base + i * s0 + idx[j] * s1, row_bytes);
      crc = extend(crc, dst, row_bytes);  // the row just written, from cache
    }
  return crc;
}

}  // namespace

py::object gather_framed(py::bytes prefix, torch::Tensor rows, torch::Tensor index, int64_t crc_extend,
                         int64_t crc_pos) {
  check_rows(rows, index);
  const CrcExtend extend = crc_function(crc_extend);
  char* head = nullptr;
  Py_ssize_t head_len = 0;
  if (PyBytes_AsStringAndSize(prefix.ptr(), &head, &head_len) != 0) throw py::error_already_set();
  TORCH_CHECK(crc_pos >= 0 && crc_pos + 4 <= head_len, "crc_pos ", crc_pos, " leaves no 4 bytes in a ",
              head_len, "-byte prefix");
  const int64_t payload = rows.size(0) * index.numel() * rows.size(2);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, head_len + payload);  // uninitialized: filled below
  if (out == nullptr) throw py::error_already_set();
  auto result = py::reinterpret_steal<py::object>(out);
  uint8_t* dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out));
  std::memcpy(dst, head, head_len);
  const uint32_t crc = gather_rows(rows, index, dst + head_len, extend);
  for (int b = 0; b < 4; ++b) dst[crc_pos + b] = static_cast<uint8_t>(crc >> (24 - 8 * b));
  return result;
}

int64_t gather_crc(torch::Tensor rows, torch::Tensor index, torch::Tensor out, int64_t crc_extend) {
  check_rows(rows, index);
  const int64_t bytes = rows.size(0) * index.numel() * rows.size(2);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kUInt8 && out.is_contiguous() &&
                  out.numel() == bytes,
              "out must be a contiguous CPU uint8 tensor of ", bytes, " bytes, got ", out.scalar_type(), " ",
              out.sizes());
  return gather_rows(rows, index, out.data_ptr<uint8_t>(), crc_function(crc_extend));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "KV block row copies with the CRC32C taken on the way (one pass over memory)";
  m.def("gather_framed", &gather_framed,
        "prefix + bytes of rows[:, index] as one new bytes object, the payload's CRC32C written big-endian at "
        "crc_pos",
        py::arg("prefix"), py::arg("rows"), py::arg("index"), py::arg("crc_extend"), py::arg("crc_pos"));
  m.def("gather_crc", &gather_crc, "out = rows[:, index] (contiguous); returns its CRC32C", py::arg("rows"),
        py::arg("index"), py::arg("out"), py::arg("crc_extend"));
}
