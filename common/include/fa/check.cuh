/// \file check.cuh
/// \brief Error macros for step launchers: a failed CUDA call becomes an FA_ERR_CUDA status.
#ifndef FA_CHECK_CUH_
#define FA_CHECK_CUH_

#include <cuda_runtime.h>

#include "fa/step.h"

/// Returns FA_ERR_CUDA (with the call and CUDA's message) from the enclosing launcher if
/// `call` fails.
#define FA_CUDA_TRY(call)                                                    \
  do {                                                                       \
    cudaError_t fa_err_ = (call);                                            \
    if (fa_err_ != cudaSuccess)                                              \
      return fa::set_error(FA_ERR_CUDA, "%s failed: %s (%s:%d)", #call,      \
                           cudaGetErrorString(fa_err_), __FILE__, __LINE__); \
  } while (0)

/// Checks the launch that just happened (bad configuration, too much shared memory, ...).
#define FA_LAUNCH_TRY() FA_CUDA_TRY(cudaGetLastError())

#endif  // FA_CHECK_CUH_
