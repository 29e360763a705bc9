/*
 * aiordma_verbs.h -- small C helpers around libibverbs for aiordma.
 *
 * Why these exist: the hot verbs (ibv_poll_cq, ibv_post_send, ibv_post_recv,
 * ibv_req_notify_cq) are static inline functions that jump through the
 * provider's ops table, and the structures they take (ibv_send_wr with its
 * unions, ibv_qp_attr with the nested ibv_ah_attr/ibv_global_route) are
 * awkward to build from Python one field at a time.  The helpers below take
 * and fill plain flat structs and arrays, so Python builds one array per batch
 * and crosses into C once.
 *
 * Rules every helper follows:
 *   - it never calls back into Python and never allocates: callers pass
 *     preallocated arrays, helpers fill them and return counts;
 *   - errors come back as a negative errno (-EAGAIN, -EINVAL, ...), never as
 *     a bare -1: 0 or a count >= 0 means success;
 *   - it may be called with the GIL released (cffi's API mode releases the
 *     GIL around every call into C), so it touches no Python state.
 *
 * Immediate data is exchanged in host byte order: the helpers do the
 * htonl/ntohl that verbs requires (ibv_wc.imm_data and ibv_send_wr.imm_data
 * are big-endian on the wire and in the structures).
 */
#ifndef AIORDMA_VERBS_H
#define AIORDMA_VERBS_H

#include <stdint.h>
#include <arpa/inet.h>
#include <infiniband/verbs.h>

/* One work completion, flattened (no unions).  imm_data is host order and only
 * meaningful when (wc_flags & IBV_WC_WITH_IMM). */
struct aiordma_wc {
    uint64_t wr_id;
    uint32_t status;      /* enum ibv_wc_status */
    uint32_t opcode;      /* enum ibv_wc_opcode */
    uint32_t vendor_err;
    uint32_t byte_len;
    uint32_t imm_data;    /* host byte order */
    uint32_t qp_num;
    uint32_t src_qp;
    uint32_t wc_flags;    /* IBV_WC_WITH_IMM, ... */
};

/* The flat copy of a polled completion (imm_data to host order; both C files use it). */
static inline void aiordma_flatten_wc(const struct ibv_wc *w, struct aiordma_wc *o)
{
    o->wr_id = w->wr_id;
    o->status = w->status;
    o->opcode = w->opcode;
    o->vendor_err = w->vendor_err;
    o->byte_len = w->byte_len;
    o->imm_data = (w->wc_flags & IBV_WC_WITH_IMM) ? ntohl(w->imm_data) : 0;
    o->qp_num = w->qp_num;
    o->src_qp = w->src_qp;
    o->wc_flags = w->wc_flags;
}

/* One send work request with a single scatter/gather entry. */
struct aiordma_send_wr {
    uint64_t wr_id;
    uint64_t addr;        /* local buffer (inside a registered MR unless INLINE) */
    uint64_t remote_addr; /* RDMA_WRITE*, RDMA_READ: remote virtual address */
    uint32_t length;      /* 0 is allowed: no sge is attached then */
    uint32_t lkey;
    uint32_t rkey;        /* RDMA_WRITE*, RDMA_READ: remote key */
    uint32_t imm_data;    /* *_WITH_IMM: host byte order */
    uint32_t opcode;      /* enum ibv_wr_opcode: SEND, SEND_WITH_IMM, RDMA_WRITE,
                             RDMA_WRITE_WITH_IMM, RDMA_READ */
    uint32_t send_flags;  /* IBV_SEND_SIGNALED | IBV_SEND_INLINE | ... */
};

/* Queue pair capacities: requested on input, what the device granted on output. */
struct aiordma_qp_caps {
    uint32_t max_send_wr;
    uint32_t max_recv_wr;
    uint32_t max_send_sge;
    uint32_t max_recv_sge;
    uint32_t max_inline_data;
};

/* INIT -> RTR parameters (RoCEv2: is_global = 1 and a GID, dlid unused). */
struct aiordma_rtr_attr {
    uint8_t  dgid[16];
    uint32_t dest_qp_num;
    uint32_t rq_psn;
    uint32_t path_mtu;          /* enum ibv_mtu (1 = 256 ... 5 = 4096) */
    uint32_t port_num;
    uint32_t is_global;
    uint32_t sgid_index;
    uint32_t hop_limit;
    uint32_t traffic_class;
    uint32_t flow_label;
    uint32_t sl;
    uint32_t dlid;
    uint32_t max_dest_rd_atomic;
    uint32_t min_rnr_timer;     /* 5-bit encoded, e.g. 12 = 0.64 ms */
};

/* RTR -> RTS parameters. */
struct aiordma_rts_attr {
    uint32_t sq_psn;
    uint32_t timeout;           /* 4.096 us * 2^timeout, 0 = infinite */
    uint32_t retry_cnt;         /* 0..7 */
    uint32_t rnr_retry;         /* 0..6 finite, 7 = retry forever */
    uint32_t max_rd_atomic;
};

/* The parts of ibv_port_attr aiordma reads. */
struct aiordma_port_info {
    uint32_t state;             /* enum ibv_port_state */
    uint32_t max_mtu;           /* enum ibv_mtu */
    uint32_t active_mtu;        /* enum ibv_mtu */
    uint32_t gid_tbl_len;
    uint32_t lid;
    uint32_t link_layer;        /* IBV_LINK_LAYER_* */
    uint32_t active_speed;
    uint32_t active_width;
    uint32_t phys_state;
    uint32_t max_msg_sz;
};

/* The parts of ibv_device_attr aiordma reads. */
struct aiordma_device_info {
    uint64_t node_guid;         /* network byte order, as verbs gives it */
    uint64_t max_mr_size;
    uint32_t vendor_id;
    uint32_t vendor_part_id;
    uint32_t max_qp;
    uint32_t max_qp_wr;
    uint32_t max_sge;
    uint32_t max_cq;
    uint32_t max_cqe;
    uint32_t max_mr;
    uint32_t max_pd;
    uint32_t max_qp_rd_atom;
    uint32_t max_qp_init_rd_atom;
    uint32_t phys_port_cnt;
    char     fw_ver[64];
};

/* One valid GID table entry; same layout as struct ibv_gid_entry (checked at
 * compile time), so ibv_query_gid_table() fills an array of these directly. */
struct aiordma_gid_entry {
    uint8_t  gid[16];
    uint32_t gid_index;
    uint32_t port_num;
    uint32_t gid_type;          /* IBV_GID_TYPE_IB, _ROCE_V1, _ROCE_V2 */
    uint32_t ndev_ifindex;      /* 0 if none */
};

/* Element kinds of an async event. */
enum {
    AIORDMA_EV_NONE = 0, AIORDMA_EV_CQ = 1, AIORDMA_EV_QP = 2, AIORDMA_EV_SRQ = 3,
    AIORDMA_EV_WQ = 4, AIORDMA_EV_PORT = 5, AIORDMA_EV_DEVICE = 6
};

struct aiordma_async_event {
    uint32_t event_type;        /* enum ibv_event_type */
    uint32_t element_kind;      /* AIORDMA_EV_* */
    uint64_t element;           /* the cq/qp/srq/wq pointer, or 0 */
    uint32_t port_num;          /* for AIORDMA_EV_PORT */
};

int aiordma_set_nonblock(int fd);
int aiordma_query_device(struct ibv_context *ctx, struct aiordma_device_info *out);
int aiordma_query_port(struct ibv_context *ctx, uint32_t port_num, struct aiordma_port_info *out);
int aiordma_query_gid(struct ibv_context *ctx, uint32_t port_num, int index, uint8_t *gid16);
int aiordma_query_gid_table(struct ibv_context *ctx, struct aiordma_gid_entry *out, int max);
int aiordma_context_fds(struct ibv_context *ctx, int *async_fd, int *num_comp_vectors);
int aiordma_channel_fd(struct ibv_comp_channel *channel);

struct ibv_qp *aiordma_create_rc_qp(struct ibv_pd *pd, struct ibv_cq *send_cq,
                                    struct ibv_cq *recv_cq, struct ibv_srq *srq,
                                    struct aiordma_qp_caps *caps, int sq_sig_all);
struct ibv_srq *aiordma_create_srq(struct ibv_pd *pd, uint32_t *max_wr,
                                   uint32_t *max_sge, uint32_t srq_limit);
int aiordma_arm_srq(struct ibv_srq *srq, uint32_t limit);
int aiordma_query_srq_limit(struct ibv_srq *srq, uint32_t *limit);
int aiordma_post_srq_recv_batch(struct ibv_srq *srq, int n, const uint64_t *addrs,
                                const uint32_t *lens, uint32_t lkey,
                                const uint64_t *wr_ids, int *posted);
uint32_t aiordma_qp_num(struct ibv_qp *qp);
int aiordma_qp_to_init(struct ibv_qp *qp, uint32_t port_num, uint32_t pkey_index,
                       uint32_t access_flags);
int aiordma_qp_to_rtr(struct ibv_qp *qp, const struct aiordma_rtr_attr *a);
int aiordma_qp_to_rts(struct ibv_qp *qp, const struct aiordma_rts_attr *a);
int aiordma_qp_to_state(struct ibv_qp *qp, uint32_t state);
int aiordma_qp_state(struct ibv_qp *qp);

int aiordma_req_notify(struct ibv_cq *cq, int solicited_only);
int aiordma_poll_batch(struct ibv_cq *cq, int n, struct aiordma_wc *out);
int aiordma_poll_spin(struct ibv_cq *cq, int n, struct aiordma_wc *out, int64_t spin_ns);
int aiordma_drain_cq_events(struct ibv_comp_channel *channel, int max,
                            struct ibv_cq **cqs, unsigned int *counts, int *n_cqs);

int aiordma_post_recv_batch(struct ibv_qp *qp, int n, const uint64_t *addrs,
                            const uint32_t *lens, uint32_t lkey,
                            const uint64_t *wr_ids, int *posted);
int aiordma_post_send_batch(struct ibv_qp *qp, int n,
                            const struct aiordma_send_wr *wrs, int *posted);

/* Scalar fast paths for the data path (one C call, no array to fill):
 * post one SEND_WITH_IMM (length 0: no sge), or one receive buffer.
 * Return 0 or -errno (nothing was posted then). */
int aiordma_post_send_imm(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr,
                          uint32_t length, uint32_t lkey, uint32_t imm_data,
                          uint32_t send_flags);
int aiordma_post_recv_one(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr,
                          uint32_t length, uint32_t lkey);

int aiordma_get_async_event(struct ibv_context *ctx, struct aiordma_async_event *out);

/* Memory windows of type 2 (bound to one QP by a BIND_MW work request; dealloc invalidates). */
struct ibv_mw *aiordma_alloc_mw2(struct ibv_pd *pd);
int aiordma_dealloc_mw(struct ibv_mw *mw);
uint32_t aiordma_mw_rkey(struct ibv_mw *mw);
uint32_t aiordma_inc_rkey(uint32_t rkey);
int aiordma_post_bind_mw(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw, struct ibv_mr *mr,
                         uint64_t addr, uint64_t length, uint32_t mw_access, uint32_t new_rkey,
                         uint32_t send_flags);
int aiordma_qp_set_access(struct ibv_qp *qp, uint32_t access_flags);

#endif
