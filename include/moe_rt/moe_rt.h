/* moe_rt: the C view of the expert-parallel handle (moe_rt.ep.EpGroup.prepare).
 *
 * A handle is ONE byte buffer (device memory on CUDA) holding the arrays below, in this order, each
 * starting on a 256-byte boundary. The Python definition is moe_rt._handle.REGIONS / layout(); the test
 * suite compiles moe_rt_ep_handle_layout() below and checks it against Python for many sizes.
 *
 * Sizes: R ranks, L local experts, Tmax = max_tokens_per_rank, K top-k, P per-pair capacity (Tmax in
 * exact mode), rows = received rows (exact: sum of received token counts; capacity: R*P),
 * N = expert-major rows (the permutation plan's num_rows).
 *
 *   region              type     count            contents
 *   meta                int32    5*R + 10         counts, offsets, flags (MOE_RT_EP_META_* below)
 *   routing             int32    R*(Tmax*K + 1)   all-gathered routing: rank r's [Tmax][K] expert ids
 *                                                 (-1 = none or out of range), then its T
 *   send_tok            int32    R*P              [dst][pos]: pos-th token this rank sends to dst (-1 unused)
 *   send_pos            int32    R*Tmax           [dst][t]: position of token t in dst's list, -1 = not sent
 *   recv_tok            int32    R*P              [src][pos]: src's token in received position pos
 *   recv_local          int32    rows*K           received rows' local expert ids (-1 = none)
 *   recv_wk             float32  rows*K           received routing weights (written by dispatch)
 *   dst_row             int32    rows*K           expert-major row of slot (row, k), -1 = none/dropped
 *   src_slot            int32    N                slot row*K + k held by expert-major row n, -1 = padding
 *   seg_start           int32    L + 1            local expert l owns rows [seg_start[l], seg_start[l+1])
 *   expert_counts       int32    L                kept slots per local expert (unpadded)
 *   tokens_per_expert   int32    L                padded counts (group sizes for a grouped GEMM)
 *
 * Received row layout: source-major, token ascending. Exact mode: source s owns rows
 * [recv_off[s], recv_off[s+1]); capacity mode: rows [s*P, s*P + min(recv_counts[s], P)).
 */
#ifndef MOE_RT_H_
#define MOE_RT_H_

#include <stdint.h>

#define MOE_RT_EP_HANDLE_ALIGN 256

enum moe_rt_ep_region {
  MOE_RT_EP_META = 0,
  MOE_RT_EP_ROUTING = 1,
  MOE_RT_EP_SEND_TOK = 2,
  MOE_RT_EP_SEND_POS = 3,
  MOE_RT_EP_RECV_TOK = 4,
  MOE_RT_EP_RECV_LOCAL = 5,
  MOE_RT_EP_RECV_WK = 6,
  MOE_RT_EP_DST_ROW = 7,
  MOE_RT_EP_SRC_SLOT = 8,
  MOE_RT_EP_SEG_START = 9,
  MOE_RT_EP_EXPERT_COUNTS = 10,
  MOE_RT_EP_TOKENS_PER_EXPERT = 11,
  MOE_RT_EP_NUM_REGIONS = 12
};

/* int32 indices inside the meta region */
#define MOE_RT_EP_META_SEND_COUNTS(R) 0
#define MOE_RT_EP_META_RECV_COUNTS(R) (R)
#define MOE_RT_EP_META_RECV_SLOTS(R) (2 * (R))
#define MOE_RT_EP_META_SEND_OFF(R) (3 * (R))
#define MOE_RT_EP_META_RECV_OFF(R) (4 * (R) + 1)
#define MOE_RT_EP_META_PAIR_OVERFLOW(R) (5 * (R) + 2)
#define MOE_RT_EP_META_EXPERT_OVERFLOW(R) (5 * (R) + 3)
#define MOE_RT_EP_META_TOTAL_SLOTS(R) (5 * (R) + 4)
#define MOE_RT_EP_META_NUM_TOKENS(R) (5 * (R) + 5)
#define MOE_RT_EP_META_RECV_ROWS(R) (5 * (R) + 6)
#define MOE_RT_EP_META_SEND_ROWS(R) (5 * (R) + 7)

typedef struct moe_rt_ep_handle_desc {
  int32_t num_ranks, num_local_experts, max_tokens_per_rank, topk, pair_capacity;
  int64_t recv_rows, num_rows;
  uint64_t offset[MOE_RT_EP_NUM_REGIONS]; /* byte offsets in the handle buffer */
  uint64_t total_bytes;
} moe_rt_ep_handle_desc;

/* Fill d->offset and d->total_bytes from the sizes already set in d; returns total_bytes. */
static inline uint64_t moe_rt_ep_handle_layout(moe_rt_ep_handle_desc* d) {
  const uint64_t R = (uint64_t)d->num_ranks, L = (uint64_t)d->num_local_experts;
  const uint64_t Tmax = (uint64_t)d->max_tokens_per_rank, K = (uint64_t)d->topk;
  const uint64_t P = (uint64_t)d->pair_capacity, rows = (uint64_t)d->recv_rows, N = (uint64_t)d->num_rows;
  const uint64_t count[MOE_RT_EP_NUM_REGIONS] = {
      5 * R + 10, R * (Tmax * K + 1), R * P, R * Tmax, R * P, rows * K,
      rows * K,   rows * K,           N,     L + 1,    L,     L};
  uint64_t off = 0;
  for (int i = 0; i < MOE_RT_EP_NUM_REGIONS; ++i) {
    d->offset[i] = off;
    off += count[i] * 4; /* every region holds 4-byte elements */
    off = (off + MOE_RT_EP_HANDLE_ALIGN - 1) / MOE_RT_EP_HANDLE_ALIGN * MOE_RT_EP_HANDLE_ALIGN;
  }
  d->total_bytes = off;
  return off;
}

#endif /* MOE_RT_H_ */
