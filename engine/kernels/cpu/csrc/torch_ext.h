// The parts of torch the kernels use: torch::Tensor and ATen's factory functions and dtypes
// (torch/types.h), at::parallel_for, and pybind11 with torch's Tensor casters (`py`, the module
// macro). Included instead of <torch/extension.h>, which also brings in the whole C++ frontend
// (autograd API, nn, optim, data loaders): measured here, that header alone took ~35 s of the ~38 s
// each kernel took to compile; these ~21 s.
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
