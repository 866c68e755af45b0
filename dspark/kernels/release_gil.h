// Every kernel is registered with the GIL released while it runs: kernels touch no Python object,
// and holding the GIL through a pass's matmuls made the verifier's gRPC and asyncio threads (token
// streaming, step reports) wait for the engine thread's kernels instead of working beside them.
#pragma once
#include <torch/extension.h>

inline constexpr pybind11::call_guard<pybind11::gil_scoped_release> kReleaseGil{};
