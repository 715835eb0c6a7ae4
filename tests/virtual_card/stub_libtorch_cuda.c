/* A CPU-only stand-in for a CUDA build of torch's libtorch_cuda.so (and libc10_cuda.so): the C entry points vLLM
   0.31's compiled extensions take from it (read with `nm -D --undefined-only` on vllm/*.so against the CPU torch of the
   GPU install set; tests/test_card_matrix.py checks the list). Each returns an error: nothing runs on a device. */
int aoti_torch_get_current_cuda_stream(int device, void **stream) { if (stream) *stream = 0; return 1; }
int torch_get_current_cuda_blas_handle(void **handle) { if (handle) *handle = 0; return 1; }
int torch_c10_cuda_check_msg(int error, const char *file, const char *function, unsigned line, int device_assert,
                             char **message) { if (message) *message = 0; return 1; }
void torch_c10_cuda_free_error_msg(char *message) {}
int cublasHgemm(void *handle, int transa, int transb, int m, int n, int k, const void *alpha, const void *a, int lda,
                const void *b, int ldb, const void *beta, void *c, int ldc) { return 3; /* CUBLAS_STATUS_NOT_INITIALIZED */ }
