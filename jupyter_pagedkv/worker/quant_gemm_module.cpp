// The packed-weight GEMM as a Python module of its own (quant_linear.py); native_decode.cpp links
// the same quant_gemm.cpp into the C++ decode loop.
#include <torch/extension.h>

#include "quant_dot.h"
#include "quant_gemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "x @ W^T from GGUF blocks (Q4_0, Q4_1, Q8_0); fp32 in and out",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear_isa", &quant_linear_isa, "the same, one ISA variant forced (tests)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_variants", &quant_variants, "the variants quant_linear_isa can run on this CPU");
  m.def("quant_dequantize", &quant_dequantize, "the fp32 weight the GEMM computes with",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_dequantize_rows", &quant_dequantize_rows, "rows of that weight (an embedding lookup)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_quantize_rows", &quant_dot::quantize, "activation rows as an int8 variant quantizes them (tests)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_interleave", &quant_interleave, "the kernels' layout of a GGUF tensor's rows of blocks",
        py::call_guard<py::gil_scoped_release>());
}
