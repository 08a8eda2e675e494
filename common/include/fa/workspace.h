/// \file workspace.h
/// \brief Device scratch memory that a step keeps from one call to the next.
///
/// A step that needs scratch memory of its own (01_naive's S and P, 02_tiled_fa1's O, m and
/// \f$\ell\f$, 08_split_kv's partial results) takes it from fa::workspace() instead of
/// allocating and freeing it in every call.
/// The buffer is allocated once, grown when a call needs more and then reused, so that a timed
/// call measures the kernels, not the allocator: memory freed with cudaFreeAsync goes back to
/// the system at the next synchronization, so whether the next call finds it again depends on
/// how the calls are queued (timed one by one, as the bench does, or back to back, as
/// compare.py does), which made the same step's figures differ by up to 1.8x.
#ifndef FA_WORKSPACE_H_
#define FA_WORKSPACE_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace fa {

/// Points `*ptr` at device memory of at least `bytes` bytes for work queued on `stream`, and
/// returns cudaSuccess, or the allocation's error (then `*ptr` is null and the error is
/// cleared). There is one buffer per (device, stream), shared by every step: work queued on
/// one stream runs in order, so two calls that share a buffer never overlap, and calls on
/// different streams get different buffers. `cudaStreamPerThread` is a different stream in
/// each host thread, so there the buffer is per (device, stream, thread). A buffer grows in
/// stream order (the old one is freed after the work already queued on `stream`), never
/// shrinks, and is kept until the process ends (a thread's, too, after the thread). Thread-safe.
inline cudaError_t workspace(size_t bytes, cudaStream_t stream, void** ptr) {
  struct Buffer {
    int device;
    cudaStream_t stream;
    std::thread::id thread;  ///< cudaStreamPerThread's thread, else none
    void* ptr;
    size_t bytes;
  };
  static std::mutex mutex;
  static std::vector<Buffer> buffers;
  *ptr = nullptr;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const std::thread::id thread =
      stream == cudaStreamPerThread ? std::this_thread::get_id() : std::thread::id();
  std::lock_guard<std::mutex> lock(mutex);
  Buffer* buffer = nullptr;
  for (Buffer& b : buffers)
    if (b.device == device && b.stream == stream && b.thread == thread) buffer = &b;
  if (buffer == nullptr) {
    buffers.push_back(Buffer{device, stream, thread, nullptr, 0});
    buffer = &buffers.back();
  }
  if (buffer->bytes < bytes || buffer->ptr == nullptr) {
    if (buffer->ptr != nullptr && cudaFreeAsync(buffer->ptr, stream) != cudaSuccess) {
      cudaGetLastError();  // e.g. the stream is gone: free it the synchronous way
      cudaFree(buffer->ptr);
    }
    buffer->ptr = nullptr;
    buffer->bytes = 0;
    err = cudaMallocAsync(&buffer->ptr, bytes > 0 ? bytes : 1, stream);
    if (err != cudaSuccess) {
      cudaGetLastError();
      buffer->ptr = nullptr;
      return err;
    }
    buffer->bytes = bytes;
  }
  *ptr = buffer->ptr;
  return cudaSuccess;
}

}  // namespace fa

#endif  // FA_WORKSPACE_H_
