/* A stand-in libnvidia-ml.so.1 for tests: the NVML entry points the agent's pynvml calls,
 * answered from a memory-mapped state file (standin.h) that a Python driver fills with the
 * simulated GPUs' physics and faults.
 *
 * Loaded by the real pynvml through the library path (LD_LIBRARY_PATH or an already loaded
 * object with the soname libnvidia-ml.so.1), so the agent's whole pynvml code path runs
 * without a GPU. The state file is named by RLENERGY_NVML_STANDIN_STATE; without it
 * nvmlInit fails with NVML_ERROR_DRIVER_NOT_LOADED, as on a node without the driver.
 *
 * Visible GPUs: NVML in a container enumerates only the GPUs whose device nodes the container
 * has. The stand-in GPUs have no device nodes; their CDI spec's devices give the container the
 * env RLENERGY_NVML_STANDIN_GPU_<n>=<uuid> instead (rlenergy/devcluster/realnode.py cdi_spec).
 * When any such variable is set at nvmlInit, only the GPUs it names are visible (count, index,
 * UUID lookup), in the state file's order; without one, every GPU of the state file is.
 *
 * Build: gcc -shared -fPIC -O2 -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 standin.c
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "standin.h"

typedef int nvmlReturn_t;
typedef standin_gpu_t *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_FI_DEV_POWER_AVERAGE 185
#define NVML_FI_DEV_POWER_INSTANT 186
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define REASON_GPU_IDLE 0x1ull
#define REASON_SW_POWER_CAP 0x4ull

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* A MIG device handle: it points into this table, never into the state file. */
typedef struct {
    uint32_t tag;
    uint32_t parent;
    uint32_t index;
} mig_handle_t;
#define MIG_TAG 0x4D494748u
static mig_handle_t g_mig[STANDIN_MAX_GPUS][STANDIN_MAX_MIG];

static standin_state_t *g_state = NULL;
static int g_refcount = 0;
static uint32_t g_visible[STANDIN_MAX_GPUS]; /* state index of each visible GPU, by NVML index */
static uint32_t g_n_visible = 0;

extern char **environ;
#define VISIBLE_ENV_PREFIX "RLENERGY_NVML_STANDIN_GPU_"

/* The GPUs this process sees (see the header comment): read once per mapping of the state. */
static void load_visible(void) {
    int filtered = 0;
    int named[STANDIN_MAX_GPUS] = {0};
    size_t plen = strlen(VISIBLE_ENV_PREFIX);
    for (char **e = environ; e != NULL && *e != NULL; e++) {
        if (strncmp(*e, VISIBLE_ENV_PREFIX, plen) != 0) continue;
        const char *eq = strchr(*e, '=');
        if (eq == NULL) continue;
        filtered = 1;
        for (uint32_t i = 0; i < g_state->n_gpus && i < STANDIN_MAX_GPUS; i++)
            if (strncmp(g_state->gpus[i].uuid, eq + 1, sizeof g_state->gpus[i].uuid) == 0)
                named[i] = 1;
    }
    g_n_visible = 0;
    for (uint32_t i = 0; i < g_state->n_gpus && i < STANDIN_MAX_GPUS; i++)
        if (!filtered || named[i]) g_visible[g_n_visible++] = i;
}

static int is_visible(uint32_t state_index) {
    for (uint32_t k = 0; k < g_n_visible; k++)
        if (g_visible[k] == state_index) return 1;
    return 0;
}

size_t rlenergy_standin_state_size(void) { return sizeof(standin_state_t); }
size_t rlenergy_standin_gpu_size(void) { return sizeof(standin_gpu_t); }

static nvmlReturn_t map_state(void) {
    if (g_state != NULL) return NVML_SUCCESS;
    const char *path = getenv("RLENERGY_NVML_STANDIN_STATE");
    if (path == NULL || *path == '\0') return NVML_ERROR_DRIVER_NOT_LOADED;
    int fd = open(path, O_RDWR);
    if (fd < 0) return NVML_ERROR_DRIVER_NOT_LOADED;
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(standin_state_t)) {
        close(fd);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    void *p = mmap(NULL, sizeof(standin_state_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return NVML_ERROR_DRIVER_NOT_LOADED;
    standin_state_t *s = (standin_state_t *)p;
    if (s->magic != STANDIN_MAGIC || s->version != STANDIN_VERSION) {
        munmap(p, sizeof(standin_state_t));
        return NVML_ERROR_LIB_RM_VERSION_MISMATCH;
    }
    g_state = s;
    load_visible();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (g_refcount == 0 && g_state != NULL) {
        munmap(g_state, sizeof(standin_state_t));
        g_state = NULL;
    }
    nvmlReturn_t r = map_state();
    if (r != NVML_SUCCESS) return r;
    if (g_state->init_error != 0) return g_state->init_error;
    g_refcount++;
    __atomic_add_fetch(&g_state->init_count, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (g_refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    g_refcount--;
    if (g_refcount == 0 && g_state != NULL) {
        /* The next nvmlInit maps the file named then (one state file per test). */
        munmap(g_state, sizeof(standin_state_t));
        g_state = NULL;
    }
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_NOT_READY: return "System is not in ready state";
    default: return "Unknown Error";
    }
}

static int ready(void) { return g_state != NULL && g_refcount > 0; }

static int valid_gpu(nvmlDevice_t d) {
    if (!ready() || d == NULL) return 0;
    uintptr_t lo = (uintptr_t)&g_state->gpus[0];
    uintptr_t hi = (uintptr_t)&g_state->gpus[g_state->n_gpus];
    uintptr_t p = (uintptr_t)d;
    return p >= lo && p < hi && (p - lo) % sizeof(standin_gpu_t) == 0;
}

static void delay(const standin_gpu_t *g) {
    if (g->call_delay_us > 0) {
        struct timespec ts = {g->call_delay_us / 1000000u, (long)(g->call_delay_us % 1000000u) * 1000L};
        nanosleep(&ts, NULL);
    }
}

/* Common entry check of every device call: handle, faults, call counting. */
static nvmlReturn_t enter(nvmlDevice_t d) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    if (!valid_gpu(d)) return NVML_ERROR_INVALID_ARGUMENT;
    delay(d);
    __atomic_add_fetch(&d->nvml_calls, 1, __ATOMIC_SEQ_CST);
    if (g_state->fail_all != 0) return g_state->fail_all;
    if (d->fail_all != 0) return d->fail_all;
    int once = __atomic_exchange_n(&d->fail_once, 0, __ATOMIC_SEQ_CST);
    if (once != 0) return once;
    return NVML_SUCCESS;
}

#define ENTER(d)                         \
    do {                                 \
        nvmlReturn_t _r = enter(d);      \
        if (_r != NVML_SUCCESS) return _r; \
    } while (0)

static nvmlReturn_t copy_str(const char *src, size_t cap, char *dst, unsigned int len) {
    if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strnlen(src, cap);
    if (len < n + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n);
    dst[n] = '\0';
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    return copy_str(g_state->driver_version, sizeof g_state->driver_version, version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    return copy_str("12.standin", 11, version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = g_n_visible;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= g_n_visible) return NVML_ERROR_INVALID_ARGUMENT;
    standin_gpu_t *g = &g_state->gpus[g_visible[index]];
    if (g->fail_all == NVML_ERROR_GPU_IS_LOST) return NVML_ERROR_GPU_IS_LOST;
    *device = g;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (uint32_t i = 0; i < g_state->n_gpus; i++) {
        if (strncmp(g_state->gpus[i].uuid, uuid, 96) == 0) {
            if (!is_visible(i)) return NVML_ERROR_NOT_FOUND; /* not this container's GPU */
            /* NVML: GPU_IS_LOST when the target GPU has fallen off the bus (as by index). */
            if (g_state->gpus[i].fail_all == NVML_ERROR_GPU_IS_LOST) return NVML_ERROR_GPU_IS_LOST;
            *device = &g_state->gpus[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static mig_handle_t *as_mig(void *d) {
    for (int i = 0; i < STANDIN_MAX_GPUS; i++)
        for (int j = 0; j < STANDIN_MAX_MIG; j++)
            if ((void *)&g_mig[i][j] == d && g_mig[i][j].tag == MIG_TAG) return &g_mig[i][j];
    return NULL;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    mig_handle_t *m = ready() ? as_mig(device) : NULL;
    if (m != NULL) {
        char buf[128];
        snprintf(buf, sizeof buf, "MIG-%s-%u", g_state->gpus[m->parent].uuid + 4, m->index);
        return copy_str(buf, sizeof buf, uuid, length);
    }
    ENTER(device);
    return copy_str(device->uuid, sizeof device->uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER(device);
    return copy_str(device->name, sizeof device->name, name, length);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    ENTER(device);
    if (current == NULL || pending == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->architecture < 8) return NVML_ERROR_NOT_SUPPORTED; /* MIG needs Ampere+ */
    *current = device->mig_mode;
    *pending = device->mig_mode;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER(device);
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = device->mig_mode ? device->mig_count : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 void **mig) {
    ENTER(device);
    if (mig == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->mig_mode || index >= device->mig_count || index >= STANDIN_MAX_MIG)
        return NVML_ERROR_NOT_FOUND;
    uint32_t parent = (uint32_t)(device - &g_state->gpus[0]);
    mig_handle_t *m = &g_mig[parent][index];
    m->tag = MIG_TAG;
    m->parent = parent;
    m->index = index;
    *mig = m;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(void *mig, nvmlDevice_t *device) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    mig_handle_t *m = as_mig(mig);
    if (m == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_state->gpus[m->parent];
    return NVML_SUCCESS;
}

/* nvmlDeviceAttributes_t (nvml.h): what a MIG instance's profile gives it. */
typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

/* A MIG instance answers its profile's slices (mig_slices, 0 = 1); a whole GPU all 7. */
nvmlReturn_t nvmlDeviceGetAttributes_v2(void *device, nvmlDeviceAttributes_t *attrs) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    if (attrs == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    mig_handle_t *m = as_mig(device);
    unsigned int slices = STANDIN_MAX_MIG;
    if (m != NULL) {
        slices = g_state->gpus[m->parent].mig_slices[m->index];
        if (slices == 0) slices = 1;
    } else {
        ENTER((nvmlDevice_t)device);
    }
    memset(attrs, 0, sizeof *attrs);
    attrs->multiprocessorCount = 18 * slices;
    attrs->gpuInstanceSliceCount = slices;
    attrs->computeInstanceSliceCount = slices;
    attrs->memorySizeMB = 10240ull * slices;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode) {
    ENTER(device);
    if (mode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = (int)device->persistence_mode;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch) {
    ENTER(device);
    if (arch == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *arch = device->architecture;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t device, unsigned int *count,
                                                unsigned int *clocks) {
    ENTER(device);
    if (device->fail_clocks) return device->fail_clocks;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < 1 || clocks == NULL) {
        *count = 1;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = 1;
    clocks[0] = device->mem_clock_mhz;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedGraphicsClocks(nvmlDevice_t device, unsigned int mem_mhz,
                                                  unsigned int *count, unsigned int *clocks) {
    ENTER(device);
    if (device->fail_clocks) return device->fail_clocks;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (mem_mhz != device->mem_clock_mhz) return NVML_ERROR_NOT_FOUND;
    uint32_t n = device->n_sm_clocks;
    if (n > STANDIN_MAX_CLOCKS) n = STANDIN_MAX_CLOCKS;
    if (*count < n || clocks == NULL) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (uint32_t i = 0; i < n; i++) clocks[i] = device->sm_clocks_mhz[i];
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    ENTER(device);
    if (device->fail_clocks) return device->fail_clocks;
    if (clock == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *clock = (type == 2) ? device->mem_clock_mhz : device->max_sm_clock_mhz;
    return NVML_SUCCESS;
}

/* The SM clock the GPU runs: the lower of its unlocked clock, the lock and the cap, snapped
 * down to a supported clock. */
static uint32_t effective_sm_clock(const standin_gpu_t *g, uint32_t *target_out) {
    uint32_t target = g->locked ? g->lock_max_mhz : g->max_sm_clock_mhz;
    uint32_t clock = target;
    if (g->natural_clock_mhz > 0 && g->natural_clock_mhz < clock) clock = g->natural_clock_mhz;
    if (g->clock_cap_mhz > 0 && g->clock_cap_mhz < clock) clock = g->clock_cap_mhz;
    uint32_t snapped = 0;
    for (uint32_t i = 0; i < g->n_sm_clocks && i < STANDIN_MAX_CLOCKS; i++) {
        if (g->sm_clocks_mhz[i] <= clock && g->sm_clocks_mhz[i] > snapped)
            snapped = g->sm_clocks_mhz[i];
    }
    if (target_out) *target_out = target;
    return snapped > 0 ? snapped : clock;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    ENTER(device);
    if (device->fail_clocks) return device->fail_clocks;
    if (clock == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (type == 2) {
        *clock = device->mem_clock_mhz;
    } else if (device->idle && !device->locked) {
        *clock = device->n_sm_clocks ? device->sm_clocks_mhz[device->n_sm_clocks - 1] : 0;
    } else {
        *clock = effective_sm_clock(device, NULL);
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *r) {
    ENTER(device);
    if (r == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long reasons = device->extra_reasons;
    if (device->idle) {
        reasons |= REASON_GPU_IDLE;
    } else {
        uint32_t target = 0;
        uint32_t eff = effective_sm_clock(device, &target);
        /* silent_cap: a driver holding the clock down and reporting no reason at all. */
        if (eff < target && !device->silent_cap) reasons |= REASON_SW_POWER_CAP;
    }
    *r = reasons;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *r) {
    return nvmlDeviceGetCurrentClocksEventReasons(d, r);
}

static int is_supported_clock(const standin_gpu_t *g, unsigned int mhz) {
    for (uint32_t i = 0; i < g->n_sm_clocks && i < STANDIN_MAX_CLOCKS; i++)
        if (g->sm_clocks_mhz[i] == mhz) return 1;
    return 0;
}

nvmlReturn_t nvmlDeviceSetGpuLockedClocks(nvmlDevice_t device, unsigned int min_mhz,
                                          unsigned int max_mhz) {
    ENTER(device);
    if (device->fail_clock_set) return device->fail_clock_set;
    if (device->architecture < 7) return NVML_ERROR_NOT_SUPPORTED; /* Volta+ */
    if (min_mhz > max_mhz || !is_supported_clock(device, min_mhz) ||
        !is_supported_clock(device, max_mhz))
        return NVML_ERROR_INVALID_ARGUMENT;
    device->lock_min_mhz = min_mhz;
    device->lock_max_mhz = max_mhz;
    __atomic_store_n(&device->locked, 1u, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&device->clock_writes, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceResetGpuLockedClocks(nvmlDevice_t device) {
    ENTER(device);
    if (device->fail_clock_set) return device->fail_clock_set;
    if (device->architecture < 7) return NVML_ERROR_NOT_SUPPORTED;
    __atomic_store_n(&device->locked, 0u, __ATOMIC_SEQ_CST);
    device->lock_min_mhz = 0;
    device->lock_max_mhz = 0;
    __atomic_add_fetch(&device->clock_writes, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetMemoryLockedClocks(nvmlDevice_t device, unsigned int lo, unsigned int hi) {
    ENTER(device);
    if (device->fail_mem_lock) return device->fail_mem_lock;
    if (device->architecture < 8) return NVML_ERROR_NOT_SUPPORTED; /* Ampere+ */
    if (lo > hi) return NVML_ERROR_INVALID_ARGUMENT;
    device->mem_locked = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceResetMemoryLockedClocks(nvmlDevice_t device) {
    ENTER(device);
    if (device->fail_mem_lock) return device->fail_mem_lock;
    if (device->architecture < 8) return NVML_ERROR_NOT_SUPPORTED;
    device->mem_locked = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *mj) {
    ENTER(device);
    if (device->fail_energy) return device->fail_energy;
    if (device->architecture < 7) return NVML_ERROR_NOT_SUPPORTED; /* Volta+ */
    if (mj == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *mj = __atomic_load_n(&device->energy_mj, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *mw) {
    ENTER(device);
    if (device->fail_power) return device->fail_power;
    if (mw == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *mw = device->power_avg_mw;
    return NVML_SUCCESS;
}

/* nvmlMemory_t (v1): total, free, used framebuffer memory in bytes (NVML API reference). */
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER(device);
    if (device->fail_memory) return device->fail_memory;
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t total = device->memory_total_bytes, used = device->memory_used_bytes;
    memory->total = total;
    memory->used = used < total ? used : total;
    memory->free = total - memory->used;
    return NVML_SUCCESS;
}

/* Instant power at the lock held now (the driver's table), else the driver's last update. */
static uint32_t instant_power_mw(const standin_gpu_t *g) {
    uint32_t locked = __atomic_load_n(&g->locked, __ATOMIC_SEQ_CST);
    uint32_t lock = g->lock_max_mhz;
    if (!locked) return g->power_unlocked_mw ? g->power_unlocked_mw : g->power_instant_mw;
    for (uint32_t i = 0; i < g->n_sm_clocks && i < STANDIN_MAX_CLOCKS; i++)
        if (g->sm_clocks_mhz[i] == lock && g->power_at_lock_mw[i]) return g->power_at_lock_mw[i];
    return g->power_instant_mw;
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values) {
    ENTER(device);
    if (values == NULL || count < 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
        v->latencyUsec = 0;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v->nvmlReturn = NVML_SUCCESS;
        if (v->fieldId == NVML_FI_DEV_POWER_INSTANT) {
            if (device->fail_power) v->nvmlReturn = device->fail_power;
            else if (device->fail_instant) v->nvmlReturn = device->fail_instant;
            else if (device->architecture < 9) v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            else v->value.uiVal = instant_power_mw(device);
        } else if (v->fieldId == NVML_FI_DEV_POWER_AVERAGE) {
            if (device->fail_power) v->nvmlReturn = device->fail_power;
            else v->value.uiVal = device->power_avg_mw;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *mw) {
    ENTER(device);
    if (device->fail_power) return device->fail_power;
    if (mw == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *mw = device->power_limit_mw;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *mw) {
    return nvmlDeviceGetEnforcedPowerLimit(device, mw);
}
/* The stand-in never changes its limit, so the default limit is the one in force. */
nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned int *mw) {
    return nvmlDeviceGetEnforcedPowerLimit(device, mw);
}
nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *lo,
                                                          unsigned int *hi) {
    ENTER(device);
    if (device->fail_power) return device->fail_power;
    if (lo == NULL || hi == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *lo = device->min_power_limit_mw;
    *hi = device->power_limit_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *u) {
    ENTER(device);
    if (u == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    u->gpu = device->util_gpu;
    u->memory = device->util_mem;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------
 * What NVIDIA's k8s-device-plugin (v0.17.4, through go-nvml, go-nvlib and go-gpuallocator)
 * asks of a GPU besides the calls above: its device node, PCI identity, compute capability,
 * topology and health events. Every value comes from the GPU's place in the state file, so a
 * GPU keeps it inside a container that sees fewer GPUs (as /dev/nvidia<minor> does).
 * ------------------------------------------------------------------------------------------ */

static uint32_t state_index(nvmlDevice_t d) { return (uint32_t)(d - &g_state->gpus[0]); }

/* The minor number of the GPU's device node /dev/nvidia<minor>: its index in the state file. */
nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    ENTER(device);
    if (minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = state_index(device);
    return NVML_SUCCESS;
}

/* nvmlDeviceGetIndex: the GPU's NVML index in this process (its rank among the visible GPUs). */
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER(device);
    if (index == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t s = state_index(device);
    for (uint32_t k = 0; k < g_n_visible; k++) {
        if (g_visible[k] == s) {
            *index = k;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* nvmlPciInfo_t (v2 and v3 share this layout; nvml.h). */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;    /* (device ID << 16) | vendor ID */
    unsigned int pciSubSystemId; /* (subsystem ID << 16) | subsystem vendor ID */
    char busId[32];
} nvmlPciInfo_t;

#define PCI_VENDOR_NVIDIA 0x10DEu

/* PCI device IDs of the boards the stand-in names (the PCI ID repository, pci-ids.ucw.cz). */
static unsigned int pci_device_id(const standin_gpu_t *g) {
    static const struct { const char *name; unsigned int id; } ids[] = {
        {"H200", 0x2335u}, {"H100 80GB HBM3", 0x2330u}, {"H100", 0x2330u},
        {"A100-SXM4-80GB", 0x20B2u}, {"A100", 0x20B0u}, {"L40S", 0x26B9u},
        {"B200", 0x2901u}, {"GH200", 0x2342u},
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (strstr(g->name, ids[i].name) != NULL) return ids[i].id;
    return 0u;
}

/* Stand-in GPU i sits at PCI bus 0x18 + 0x10 * i, domain 0, device 0, function 0 (an HGX-like
 * spread; there is no such bus on the host, so /sys/bus/pci/devices/<busId> is absent and the
 * device plugin reports no NUMA node, as it does for a GPU whose firmware gives none). */
static nvmlReturn_t pci_info(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER(device);
    if (pci == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t i = state_index(device);
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = (0x18u + 0x10u * i) & 0xFFu;
    pci->device = 0;
    pci->pciDeviceId = (pci_device_id(device) << 16) | PCI_VENDOR_NVIDIA;
    pci->pciSubSystemId = (0x16C1u << 16) | PCI_VENDOR_NVIDIA;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", pci->domain, pci->bus,
             pci->device);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", pci->domain, pci->bus, pci->device);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return pci_info(device, pci);
}
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return pci_info(device, pci);
}

/* CUDA compute capability of the GPU's architecture (nvmlDeviceArchitecture_t: 5 Volta 7.0,
 * 6 Turing 7.5, 7 Ampere 8.0, 8 Ada 8.9, 9 Hopper 9.0, 10 Blackwell 10.0; CUDA C Programming
 * Guide, "Compute Capabilities"). */
nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    ENTER(device);
    if (major == NULL || minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    static const int cc[][2] = {{7, 0}, {7, 5}, {8, 0}, {8, 9}, {9, 0}, {10, 0}};
    uint32_t a = device->architecture;
    if (a < 5 || a > 10) return NVML_ERROR_NOT_SUPPORTED;
    *major = cc[a - 5][0];
    *minor = cc[a - 5][1];
    return NVML_SUCCESS;
}

/* nvmlBrandType_t: NVML_BRAND_NVIDIA (14) for data-center boards without another brand. */
nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, int *brand) {
    ENTER(device);
    if (brand == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *brand = 14;
    return NVML_SUCCESS;
}

/* nvmlGpuTopologyLevel_t */
enum {
    NVML_TOPOLOGY_INTERNAL = 0,
    NVML_TOPOLOGY_SINGLE = 10,
    NVML_TOPOLOGY_MULTIPLE = 20,
    NVML_TOPOLOGY_HOSTBRIDGE = 30,
    NVML_TOPOLOGY_NODE = 40,
    NVML_TOPOLOGY_SYSTEM = 50,
};

/* The PCIe path between two GPUs, two sockets as on an HGX board: GPUs 0-3 and 4-7 (state
 * index) hang off one CPU each, in pairs under one PCIe switch. */
nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t d1, nvmlDevice_t d2, int *level) {
    ENTER(d1);
    ENTER(d2);
    if (level == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t a = state_index(d1), b = state_index(d2);
    if (a == b) *level = NVML_TOPOLOGY_INTERNAL;
    else if (a / 2 == b / 2) *level = NVML_TOPOLOGY_SINGLE;
    else if (a / 4 == b / 4) *level = NVML_TOPOLOGY_NODE;
    else *level = NVML_TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

/* The stand-in GPUs have no NVLink (as PCIe boards): every link query is NOT_SUPPORTED. */
nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *active) {
    ENTER(device);
    (void)link;
    if (active == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}
nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                 nvmlPciInfo_t *pci) {
    ENTER(device);
    (void)link;
    if (pci == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

/* Events (nvmlEventType*, nvml.h). The stand-in raises one: Xid 79 ("GPU has fallen off the
 * bus") once for a registered GPU the driver marks lost (standin.StandinDriver.lose), as the
 * kernel driver does; the other registered types never fire. */
#define EVENT_SINGLE_BIT_ECC 0x1ull
#define EVENT_DOUBLE_BIT_ECC 0x2ull
#define EVENT_PSTATE 0x4ull
#define EVENT_XID_CRITICAL 0x8ull
#define EVENT_CLOCK 0x10ull
#define EVENT_POWER_SOURCE 0x80ull
#define EVENT_SUPPORTED \
    (EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC | EVENT_PSTATE | EVENT_XID_CRITICAL | EVENT_CLOCK)
#define XID_FALLEN_OFF_BUS 79ull

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    uint32_t tag;
    unsigned long long types[STANDIN_MAX_GPUS]; /* registered event types, by state index */
    uint8_t lost_reported[STANDIN_MAX_GPUS];
} event_set_t;
#define EVENT_SET_TAG 0x45565354u

nvmlReturn_t nvmlEventSetCreate(event_set_t **set) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    event_set_t *s = calloc(1, sizeof *s);
    if (s == NULL) return NVML_ERROR_UNKNOWN;
    s->tag = EVENT_SET_TAG;
    *set = s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(event_set_t *set) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    if (set == NULL || set->tag != EVENT_SET_TAG) return NVML_ERROR_INVALID_ARGUMENT;
    set->tag = 0;
    free(set);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    ENTER(device);
    if (types == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *types = EVENT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                      event_set_t *set) {
    ENTER(device);
    if (set == NULL || set->tag != EVENT_SET_TAG) return NVML_ERROR_INVALID_ARGUMENT;
    if ((types & ~EVENT_SUPPORTED) != 0) return NVML_ERROR_NOT_SUPPORTED;
    set->types[state_index(device)] |= types;
    return NVML_SUCCESS;
}

/* Waits up to timeout_ms for an event of the set: SUCCESS with the event, else TIMEOUT. */
nvmlReturn_t nvmlEventSetWait_v2(event_set_t *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    if (!ready()) return NVML_ERROR_UNINITIALIZED;
    if (set == NULL || set->tag != EVENT_SET_TAG || data == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    const unsigned int step_ms = 50;
    for (unsigned int waited = 0;; waited += step_ms) {
        for (uint32_t i = 0; i < g_state->n_gpus && i < STANDIN_MAX_GPUS; i++) {
            standin_gpu_t *g = &g_state->gpus[i];
            int lost = __atomic_load_n(&g->fail_all, __ATOMIC_SEQ_CST) == NVML_ERROR_GPU_IS_LOST;
            if (!lost) set->lost_reported[i] = 0;
            if (lost && !set->lost_reported[i] && (set->types[i] & EVENT_XID_CRITICAL)) {
                set->lost_reported[i] = 1;
                memset(data, 0, sizeof *data);
                data->device = g;
                data->eventType = EVENT_XID_CRITICAL;
                data->eventData = XID_FALLEN_OFF_BUS;
                data->gpuInstanceId = 0xFFFFFFFFu;
                data->computeInstanceId = 0xFFFFFFFFu;
                return NVML_SUCCESS;
            }
        }
        if (waited >= timeout_ms) return NVML_ERROR_TIMEOUT;
        unsigned int left = timeout_ms - waited < step_ms ? timeout_ms - waited : step_ms;
        struct timespec ts = {left / 1000u, (long)(left % 1000u) * 1000000L};
        nanosleep(&ts, NULL);
    }
}
nvmlReturn_t nvmlEventSetWait(event_set_t *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    return nvmlEventSetWait_v2(set, data, timeout_ms);
}
