/* Shared state of the stand-in libnvidia-ml.so.1 (see standin.c).
 *
 * One memory-mapped file holds this struct. The library (loaded by pynvml inside the agent)
 * answers NVML calls from it and records clock writes in it; the Python driver
 * (rlenergy_dev.standin) writes the simulated physics (energy counter, power, the
 * clock the GPU would run unlocked) and injects faults. The Python ctypes mirror must match
 * this layout; rlenergy_standin_state_size() lets it check.
 */
#ifndef RLENERGY_NVML_STANDIN_H
#define RLENERGY_NVML_STANDIN_H

#include <stdint.h>

#define STANDIN_MAGIC 0x524C4E56u /* "RLNV" */
#define STANDIN_VERSION 2u
#define STANDIN_MAX_GPUS 16
#define STANDIN_MAX_CLOCKS 160
#define STANDIN_MAX_MIG 7

typedef struct {
    char uuid[96];
    char name[96];
    uint32_t mig_mode;            /* 1 = MIG enabled */
    uint32_t mig_count;           /* MIG instances (uuids MIG-<gpu uuid>-<i>) */
    uint32_t persistence_mode;    /* 1 = enabled */
    uint32_t architecture;        /* nvmlDeviceArchitecture_t, 9 = Hopper */
    uint32_t mem_clock_mhz;
    uint32_t n_sm_clocks;
    uint32_t sm_clocks_mhz[STANDIN_MAX_CLOCKS]; /* supported SM clocks, descending */
    uint32_t max_sm_clock_mhz;
    uint32_t power_limit_mw;
    /* written by the library: state set through NVML */
    uint32_t locked;              /* 1 = SM clocks locked */
    uint32_t lock_min_mhz;
    uint32_t lock_max_mhz;
    uint32_t mem_locked;
    uint64_t clock_writes;        /* set/reset calls that reached the device */
    uint64_t nvml_calls;          /* device calls answered */
    /* written by the driver: sensors */
    uint64_t energy_mj;           /* total energy counter, mJ */
    uint32_t power_avg_mw;        /* nvmlDeviceGetPowerUsage (trailing average) */
    uint32_t power_instant_mw;    /* NVML_FI_DEV_POWER_INSTANT */
    uint32_t natural_clock_mhz;   /* SM clock the GPU runs unlocked in its current work */
    uint32_t idle;                /* 1 = no work (GPU_IDLE event reason) */
    uint64_t extra_reasons;       /* event-reason bits the driver adds */
    uint32_t util_gpu;
    uint32_t util_mem;
    /* faults: NVML return codes, 0 = none */
    int32_t fail_all;             /* every device call (GPU_IS_LOST) */
    int32_t fail_clock_set;       /* set/reset locked SM clocks (NO_PERMISSION, NOT_SUPPORTED) */
    int32_t fail_mem_lock;        /* memory locked clocks */
    int32_t fail_energy;          /* total energy counter */
    int32_t fail_power;           /* power usage and the instant field */
    int32_t fail_instant;         /* the instant power field only */
    int32_t fail_clocks;          /* clock lists and clock reads */
    int32_t fail_once;            /* next device call returns this, then clears */
    uint32_t clock_cap_mhz;       /* "lock accepted but effective clock lower": cap, 0 = none */
    uint32_t call_delay_us;       /* added latency per call (persistence mode off) */
    uint32_t silent_cap;          /* 1: the cap is reported with no clock-event reason */
    uint32_t min_power_limit_mw;  /* lower power-limit constraint (the upper is power_limit_mw) */
    uint32_t mig_slices[STANDIN_MAX_MIG]; /* GPU-instance slices per MIG instance, 0 = 1 */
    /* written by the driver: the instant power the current work draws at each lock, so that a
     * read right after a lock change sees the new clock's power (as a real board's instant
     * sensor does within milliseconds), not the power of the driver's last update. */
    uint32_t power_unlocked_mw;   /* unlocked (default governor); 0 = use power_instant_mw */
    uint32_t power_at_lock_mw[STANDIN_MAX_CLOCKS]; /* locked at sm_clocks_mhz[i]; 0 = unknown */
    /* written by the driver: framebuffer memory (nvmlDeviceGetMemoryInfo), bytes */
    uint64_t memory_total_bytes;
    uint64_t memory_used_bytes;
    int32_t fail_memory;          /* fault: nvmlDeviceGetMemoryInfo returns this, 0 = none */
    uint32_t pad_memory;
} standin_gpu_t;

typedef struct {
    uint32_t magic;
    uint32_t version;
    uint32_t n_gpus;
    int32_t init_error;           /* nvmlInit returns this (LIB_RM_VERSION_MISMATCH = 18) */
    int32_t fail_all;             /* every device call on every GPU (UNKNOWN = 999) */
    uint32_t init_count;
    char driver_version[80];
    standin_gpu_t gpus[STANDIN_MAX_GPUS];
} standin_state_t;

#endif
