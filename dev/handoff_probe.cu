// dev/handoff_probe.py: how soon a dependent kernel can start on its predecessor's results, by the two
// hand-offs a decode step could use (lab code, not part of solo).
//
// primary: every block lets its dependents launch, spins SPIN_NS, stores its end time, then (for the
// flag hand-off) makes its stores visible and counts itself in `arrived`.
// wait_secondary: griddepcontrol.wait (returns once the primary grid has completed and flushed), then
// stamps the time.
// flag_secondary: polls `arrived` with acquire loads until every primary block has counted itself in,
// then stamps the time (no griddepcontrol.wait: it relies on the counter alone).
// Defines: SPIN_NS (the primary's work), POLL_NS (the flag poller's back-off, 0: none).

typedef unsigned long long u64;

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ int ld_acquire(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

extern "C" __global__ void primary(u64 *end_ns, int *arrived, int *payload) {
    asm volatile("griddepcontrol.launch_dependents;");
    const u64 start = now_ns();
    while (now_ns() - start < (u64)SPIN_NS) {
    }
    if (threadIdx.x == 0) {
        payload[blockIdx.x] = (int)blockIdx.x + 1;
        __threadfence();
        end_ns[blockIdx.x] = now_ns();
        atomicAdd(arrived, 1);
    }
}

extern "C" __global__ void wait_secondary(u64 *start_ns, const int *payload, int *seen) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0) {
        start_ns[blockIdx.x] = now_ns();
        seen[blockIdx.x] = __ldcg(payload + blockIdx.x);
    }
}

extern "C" __global__ void flag_secondary(u64 *start_ns, const int *payload, int *seen, int *arrived,
                                          int primary_blocks) {
    if (threadIdx.x == 0) {
        while (ld_acquire(arrived) < primary_blocks) {
            if (POLL_NS) __nanosleep(POLL_NS);
        }
        start_ns[blockIdx.x] = now_ns();
        seen[blockIdx.x] = __ldcg(payload + blockIdx.x);
    }
}
