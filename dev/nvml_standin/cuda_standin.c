/* A stand-in libcuda.so.1 for the stand-in driver root: the CUDA driver API's entry points that
 * answer without a GPU, on a node whose GPUs are the NVML stand-in's (standin.c).
 *
 * A driver root holds libcuda.so.<driver version> next to libnvidia-ml.so.<driver version>;
 * NVIDIA's tools locate the driver's libraries by it (nvidia-container-toolkit's nvcdi, which
 * NVIDIA's k8s-device-plugin runs to write its CDI spec, fails without it). The stand-in GPUs run
 * no kernels, so cuInit answers CUDA_ERROR_NO_DEVICE, as the real library does on a host whose
 * GPUs it cannot use; cuDriverGetVersion answers the CUDA version of the stand-in's driver
 * (550 series: CUDA 12.4).
 *
 * Build: gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o libcuda.so.1 cuda_standin.c
 */
typedef int CUresult;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
};

#define STANDIN_CUDA_DRIVER_VERSION 12040

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version) {
    if (version == 0) return CUDA_ERROR_INVALID_VALUE;
    *version = STANDIN_CUDA_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (count == 0) return CUDA_ERROR_INVALID_VALUE;
    *count = 0;
    return CUDA_ERROR_NOT_INITIALIZED;
}
