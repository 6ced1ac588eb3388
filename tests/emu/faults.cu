// Hand-written kernels with the faults cuda-emu must catch, and correct ones beside them
// (tests/test_kernels_emu.py). Built as host C++ against compll/templates/emu; run as
// `faults CASE`, it prints one line: what it found.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

constexpr int T = 256;

// Each thread publishes its value, then reads its left neighbour's: correct only with the
// barrier between, whatever order the threads run in.
template <bool SYNC>
__global__ void shift(const float* in, float* out) {
  __shared__ float s[T];
  const int t = threadIdx.x;
  s[t] = in[blockIdx.x * T + t];
  if (SYNC) __syncthreads();
  out[blockIdx.x * T + t] = t > 0 ? s[t - 1] : 0.0f;
}

__global__ void exit_before_barrier(float* out) {
  if (threadIdx.x >= 128) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

__global__ void two_barriers(float* out) {
  if (threadIdx.x < 128) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

__global__ void vote_with_exited_lane(unsigned* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, threadIdx.x & 1);
}

__global__ void vote_against_barrier(unsigned* out) {
  if (threadIdx.x % 32 < 16) {
    out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, 1);
  } else {
    __syncthreads();
  }
}

__global__ void vote(const float* in, unsigned* out) {
  const unsigned i = blockIdx.x * T + threadIdx.x;
  out[i] = __ballot_sync(0xFFFFFFFFu, in[i] > 0.0f);
}

__global__ void write_even(float* out, unsigned n) {
  const unsigned i = blockIdx.x * T + threadIdx.x;
  if (i < n && i % 2 == 0) out[i] = 1.0f;
}

__global__ void read_past_end(const float* in, float* out, unsigned n) {
  const unsigned i = blockIdx.x * T + threadIdx.x;
  if (i < n) out[i] = in[i + 1];  // the last thread reads one element past the array
}

template <class K>
static float* device(const std::vector<K>& host) {
  float* d = nullptr;
  cudaMalloc(&d, host.size() * sizeof(K));
  cudaMemcpy(d, host.data(), host.size() * sizeof(K), cudaMemcpyHostToDevice);
  return d;
}

static int report(const char* what) {
  const cudaError_t e = cudaGetLastError();
  std::printf("%s: %s\n", what, e == cudaSuccess ? "ok" : cudaGetErrorString(e));
  return 0;
}

template <bool SYNC>
static int race() {
  const int blocks = 4;
  std::vector<float> in(blocks * T), out(blocks * T);
  for (int i = 0; i < blocks * T; ++i) in[i] = (float)(i + 1);
  float* din = device(in);
  float* dout = device(out);
  HP_LAUNCH(shift<SYNC>, blocks, T)(din, dout);
  cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int i = 0; i < blocks * T; ++i) wrong += out[i] != (i % T ? in[i - 1] : 0.0f);
  std::printf("wrong %d\n", wrong);
  return 0;
}

int main(int argc, char** argv) {
  const char* c = argc > 1 ? argv[1] : "";
  std::vector<float> zeros(T * 4, 0.0f);
  float* out = device(zeros);
  unsigned* words = reinterpret_cast<unsigned*>(device(zeros));
  if (!std::strcmp(c, "race-synced")) return race<true>();
  if (!std::strcmp(c, "race-missing")) return race<false>();
  if (!std::strcmp(c, "exit-before-barrier")) {
    HP_LAUNCH(exit_before_barrier, 1, T)(out);
    return report("launch");
  }
  if (!std::strcmp(c, "two-barriers")) {
    HP_LAUNCH(two_barriers, 1, T)(out);
    return report("launch");
  }
  if (!std::strcmp(c, "vote-exited")) {
    HP_LAUNCH(vote_with_exited_lane, 1, T)(words);
    return report("launch");
  }
  if (!std::strcmp(c, "deadlock")) {
    HP_LAUNCH(vote_against_barrier, 1, T)(words);
    return report("launch");
  }
  if (!std::strcmp(c, "empty-grid")) {
    HP_LAUNCH(write_even, 0, T)(out, 0u);
    return report("launch");
  }
  if (!std::strcmp(c, "vote")) {  // a correct vote: each warp's word of signs
    std::vector<float> in(T * 2);
    for (int i = 0; i < T * 2; ++i) in[i] = (i * 7919 % 13) < 6 ? 1.0f : -1.0f;
    float* din = device(in);
    unsigned* dw = reinterpret_cast<unsigned*>(device(in));
    HP_LAUNCH(vote, 2, T)(din, dw);
    std::vector<unsigned> w(T * 2);
    cudaMemcpy(w.data(), dw, w.size() * 4, cudaMemcpyDeviceToHost);
    int wrong = 0;
    for (int i = 0; i < T * 2; ++i) {
      unsigned want = 0;
      for (int l = 0; l < 32; ++l) want |= (in[i / 32 * 32 + l] > 0.0f ? 1u : 0u) << l;
      wrong += w[i] != want;
    }
    std::printf("wrong %d\n", wrong);
    return report("launch");
  }
  if (!std::strcmp(c, "unwritten")) {  // odd elements are never written
    const unsigned n = 1000;
    float* d = nullptr;
    cudaMalloc(&d, n * sizeof(float));
    HP_LAUNCH(write_even, (n + T - 1) / T, T)(d, n);
    std::vector<float> h(n);
    cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost);
    int nan = 0;
    for (float v : h) nan += std::isnan(v);
    std::printf("nan %d\n", nan);
    return 0;
  }
  if (!std::strcmp(c, "out-of-bounds")) {
    const unsigned n = 1000;
    float *a = nullptr, *b = nullptr;
    cudaMalloc(&a, n * sizeof(float));
    cudaMalloc(&b, n * sizeof(float));
    cudaMemset(a, 0, n * sizeof(float));
    HP_LAUNCH(read_past_end, (n + T - 1) / T, T)(a, b, n);
    return report("launch");
  }
  std::fprintf(stderr, "faults: unknown case %s\n", c);
  return 2;
}
