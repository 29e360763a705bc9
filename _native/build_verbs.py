"""cffi (API mode, out-of-line) build script for ``aiordma._verbs_cffi``.

Used by ``setup.py`` through ``cffi_modules=["_native/build_verbs.py:ffibuilder"]``
only when the libibverbs headers are installed (Debian/Ubuntu:
``libibverbs-dev``; Fedora: ``rdma-core-devel``).  It can also be
run by hand: ``python _native/build_verbs.py`` builds the extension into the
current directory.

What is exposed (see ``aiordma_verbs.h`` for the helpers' contract):

* the plain, non-inline verbs entry points aiordma needs for object lifetimes
  (device list, open/close, PD, MR, completion channel, CQ, QP destroy, async
  event fd) and the ``*_str`` name functions;
* the helpers in ``aiordma_verbs.c`` for everything on the data path and
  everything that needs unions or nested structs (polling, posting, notify,
  event draining, QP state transitions, queries).

cffi's API mode releases the GIL around every call into C (the generated
wrapper puts the call between ``Py_BEGIN_ALLOW_THREADS`` and
``Py_END_ALLOW_THREADS``), so ``aiordma_poll_spin`` does not stop other
Python threads while it spins.  The C code never calls back into Python.
"""

from __future__ import annotations

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

CDEF = r"""
/* ---- opaque verbs objects -------------------------------------------- */
struct ibv_device;
struct ibv_context;
struct ibv_pd;
struct ibv_cq { int cqe; ...; };
struct ibv_qp;
struct ibv_comp_channel;
struct ibv_mr { void *addr; size_t length; uint32_t handle; uint32_t lkey; uint32_t rkey; ...; };

/* ---- constants (values taken from the real headers at build time) ------ */
#define IBV_ACCESS_LOCAL_WRITE ...
#define IBV_ACCESS_REMOTE_WRITE ...
#define IBV_ACCESS_REMOTE_READ ...
#define IBV_ACCESS_REMOTE_ATOMIC ...
#define IBV_SEND_FENCE ...
#define IBV_SEND_SIGNALED ...
#define IBV_SEND_SOLICITED ...
#define IBV_SEND_INLINE ...
#define IBV_WR_RDMA_WRITE ...
#define IBV_WR_RDMA_WRITE_WITH_IMM ...
#define IBV_WR_SEND ...
#define IBV_WR_SEND_WITH_IMM ...
#define IBV_WR_RDMA_READ ...
#define IBV_WC_WITH_IMM ...
#define IBV_WC_SUCCESS ...
#define IBV_WC_WR_FLUSH_ERR ...
#define IBV_WC_RETRY_EXC_ERR ...
#define IBV_WC_RNR_RETRY_EXC_ERR ...
#define IBV_WC_RECV ...
#define IBV_WC_RECV_RDMA_WITH_IMM ...
#define IBV_QPS_RESET ...
#define IBV_QPS_INIT ...
#define IBV_QPS_RTR ...
#define IBV_QPS_RTS ...
#define IBV_QPS_ERR ...
#define IBV_PORT_ACTIVE ...
#define IBV_MTU_256 ...
#define IBV_MTU_4096 ...
#define IBV_LINK_LAYER_ETHERNET ...
#define IBV_LINK_LAYER_INFINIBAND ...
#define IBV_EVENT_QP_FATAL ...
#define IBV_EVENT_COMM_EST ...
#define IBV_EVENT_QP_LAST_WQE_REACHED ...

/* ---- plain libibverbs functions ---------------------------------------- */
struct ibv_device **ibv_get_device_list(int *num_devices);
void ibv_free_device_list(struct ibv_device **list);
const char *ibv_get_device_name(struct ibv_device *device);
struct ibv_context *ibv_open_device(struct ibv_device *device);
int ibv_close_device(struct ibv_context *context);
struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);
int ibv_dereg_mr(struct ibv_mr *mr);
struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context);
int ibv_destroy_comp_channel(struct ibv_comp_channel *channel);
struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector);
int ibv_destroy_cq(struct ibv_cq *cq);
int ibv_destroy_qp(struct ibv_qp *qp);
const char *ibv_wc_status_str(int status);
const char *ibv_event_type_str(int event);
const char *ibv_port_state_str(int port_state);
const char *ibv_node_type_str(int node_type);

/* ---- aiordma helpers (aiordma_verbs.h) --------------------------------- */
struct aiordma_wc {
    uint64_t wr_id; uint32_t status; uint32_t opcode; uint32_t vendor_err;
    uint32_t byte_len; uint32_t imm_data; uint32_t qp_num; uint32_t src_qp;
    uint32_t wc_flags;
};
struct aiordma_send_wr {
    uint64_t wr_id; uint64_t addr; uint64_t remote_addr; uint32_t length;
    uint32_t lkey; uint32_t rkey; uint32_t imm_data; uint32_t opcode;
    uint32_t send_flags;
};
struct aiordma_qp_caps {
    uint32_t max_send_wr; uint32_t max_recv_wr; uint32_t max_send_sge;
    uint32_t max_recv_sge; uint32_t max_inline_data;
};
struct aiordma_rtr_attr {
    uint8_t dgid[16]; uint32_t dest_qp_num; uint32_t rq_psn; uint32_t path_mtu;
    uint32_t port_num; uint32_t is_global; uint32_t sgid_index; uint32_t hop_limit;
    uint32_t traffic_class; uint32_t flow_label; uint32_t sl; uint32_t dlid;
    uint32_t max_dest_rd_atomic; uint32_t min_rnr_timer;
};
struct aiordma_rts_attr {
    uint32_t sq_psn; uint32_t timeout; uint32_t retry_cnt; uint32_t rnr_retry;
    uint32_t max_rd_atomic;
};
struct aiordma_port_info {
    uint32_t state; uint32_t max_mtu; uint32_t active_mtu; uint32_t gid_tbl_len;
    uint32_t lid; uint32_t link_layer; uint32_t active_speed; uint32_t active_width;
    uint32_t phys_state; uint32_t max_msg_sz;
};
struct aiordma_device_info {
    uint64_t node_guid; uint64_t max_mr_size; uint32_t vendor_id;
    uint32_t vendor_part_id; uint32_t max_qp; uint32_t max_qp_wr; uint32_t max_sge;
    uint32_t max_cq; uint32_t max_cqe; uint32_t max_mr; uint32_t max_pd;
    uint32_t max_qp_rd_atom; uint32_t max_qp_init_rd_atom; uint32_t phys_port_cnt;
    char fw_ver[64];
};
struct aiordma_gid_entry {
    uint8_t gid[16]; uint32_t gid_index; uint32_t port_num; uint32_t gid_type;
    uint32_t ndev_ifindex;
};
#define IBV_GID_TYPE_IB ...
#define IBV_GID_TYPE_ROCE_V1 ...
#define IBV_GID_TYPE_ROCE_V2 ...
#define AIORDMA_EV_NONE ...
#define AIORDMA_EV_CQ ...
#define AIORDMA_EV_QP ...
#define AIORDMA_EV_SRQ ...
#define AIORDMA_EV_WQ ...
#define AIORDMA_EV_PORT ...
#define AIORDMA_EV_DEVICE ...
struct aiordma_async_event {
    uint32_t event_type; uint32_t element_kind; uint64_t element; uint32_t port_num;
};

int aiordma_set_nonblock(int fd);
int aiordma_query_device(struct ibv_context *ctx, struct aiordma_device_info *out);
int aiordma_query_port(struct ibv_context *ctx, uint32_t port_num, struct aiordma_port_info *out);
int aiordma_query_gid(struct ibv_context *ctx, uint32_t port_num, int index, uint8_t *gid16);
int aiordma_query_gid_table(struct ibv_context *ctx, struct aiordma_gid_entry *out, int max);
int aiordma_context_fds(struct ibv_context *ctx, int *async_fd, int *num_comp_vectors);
int aiordma_channel_fd(struct ibv_comp_channel *channel);
struct ibv_qp *aiordma_create_rc_qp(struct ibv_pd *pd, struct ibv_cq *send_cq,
                                    struct ibv_cq *recv_cq,
                                    struct aiordma_qp_caps *caps, int sq_sig_all);
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
int aiordma_post_send_imm(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t length,
                          uint32_t lkey, uint32_t imm_data, uint32_t send_flags);
int aiordma_post_recv_one(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t length,
                          uint32_t lkey);
int aiordma_get_async_event(struct ibv_context *ctx, struct aiordma_async_event *out);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)

# Paths relative to the project root (setup.py runs there); absolute when this
# script is run from elsewhere.
_rel = os.path.relpath(HERE) if os.getcwd() == os.path.dirname(HERE) else HERE

ffibuilder.set_source(
    "aiordma._verbs_cffi",
    '#include <infiniband/verbs.h>\n'
    '#include "aiordma_verbs.h"\n',
    sources=[os.path.join(_rel, "aiordma_verbs.c")],
    include_dirs=[_rel],
    libraries=["ibverbs"],
    extra_compile_args=["-O2", "-Wall", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
