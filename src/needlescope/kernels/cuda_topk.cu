// Exact top-k over fp32 rows, one thread block of 1024 threads per row (compiled by NVRTC at
// first use; launcher: needlescope/kernels/cuda_topk.py, contract: needlescope/kernels/topk.py).
//
// Why CUDA and not Triton: the row's select is a chain of block-wide steps (a histogram, a scan,
// a compaction), and Triton's one-program versions of it ran 41-76 us at 1 x 32K on an H100
// (docs/perf/indexer-notes.md, runs 15 and 25) for want of warp ballots, shared-memory
// atomics and register-resident keys; here each step is a few hundred cycles.
//
// Fast path (row of at most 32,768 entries, k <= 2048): the row's keys stay in registers (32 a
// thread); SUB group maxima a thread (groups of columns tid + 1024 i, i = j mod SUB); a bound t
// from two radix passes over the maxima, the bin of the k-th largest maximum (so at least k
// entries are >= t); the entries >= t compacted in index order into shared memory (warp ballots
// and one block scan); the exact k-th key among them by radix passes; the output in index order
// (entries above the k-th key, then its ties, lower index first). When more than CAP entries
// pass t (a row where one value fills the top bins), or for longer rows and larger k, the
// general path runs the same radix select over the whole row from global memory. The group path
// (below) is the fast path's filter with the group maxima read from memory, as the fused decode
// path's logits kernel writes them.
//
// Keys: fp32 bits mapped to an order-preserving uint32 (-0.0 onto +0.0; a NaN with the sign bit
// clear above +inf, one with it set below -inf), as topk_parts.ordered_key does.

#define THREADS 1024
#define WARPS 32
#define ITEMS 32
#define TILE (THREADS * ITEMS)
#define CAP 4096
#define FULL 0xffffffffu
#define GROUP 16                   // group path: entries a given group maximum covers
#define GSLOTS (THREADS / GROUP)   // groups one item of the block reads: 16 lanes a group
#define GITEMS 16                  // items: at most GITEMS * GSLOTS = 1024 groups above the bound
#define KNEG 0x007fffffu           // ordered_key(-inf)

struct Smem {
    unsigned cand_key[CAP];
    int cand_idx[CAP];
    int cnt[THREADS];
    int hist[256];
    int wsum[WARPS + 1];
    unsigned wkey[WARPS];
    int glist[GITEMS * GSLOTS];  // group path: the groups above the bound, in index order
    int bin, above, in_bin;
};

__device__ __forceinline__ unsigned ordered_key(float x) {
    unsigned u = __float_as_uint(x);
    if (u == 0x80000000u) u = 0u;
    return u ^ ((u >> 31) ? 0xffffffffu : 0x80000000u);
}

__device__ __forceinline__ unsigned lanemask_lt() {
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

// Inclusive scan of one int a lane over the warp.
__device__ __forceinline__ int warp_inclusive_scan(int v) {
    const int lane = threadIdx.x & 31;
    for (int d = 1; d < 32; d <<= 1) {
        int y = __shfl_up_sync(FULL, v, d);
        if (lane >= d) v += y;
    }
    return v;
}

// Exclusive scan of one int a thread over the block; *total gets the sum. Ends with a barrier.
__device__ int block_scan(int v, Smem& s, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = warp_inclusive_scan(v);
    if (lane == 31) s.wsum[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = s.wsum[lane], wi = w;
        for (int d = 1; d < 32; d <<= 1) {
            int y = __shfl_up_sync(FULL, wi, d);
            if (lane >= d) wi += y;
        }
        s.wsum[lane] = wi - w;
        if (lane == 31) s.wsum[WARPS] = wi;
    }
    __syncthreads();
    int out = s.wsum[warp] + incl - v;
    *total = s.wsum[WARPS];
    __syncthreads();
    return out;
}

// Block-wide min (want_max = false) or max of one key a thread. Ends with a barrier.
__device__ unsigned block_extreme(unsigned v, bool want_max, Smem& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = want_max ? __reduce_max_sync(FULL, v) : __reduce_min_sync(FULL, v);
    if (lane == 0) s.wkey[warp] = v;
    __syncthreads();
    unsigned w = s.wkey[lane];
    w = want_max ? __reduce_max_sync(FULL, w) : __reduce_min_sync(FULL, w);
    __syncthreads();
    return w;
}

// Compaction in index order of flagged items, where item i of a thread comes before item i + 1
// and, within an item, thread order is index order: count_flags(flag) takes each (item, warp)'s
// count by a ballot (thread (warp w, lane i) holds item i's, so slot i * WARPS + w is index
// order), one block scan turns the counts into first slots in s.cnt, and it returns the flagged
// total; then each flagged lane of item i writes at flag_slot(i, flag(i), s). N <= 32 items.
// Ends with a barrier.
template <int N, class Flag>
__device__ int count_flags(Flag flag, Smem& s) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int mine = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        unsigned b = __ballot_sync(FULL, flag(i));
        if (lane == i) mine = __popc(b);
    }
    s.cnt[lane * WARPS + warp] = mine;
    __syncthreads();
    int total;
    int off = block_scan(s.cnt[tid], s, &total);
    s.cnt[tid] = off;
    __syncthreads();
    return total;
}

// The slot of this lane's item i after count_flags (every lane of the warp calls it with its own flag).
__device__ __forceinline__ int flag_slot(int i, bool f, const Smem& s) {
    unsigned b = __ballot_sync(FULL, f);
    return s.cnt[i * WARPS + (threadIdx.x >> 5)] + __popc(b & lanemask_lt());
}

// Add one to hist[bin] for every active lane: a plain shared atomic a lane. Measured on an H100
// (docs/perf/indexer.md, session 11, graph-replayed, k = 512), against aggregating a warp's
// lanes per distinct bin with __match_any_sync (the form before) and against one atomic where
// all of a warp's lanes share a bin (else plain): the cluster path 7.0 against 8.1 / 7.8 us at
// 1 x 32K and 31.3 against 41.8 / 42.8 at 64 x 64K; the block kernel 12.9 against 14.6 / 13.7 at
// 1 x 32K; and no slower on rows of one value, where every lane hits one bin (8 x 32K: 29.0
// against 29.8 / 29.6 on the block kernel, 8.5 against 9.8 / 9.7 on the cluster path).
__device__ __forceinline__ void hist_add(int* hist, unsigned bin, bool active) {
    if (active) atomicAdd(&hist[bin], 1);
}

// After hist holds the digit counts of a pass: the digit of the krem-th largest key counted, how
// many counted keys lie in higher digits and in it (into s.bin, s.above, s.in_bin), then hist is cleared.
__device__ void find_bin(Smem& s, int krem) {
    const int t = threadIdx.x;
    int h = 0, cum = 0;
    if (t < 256) {
        h = s.hist[255 - t];
        cum = h;
        const int lane = t & 31;
        for (int d = 1; d < 32; d <<= 1) {
            int y = __shfl_up_sync(FULL, cum, d);
            if (lane >= d) cum += y;
        }
        if (lane == 31) s.wsum[t >> 5] = cum;
    }
    __syncthreads();
    if (t < 256) {
        for (int w = 0; w < (t >> 5); ++w) cum += s.wsum[w];
        if (cum >= krem && cum - h < krem) {
            s.bin = 255 - t;
            s.above = cum - h;
            s.in_bin = h;
        }
        s.hist[255 - t] = 0;
    }
    __syncthreads();
}

// Radix select, most significant digit first, starting below the bits every key shares (from the
// keys' extremes, or from a range [lo, hi] the caller knows holds them all: known). Keys come
// from get(i, &key) -> valid, i < n_items, a thread's items. It stops after max_passes, or early
// at a digit that holds the k-th largest key alone. Then *kth is a lower bound of the k-th key
// (its digits so far; so after max_passes < 4 a bound), and with max_passes >= 4 the k-th key is
// the one whose bits from *shift up are *kth's: the keys above them lie above it, and *take_eq of
// those equal to them are to be taken (one where it stopped early). Needs at least k valid keys.
template <class Get>
__device__ void radix_select(Get get, int n_items, int k, int max_passes, Smem& s, unsigned* kth,
                             int* take_eq, int* shift_out, bool known = false, unsigned lo = 0u,
                             unsigned hi = 0u) {
    if (!known) {
        lo = 0xffffffffu;
        hi = 0u;
        for (int i = 0; i < n_items; ++i) {
            unsigned key;
            if (get(i, &key)) {
                lo = min(lo, key);
                hi = max(hi, key);
            }
        }
        lo = block_extreme(lo, false, s);
        hi = block_extreme(hi, true, s);
    }
    unsigned diff = lo ^ hi;
    int hb = diff ? 31 - __clz(diff) : -1;  // highest bit in which keys differ
    unsigned prefix = hb >= 0 ? hi & ~((2u << hb) - 1u) : hi;
    int krem = k, shift = 0;
    for (int pass = 0; pass < max_passes && hb >= 0; ++pass) {
        shift = max(hb - 7, 0);
        const unsigned width_mask = (2u << (hb - shift)) - 1u;
        for (int i = 0; i < n_items; ++i) {
            unsigned key;
            bool ok = get(i, &key);
            ok = ok && (hb == 31 || (key >> (hb + 1)) == (prefix >> (hb + 1)));
            hist_add(s.hist, (key >> shift) & width_mask, ok);
        }
        __syncthreads();
        find_bin(s, krem);
        prefix |= (unsigned)s.bin << shift;
        krem -= s.above;
        hb = shift - 1;
        if (s.in_bin == 1) break;
    }
    *kth = prefix;
    *take_eq = krem;
    *shift_out = shift;
}

// Writes out[0, k): the entries above the cut in index order, then the first take_eq entries at
// it (keys compared from bit shift up: radix_select's kth, shift, take_eq). Entries come in index
// order from get(p, &key, &idx) -> valid, p < n, THREADS at a time.
template <class Get>
__device__ void emit(Get get, int n, unsigned kth, int shift, int take_eq, int k, int* out, Smem& s) {
    const int lane = threadIdx.x & 31;
    int base_gt = 0, base_eq = 0;
    const int first_eq = k - take_eq;
    for (int p0 = 0; p0 < n; p0 += THREADS) {
        unsigned key = 0u;
        int idx = -1;
        bool ok = get(p0 + (int)threadIdx.x, &key, &idx);
        bool gt = ok && (key >> shift) > (kth >> shift), eq = ok && (key >> shift) == (kth >> shift);
        unsigned bg = __ballot_sync(FULL, gt), be = __ballot_sync(FULL, eq);
        int packed = (__popc(bg) << 16) | __popc(be);  // at most 32 each
        int tot;
        int off = block_scan(lane == 0 ? packed : 0, s, &tot);
        off = __shfl_sync(FULL, off, 0);
        if (gt) {
            // Always below first_eq on consistent input; the bound keeps inconsistent group
            // maxima (group_topk's caller's promise broken) from writing past the row's slots.
            const int q = base_gt + (off >> 16) + __popc(bg & lanemask_lt());
            if (q < first_eq) out[q] = idx;
        }
        if (eq) {
            int r = base_eq + (off & 0xffff) + __popc(be & lanemask_lt());
            if (r < take_eq) out[first_eq + r] = idx;
        }
        base_gt += tot >> 16;
        base_eq += tot & 0xffff;
    }
}

// The whole row from global memory: radix select, then the output over the row.
__device__ void general_path(const float* row, int st, int n, int k, int* out, Smem& s) {
    const int per = (n + THREADS - 1) / THREADS;
    auto get = [&](int i, unsigned* key) {
        int p = i * THREADS + (int)threadIdx.x;
        if (p >= n) return false;
        *key = ordered_key(row[st + p]);
        return true;
    };
    unsigned kth;
    int take_eq, shift;
    radix_select(get, per, k, 4, s, &kth, &take_eq, &shift);
    auto at = [&](int p, unsigned* key, int* idx) {
        if (p >= n) return false;
        *key = ordered_key(row[st + p]);
        *idx = st + p;
        return true;
    };
    emit(at, n, kth, shift, take_eq, k, out, s);
}

// The candidates s.cand_key / s.cand_idx[0, total), in index order (at least k of them, at most
// CAP; known: all in [lo, hi]): the exact k-th key among them by radix passes, then the output.
__device__ void candidates_out(int total, int k, int* out, Smem& s, bool known = false, unsigned lo = 0u,
                               unsigned hi = 0u) {
    const int tid = threadIdx.x;
    auto get_cand = [&](int i, unsigned* k_) {
        int c = i * THREADS + tid;
        if (c >= total) return false;
        *k_ = s.cand_key[c];
        return true;
    };
    unsigned kth;
    int take_eq, shift;
    radix_select(get_cand, CAP / THREADS, k, 4, s, &kth, &take_eq, &shift, known, lo, hi);
    auto at = [&](int c, unsigned* k_, int* idx) {
        if (c >= total) return false;
        *k_ = s.cand_key[c];
        *idx = s.cand_idx[c];
        return true;
    };
    emit(at, total, kth, shift, take_eq, k, out, s);
}

// The items flag(i) holds of key[] (total of them, from count_flags, at most CAP) become
// the candidates in index order, entry index(i) each (called only where flag(i) holds); then
// candidates_out. The last step of fast_path and group_path.
template <int N, class Flag, class Index>
__device__ __forceinline__ void flagged_out(const unsigned (&key)[N], Flag flag, Index index, int total, int k,
                                            int* out, Smem& s, bool known = false, unsigned lo = 0u,
                                            unsigned hi = 0u) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const bool f = flag(i);
        const int slot = flag_slot(i, f, s);
        if (f) {
            s.cand_key[slot] = key[i];
            s.cand_idx[slot] = index(i);
        }
    }
    __syncthreads();
    candidates_out(total, k, out, s, known, lo, hi);
}

template <int SUB>
__device__ void fast_path(const float* row, int st, int n, int k, int* out, Smem& s) {
    const int tid = threadIdx.x;
    unsigned key[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        int p = i * THREADS + tid;
        key[i] = p < n ? ordered_key(row[st + p]) : 0u;
    }
    unsigned gmax[SUB];
#pragma unroll
    for (int j = 0; j < SUB; ++j) gmax[j] = 0u;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
        if (i * THREADS + tid < n) gmax[i % SUB] = max(gmax[i % SUB], key[i]);
    // Group j of this thread is empty when its first column is past the row.
    auto get_max = [&](int j, unsigned* k_) {
        if (j * THREADS + tid >= n) return false;
        unsigned v = 0u;
#pragma unroll
        for (int q = 0; q < SUB; ++q)
            if (q == j) v = gmax[q];
        *k_ = v;
        return true;
    };
    unsigned t;
    int unused, unused_shift;
    radix_select(get_max, SUB, k, 2, s, &t, &unused, &unused_shift);

    // The entries >= t, compacted in index order.
    auto passes = [&](int i) { return i * THREADS + tid < n && key[i] >= t; };
    const int total = count_flags<ITEMS>(passes, s);
    if (total > CAP) {
        general_path(row, st, n, k, out, s);
        return;
    }
    auto index = [&](int i) { return st + i * THREADS + tid; };
    flagged_out<ITEMS>(key, passes, index, total, k, out, s);
}

// Group path (the fused decode path: the logits kernel wrote the row's group maxima): the same
// filter as fast_path with maxima of GROUP consecutive entries read from memory, so only the
// groups whose maximum reaches the bound are read (~k of them: ~k * 64 bytes against the row's
// 4 * n). The bound t is the two-pass bin of the k-th largest maximum; the groups at or above it
// are compacted in index order (s.glist), their entries >= t become the candidates. Exactness as
// in triton_filter's header: every maximum >= t > KNEG is the key of an entry of the row, so at
// least k entries are >= t and the top-k with its ties is among them. Rows where the bound does
// not filter (fewer than k groups, t <= KNEG, more than GITEMS * GSLOTS groups or CAP entries at or
// above it) take the general path. gmax: uint32 keys as int32, -inf's key (or 0) past the row.
template <int MI>  // maxima a thread: rows of up to MI * THREADS groups
__device__ void group_path(const float* row, int n, const int* grow, int k, int* out, Smem& s) {
    const int tid = threadIdx.x;
    const int ng = (n + GROUP - 1) / GROUP;
    if (ng < k) {
        general_path(row, 0, n, k, out, s);
        return;
    }
    unsigned gm[MI];
#pragma unroll
    for (int j = 0; j < MI; ++j) gm[j] = j * THREADS + tid < ng ? (unsigned)grow[j * THREADS + tid] : 0u;
    auto get_max = [&](int j, unsigned* k_) {
        if (j * THREADS + tid >= ng) return false;
        unsigned v = 0u;
#pragma unroll
        for (int q = 0; q < MI; ++q)
            if (q == j) v = gm[q];
        *k_ = v;
        return true;
    };
    // The maxima's extremes here: the largest is also the candidates' (their range is [t, hi]).
    unsigned lo = 0xffffffffu, hi = 0u;
#pragma unroll
    for (int j = 0; j < MI; ++j)
        if (j * THREADS + tid < ng) {
            lo = min(lo, gm[j]);
            hi = max(hi, gm[j]);
        }
    lo = block_extreme(lo, false, s);
    hi = block_extreme(hi, true, s);
    unsigned t;
    int unused, unused_shift;
    radix_select(get_max, MI, k, 2, s, &t, &unused, &unused_shift, true, lo, hi);
    // The groups >= t, compacted in index order.
    auto reaches = [&](int j) { return j * THREADS + tid < ng && gm[j] >= t; };
    const int groups = count_flags<MI>(reaches, s);
    if (t <= KNEG || groups > GITEMS * GSLOTS) {
        general_path(row, 0, n, k, out, s);
        return;
    }
#pragma unroll
    for (int j = 0; j < MI; ++j) {
        const bool f = reaches(j);
        const int slot = flag_slot(j, f, s);
        if (f) s.glist[slot] = j * THREADS + tid;
    }
    __syncthreads();
    // Item i, thread tid: entry tid % GROUP of listed group i * GSLOTS + tid / GROUP; key 0 (< t)
    // where there is none. Thread order within an item, then item order, is index order.
    const int e = tid & (GROUP - 1), gl = tid / GROUP;
    unsigned key[GITEMS];
#pragma unroll
    for (int i = 0; i < GITEMS; ++i) {
        const int q = i * GSLOTS + gl;
        const int p = q < groups ? s.glist[q] * GROUP + e : n;
        key[i] = p < n ? ordered_key(row[p]) : 0u;
    }
    auto above = [&](int i) { return key[i] >= t; };
    const int total = count_flags<GITEMS>(above, s);
    // Fewer than k: only maxima inconsistent with the row (one above every entry of its group)
    // leave fewer than k entries >= t; the general path's answer is then exact all the same.
    if (total > CAP || total < k) {
        general_path(row, 0, n, k, out, s);
        return;
    }
    auto index = [&](int i) { return s.glist[i * GSLOTS + gl] * GROUP + e; };
    flagged_out<GITEMS>(key, above, index, total, k, out, s, true, t, hi);
}

// Row r's entries [*st, *st + n) (the contract's clamping of starts and ends to [0, width]); returns n.
__device__ __forceinline__ int row_range(const int* starts, int has_starts, const int* ends, int width, int r,
                                         int* st) {
    int en = min(max(ends[r], 0), width);
    *st = has_starts ? min(max(starts[r], 0), width) : 0;
    return max(en, *st) - *st;
}

template <int SUB>
__device__ void topk_rows(const float* logits, int stride, const int* starts, int has_starts,
                          const int* ends, int width, int k, int* out, int force_general) {
    __shared__ Smem s;
    const int r = blockIdx.x;
    const float* row = logits + (long long)r * stride;
    int* orow = out + (long long)r * k;
    int st;
    const int n = row_range(starts, has_starts, ends, width, r, &st);
    if (n <= k) {  // the whole range, in order, then -1
        for (int c = threadIdx.x; c < k; c += THREADS) orow[c] = c < n ? st + c : -1;
        return;
    }
    for (int b = threadIdx.x; b < 256; b += THREADS) s.hist[b] = 0;
    __syncthreads();
    if (n <= TILE && k <= 2048 && !force_general)
        fast_path<SUB>(row, st, n, k, orow, s);
    else
        general_path(row, st, n, k, orow, s);
}

// SUB group maxima a thread: 2 (2048 maxima) for k <= 512, 8 (8192) for k <= 2048, so that there
// are at least four maxima per selected entry and the bound t filters.
extern "C" __global__ void __launch_bounds__(THREADS)
    needlescope_topk_sub2(const float* logits, int stride, const int* starts, int has_starts,
                          const int* ends, int width, int k, int* out, int force_general) {
    topk_rows<2>(logits, stride, starts, has_starts, ends, width, k, out, force_general);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    needlescope_topk_sub8(const float* logits, int stride, const int* starts, int has_starts,
                          const int* ends, int width, int k, int* out, int force_general) {
    topk_rows<8>(logits, stride, starts, has_starts, ends, width, k, out, force_general);
}

// Group path kernels, one block a row, no starts (rows are [0, ends[r]), as in decode): rows of up
// to 4 x 1024 groups (64K entries) and 16 x 1024 (256K: a 1M-token context at 4 tokens an entry).
template <int MI>
__device__ void group_rows(const float* logits, int stride, const int* gmax, int gstride, const int* ends,
                           int width, int k, int* out) {
    __shared__ Smem s;
    const int r = blockIdx.x;
    const float* row = logits + (long long)r * stride;
    int* orow = out + (long long)r * k;
    int st;
    const int n = row_range(ends, 0, ends, width, r, &st);
    if (n <= k) {
        for (int c = threadIdx.x; c < k; c += THREADS) orow[c] = c < n ? c : -1;
        return;
    }
    for (int b = threadIdx.x; b < 256; b += THREADS) s.hist[b] = 0;
    __syncthreads();
    group_path<MI>(row, n, gmax + (long long)r * gstride, k, orow, s);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    needlescope_topk_groups4(const float* logits, int stride, const int* gmax, int gstride, const int* ends,
                             int width, int k, int* out) {
    group_rows<4>(logits, stride, gmax, gstride, ends, width, k, out);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    needlescope_topk_groups16(const float* logits, int stride, const int* gmax, int gstride, const int* ends,
                              int width, int k, int* out) {
    group_rows<16>(logits, stride, gmax, gstride, ends, width, k, out);
}

// ---------------------------------------------------------------------------------------------
// Cluster path: one row split over a cluster of CL thread blocks (H100's thread block clusters,
// sm_90), each block holding CHUNK = NT * IT of the row's entries in registers. A single block
// reads a 32K row at one SM's share of the memory system and walks a chain of ~35 barriers;
// eight blocks read it eight times as fast and each barrier has fewer threads. The select is the
// plain MSD radix select over the whole row: 8-bit digits from the top, stopping early at a digit
// that holds the k-th largest key alone (its digit's key is then the k-th key); every block
// finds the same digit from the cluster's histogram.
//
// The exchange has no cluster barrier (run 29: 8.6 us at 1 x 32K against 10.5 for the form that
// met in a cluster barrier each pass and read the others' histograms remotely, run 28; 8.1 in
// run 33 with the changes below). Each pass, every block stores its 256-bin histogram (16-bit
// counts: 8.09 against 8.37 us with 32-bit ones, run 33) into every block's receive buffer with
// st.async, which completes bytes on the receiver's mbarrier; a block waits on its own mbarrier
// for the eight histograms (4 KB) and sums them locally, one digit a thread. Buffers and
// mbarriers are double buffered by pass parity: a block sends pass p + 1 only after its own pass
// p search has read its buffer, and nobody reaches pass p + 2 without that block's pass p + 1
// histogram, so no buffer is overwritten while read. The output is written in index order and
// needs no exchange: every block holds every block's histograms of every pass, so each counts,
// for the blocks before it, their keys above the cut (digits above each pass's bin) and at it
// (the last pass's bin), then offsets over its (item, warp) slots. One relaxed cluster barrier
// after the mbarriers' initialization; none at the end (every byte a block is sent is one its
// mbarrier waits for).

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and later

#define CL 8

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ unsigned map_rank(unsigned local, unsigned rank) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{ .reg .pred p;\n"
        "W: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra W; }" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
// 16 bytes of v into `dst` of cluster block `rank`, completing 16 bytes on that block's `bar`.
__device__ __forceinline__ void st_async4(const int* dst, const unsigned long long* bar, unsigned rank, int4 v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.s32 [%0], {%2, %3, %4, %5}, [%1];" ::
                     "r"(map_rank(smem_u32(dst), rank)), "r"(map_rank(smem_u32(bar), rank)),
                     "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
struct MbarSmem {
    // The cluster's histograms by pass parity, one row a sender; a block counts at most CHUNK < 2^16 keys a digit.
    alignas(16) unsigned short recv[2][CL][256];
    alignas(16) int hist[2][256];      // this block's digit counts by pass parity
    unsigned long long bar[2];         // recv[0], recv[1]
    int slot[256];                     // (item, warp) counts, then their exclusive offsets
    int wsum[8];                       // the digit search's warp totals (digits 255 - 32 w down)
    int before[CL][2];                 // block b < this one: its keys above the cut, at the cut
    int bin, above, in_bin;
};

// After this block's mbarrier of a pass completed: the cluster's count of each digit, summed
// over the senders one digit a thread (thread t < 256: digit 255 - t, so a scan over threads
// runs over descending digits), and the digit of the krem-th largest key (s.bin), the count
// above it (s.above) and in it (s.in_bin). Ends with a barrier.
__device__ __forceinline__ void mbar_find_bin(MbarSmem& s, int buf, int krem) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int v = 0, incl = 0;
    if (t < 256) {
#pragma unroll
        for (int b = 0; b < CL; ++b) v += s.recv[buf][b][255 - t];
        incl = warp_inclusive_scan(v);
        if (lane == 31) s.wsum[warp] = incl;
    }
    __syncthreads();
    if (t < 256) {
        int cum = incl - v;
        for (int w = 0; w < warp; ++w) cum += s.wsum[w];
        if (cum < krem && cum + v >= krem) {
            s.bin = 255 - t;
            s.above = cum;
            s.in_bin = v;
        }
    }
    __syncthreads();
}

template <int NT, int IT>
__device__ void mbar_rows(const float* logits, int stride, const int* starts, int has_starts,
                          const int* ends, int width, int k, int* out) {
    constexpr int NW = NT / 32, CHUNK = NT * IT, SLOTS = IT * NW, PER = SLOTS / 32;
    static_assert(SLOTS % 32 == 0 && SLOTS <= 256 && IT <= 32 && NT >= 256 && CHUNK < 65536, "slots; 256 senders; 16-bit counts");
    __shared__ MbarSmem s;
    const unsigned c = cluster_rank();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r = blockIdx.y;
    const float* row = logits + (long long)r * stride;
    int* orow = out + (long long)r * k;
    int st;
    const int n = row_range(starts, has_starts, ends, width, r, &st);
    if (n <= k) {  // the whole range, in order, then -1; no block touches another's memory
        for (int q = c * NT + tid; q < k; q += CL * NT) orow[q] = q < n ? st + q : -1;
        return;
    }
    const int base = (int)c * CHUNK;  // this block's first position in the range
    unsigned key[IT];
#pragma unroll
    for (int i = 0; i < IT; ++i) {
        int p = base + i * NT + tid;
        key[i] = p < n ? ordered_key(row[st + p]) : 0u;
    }
    for (int b = tid; b < 512; b += NT) (&s.hist[0][0])[b] = 0;
    if (tid == 0) {
        for (int b = 0; b < 2; ++b) mbar_init(&s.bar[b], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    __syncwarp();
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");  // waited before the first send

    unsigned prefix = 0u;
    int krem = k, shift = 24, buf = 0;
    int above = 0;  // warp b < c: block b's keys in digits above each pass's bin, so far
    for (int pass = 0;; ++pass, shift -= 8) {
        buf = pass & 1;
        const unsigned parity = (pass >> 1) & 1;
#pragma unroll
        for (int i = 0; i < IT; ++i) {
            bool ok = base + i * NT + tid < n && (pass == 0 || (key[i] >> (shift + 8)) == (prefix >> (shift + 8)));
            hist_add(s.hist[buf], (key[i] >> shift) & 255u, ok);
        }
        if (tid == 0) mbar_expect(&s.bar[buf], CL * 256 * 2);
        __syncthreads();  // the histogram is complete
        if (pass == 0) {
            __syncwarp();
            asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every block's mbarriers exist
        }
        if (tid < 32 * CL) {  // thread t sends digits 8 (t & 31) .. +7, 16 bits each, to block t >> 5
            const int q = (tid & 31) * 8;
            const int* h = &s.hist[buf][q];
            int4 v = make_int4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
            st_async4(reinterpret_cast<const int*>(&s.recv[buf][c][q]), &s.bar[buf], tid >> 5, v);
        }
        if (tid < 256) s.hist[buf ^ 1][tid] = 0;  // next pass's; its last reader was this block's sends of pass - 1
        mbar_wait(&s.bar[buf], parity);
        mbar_find_bin(s, buf, krem);
        // Block warp's keys above this pass's bin. Read before the next pass's first barrier, so
        // before this block's next send: recv[buf] is not rewritten while read (see above).
        if ((unsigned)warp < c) {
            int sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) sum += lane + 32 * j > s.bin ? s.recv[buf][warp][lane + 32 * j] : 0;
            above += __reduce_add_sync(FULL, sum);
        }
        prefix |= (unsigned)s.bin << shift;
        krem -= s.above;
        if (s.in_bin == 1 || shift == 0) break;
    }
    // The k-th key is the one key of its digit, or (shift 0) prefix itself: keys of a higher digit
    // lie above it, those of its digit are equal to it; take_eq of them, in index order.
    const int take_eq = krem;
    int mine = 0;
#pragma unroll
    for (int i = 0; i < IT; ++i) {
        bool valid = base + i * NT + tid < n;
        bool gt = valid && (key[i] >> shift) > (prefix >> shift);
        bool eq = valid && (key[i] >> shift) == (prefix >> shift);
        unsigned bg = __ballot_sync(FULL, gt), be = __ballot_sync(FULL, eq);
        if (lane == i) mine = (__popc(bg) << 16) | __popc(be);
    }
    if (lane < IT) s.slot[lane * NW + warp] = mine;
    if ((unsigned)warp < c && lane == 0) {
        s.before[warp][0] = above;
        s.before[warp][1] = s.recv[buf][warp][s.bin];
    }
    __syncthreads();
    if (tid < 32) {  // exclusive scan of the slots, PER a lane
        int v[PER], tot = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j) tot += (v[j] = s.slot[PER * tid + j]);
        int incl = warp_inclusive_scan(tot);
        int e = incl - tot;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            s.slot[PER * tid + j] = e;
            e += v[j];
        }
    }
    int base_gt = 0, base_eq = 0;
    for (unsigned b = 0; b < c; ++b) {
        base_gt += s.before[b][0];
        base_eq += s.before[b][1];
    }
    __syncthreads();  // the slot offsets
    const int first_eq = k - take_eq;
#pragma unroll
    for (int i = 0; i < IT; ++i) {
        const int p = base + i * NT + tid;
        bool valid = p < n;
        bool gt = valid && (key[i] >> shift) > (prefix >> shift);
        bool eq = valid && (key[i] >> shift) == (prefix >> shift);
        unsigned bg = __ballot_sync(FULL, gt), be = __ballot_sync(FULL, eq);
        const int off = s.slot[i * NW + warp];
        if (gt) orow[base_gt + (off >> 16) + __popc(bg & lanemask_lt())] = st + p;
        if (eq) {
            int q = base_eq + (off & 0xffff) + __popc(be & lanemask_lt());
            if (q < take_eq) orow[first_eq + q] = st + p;
        }
    }
}

// Rows of up to 8 x 1024 x 4 = 32,768 and 8 x 512 x 16 = 65,536 entries (the fastest shapes of
// those timed in run 27 with the barrier form: 1024 x 4 at 10.3 us, 512 x 8 at 10.9, 256 x 16 at 13.4).
extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(1024)
    needlescope_topk_cluster_32k(const float* logits, int stride, const int* starts, int has_starts,
                              const int* ends, int width, int k, int* out) {
    mbar_rows<1024, 4>(logits, stride, starts, has_starts, ends, width, k, out);
}

extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(512)
    needlescope_topk_cluster_64k(const float* logits, int stride, const int* starts, int has_starts,
                              const int* ends, int width, int k, int* out) {
    mbar_rows<512, 16>(logits, stride, starts, has_starts, ends, width, k, out);
}

#endif  // sm_90
