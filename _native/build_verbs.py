"""cffi (API mode, out-of-line) build script for ``aiordma._verbs_cffi``.

Used by ``setup.py`` through ``cffi_modules=["_native/build_verbs.py:ffibuilder"]``.  It
builds with a C compiler alone: the verbs declarations come from ``_native/include`` (copies of
rdma-core's public headers, see ``include/NOTICE``), and the module is linked against a stub
``libibverbs.so.1`` built here (:func:`_link_stub`) that carries rdma-core's symbol versions, so
the module asks for the real library (Debian/Ubuntu ``libibverbs1``, with a provider such as
``ibverbs-providers``) by its soname at run time.  It can also be
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

import atexit
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

CDEF = r"""
/* ---- opaque verbs objects -------------------------------------------- */
struct ibv_device;
struct ibv_context;
struct ibv_pd;
struct ibv_cq { int cqe; ...; };
struct ibv_qp;
struct ibv_srq;
struct ibv_comp_channel;
struct ibv_mr { void *addr; size_t length; uint32_t handle; uint32_t lkey; uint32_t rkey; ...; };

/* ---- constants (values taken from the real headers at build time) ------ */
#define IBV_ACCESS_LOCAL_WRITE ...
#define IBV_ACCESS_REMOTE_WRITE ...
#define IBV_ACCESS_REMOTE_READ ...
#define IBV_ACCESS_REMOTE_ATOMIC ...
#define IBV_ACCESS_MW_BIND ...
#define IBV_WR_BIND_MW ...
#define IBV_WC_BIND_MW ...
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
int ibv_destroy_srq(struct ibv_srq *srq);
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
int aiordma_post_send_imm(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t length,
                          uint32_t lkey, uint32_t imm_data, uint32_t send_flags);
int aiordma_post_recv_one(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t length,
                          uint32_t lkey);
int aiordma_get_async_event(struct ibv_context *ctx, struct aiordma_async_event *out);
struct ibv_mw;
struct ibv_mw *aiordma_alloc_mw2(struct ibv_pd *pd);
int aiordma_dealloc_mw(struct ibv_mw *mw);
uint32_t aiordma_mw_rkey(struct ibv_mw *mw);
uint32_t aiordma_inc_rkey(uint32_t rkey);
int aiordma_post_bind_mw(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw, struct ibv_mr *mr,
                         uint64_t addr, uint64_t length, uint32_t mw_access, uint32_t new_rkey,
                         uint32_t send_flags);
int aiordma_qp_set_access(struct ibv_qp *qp, uint32_t access_flags);
int64_t aiordma_chan_reserve(struct aiordma_chan *c, uint64_t *wr_id);

/* ---- the native data path (aiordma_fast.h) ----------------------------- */
#define AIORDMA_CID_SHIFT ...
#define AIORDMA_KIND_SHIFT ...
#define AIORDMA_KIND_DATA ...
#define AIORDMA_KIND_CREDIT ...
#define AIORDMA_KIND_PROBE ...
#define AIORDMA_KIND_FENCE ...
#define AIORDMA_CS_SETUP ...
#define AIORDMA_CS_OPEN ...
#define AIORDMA_CS_CLOSING ...
#define AIORDMA_CS_DRAINING ...
#define AIORDMA_E_NONE ...
#define AIORDMA_E_UNKNOWN_WR ...
#define AIORDMA_E_WC_STATUS ...
#define AIORDMA_E_OPCODE ...
#define AIORDMA_E_NO_IMM ...
#define AIORDMA_E_CREDIT_PAYLOAD ...
#define AIORDMA_E_TOO_LONG ...
#define AIORDMA_E_CREDITS ...
#define AIORDMA_E_POST ...
#define AIORDMA_E_EARLY ...
#define AIORDMA_CE_DATA_NO_CREDIT ...
#define AIORDMA_CE_CTRL_NO_CREDIT ...
#define AIORDMA_CE_RETURNS_NOTHING ...
#define AIORDMA_CE_TOO_MANY ...
#define AIORDMA_EVT_DATA ...
#define AIORDMA_EVT_ROOM ...
#define AIORDMA_EVT_ERROR ...
#define AIORDMA_EVT_PROBE ...
#define AIORDMA_EVT_CLOSE_SENT ...
#define AIORDMA_EVT_DRAIN ...
#define AIORDMA_EVT_ONESIDED ...
#define AIORDMA_KIND_ONESIDED ...
#define AIORDMA_BLOCK_NONE ...
#define AIORDMA_BLOCK_CREDITS ...
#define AIORDMA_BLOCK_SQ ...
struct aiordma_chan {
    struct ibv_qp *qp;
    uint32_t cid; uint32_t state; uint32_t started; uint32_t error; uint32_t error_arg;
    uint32_t events; uint64_t error_wr_id; uint32_t blocked; uint32_t stamp;
    uint64_t raddr; uint32_t rlkey, rslot, rcount, buffer_size;
    uint8_t *rposted; uint32_t rq_posted; uint32_t *pend; uint32_t npend;
    uint64_t saddr; uint32_t slkey, sslot, scount, send_size;
    uint32_t slot_head, slots_used;
    uint32_t sq_depth, sq_used, every, run, max_inline;
    uint32_t signaled_out; uint64_t seq;
    uint64_t *o_seq; int32_t *o_slot; uint8_t *o_sig; uint32_t o_head, o_len;
    int32_t available, control_available, to_return, control_to_return;
    int32_t peer_available, peer_control_available;
    int32_t window, control, local_window, local_control, threshold;
    uint64_t unread, high_water; uint32_t withheld;
    uint64_t posted_bytes, received_bytes;
    uint64_t sends, inline_sends, credit_sends, recvs;
    uint64_t probe_seq, close_seq; int32_t probe_status; uint32_t close_sent;
    struct aiordma_send_wr *rec_send; uint32_t rec_send_n, rec_send_cap;
    uint64_t *rec_recv; uint32_t rec_recv_n, rec_recv_cap;
    uint8_t *rec_inline;
    uint32_t gen;
    uint64_t *os_done; uint32_t os_n;
    uint32_t quiet;
};
struct aiordma_delivery { uint32_t cid; uint32_t early; uint64_t offset; uint64_t length; };
struct aiordma_wake_result {
    int32_t events_read; int32_t polled; int32_t others; int32_t armed; int32_t more; int32_t err;
    uint64_t deliv_used; int64_t spun_ns;
};
int64_t aiordma_chan_send(struct aiordma_chan *c, const char *a, uint64_t na,
                          const char *b, uint64_t nb, int last);
int aiordma_chan_credit(struct aiordma_chan *c);
int aiordma_chan_marker(struct aiordma_chan *c, uint32_t kind);
int64_t aiordma_chan_onesided(struct aiordma_chan *c, uint32_t opcode, uint64_t laddr, uint32_t length,
                              uint32_t lkey, uint64_t raddr, uint32_t rkey);
int aiordma_chan_repost_all(struct aiordma_chan *c);
int aiordma_chan_flush_reposts(struct aiordma_chan *c);
int aiordma_chan_process(struct aiordma_chan *const *chans, uint32_t nchans,
                         const struct aiordma_wc *wcs, int n,
                         struct aiordma_delivery *out, int out_cap, int n_out, uint32_t stamp,
                         uint8_t *deliv, uint64_t deliv_cap, uint64_t *deliv_used,
                         struct aiordma_wc *others, int others_cap, int *n_others);
int aiordma_chan_finish(struct aiordma_chan *const *chans, uint32_t nchans,
                        const struct aiordma_delivery *out, int n_out);
int aiordma_wake(struct ibv_comp_channel *channel, struct ibv_cq *cq, int read_event,
                 int arm, int64_t spin_ns, int max_polled,
                 struct aiordma_chan *const *chans, uint32_t nchans,
                 struct aiordma_wc *others, int others_cap,
                 struct aiordma_delivery *out, int out_cap, uint32_t stamp,
                 uint8_t *deliv, uint64_t deliv_cap,
                 struct aiordma_wake_result *res);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)

# Paths relative to the project root (setup.py runs there); absolute when this
# script is run from elsewhere.
_rel = os.path.relpath(HERE) if os.getcwd() == os.path.dirname(HERE) else HERE

#: The libibverbs functions the module calls, by the version each has as its default in
#: libibverbs.so.1 (``objdump -T``).  Versions matter: libibverbs keeps its 1.0 ABI under the same
#: names (``ibv_open_device@IBVERBS_1.0`` returns another struct), and an unversioned reference
#: binds to that oldest one at run time -- the context's fields were garbage when the module
#: was built without linking.  tests/test_wheel.py checks that every reference carries its version.
SYMBOL_VERSIONS: dict[str, tuple[str, ...]] = {
    "IBVERBS_1.0": ("ibv_create_comp_channel", "ibv_destroy_comp_channel"),
    "IBVERBS_1.1": (
        "ibv_ack_async_event", "ibv_ack_cq_events", "ibv_alloc_pd", "ibv_close_device", "ibv_create_cq",
        "ibv_create_qp", "ibv_create_srq", "ibv_dealloc_pd", "ibv_dereg_mr", "ibv_destroy_cq", "ibv_destroy_qp",
        "ibv_destroy_srq", "ibv_modify_srq", "ibv_query_srq",
        "ibv_event_type_str", "ibv_free_device_list", "ibv_get_async_event", "ibv_get_cq_event",
        "ibv_get_device_list", "ibv_get_device_name", "ibv_modify_qp", "ibv_node_type_str", "ibv_open_device",
        "ibv_port_state_str", "ibv_query_device", "ibv_query_gid", "ibv_query_port", "ibv_query_qp",
        "ibv_wc_status_str",
    ),
    "IBVERBS_1.8": ("ibv_reg_mr_iova2",),
    "IBVERBS_1.11": ("_ibv_query_gid_table",),
}  # fmt: skip


def _link_stub() -> str:
    """Build a stub ``libibverbs.so.1`` (empty functions, rdma-core's soname and symbol
    versions) in a scratch directory and return it: linking against it gives the module a
    ``DT_NEEDED`` on ``libibverbs.so.1`` and a versioned reference per function, as linking the
    real library would, without needing rdma-core on the build host.  Nothing of the stub is
    installed."""
    out = tempfile.mkdtemp(prefix="aiordma-ibverbs-stub-")
    atexit.register(shutil.rmtree, out, True)
    names = [n for group in SYMBOL_VERSIONS.values() for n in group]
    with open(os.path.join(out, "stub.c"), "w") as f:
        f.writelines(f"void {name}(void) {{}}\n" for name in names)
    script, previous = [], ""
    for i, (version, group) in enumerate(SYMBOL_VERSIONS.items()):
        body = " ".join(f"{n};" for n in group)
        local = " local: *;" if i == 0 else ""
        script.append(f"{version} {{ global: {body}{local} }} {previous};")
        previous = version
    with open(os.path.join(out, "stub.map"), "w") as f:
        f.write("\n".join(script) + "\n")
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    subprocess.run([*cc, "-shared", "-fPIC", "-o", os.path.join(out, "libibverbs.so.1"), os.path.join(out, "stub.c"),
                    "-Wl,-soname,libibverbs.so.1", "-Wl,--version-script," + os.path.join(out, "stub.map")],
                   check=True)  # fmt: skip
    return out


ffibuilder.set_source(
    "aiordma._verbs_cffi",
    '#include <infiniband/verbs.h>\n'
    '#include "aiordma_verbs.h"\n'
    '#include "aiordma_fast.h"\n',
    sources=[os.path.join(_rel, "aiordma_verbs.c"), os.path.join(_rel, "aiordma_fast.c")],
    # the verbs declarations this project carries (include/NOTICE): a C compiler is all a build
    # needs; first, so that they win over any system copy
    include_dirs=[os.path.join(_rel, "include"), _rel],
    # linked against the stub (no rpath: at run time the loader finds the real libibverbs.so.1,
    # or the module's import fails and aiordma says why and runs on TCP)
    library_dirs=[_link_stub()],
    libraries=[":libibverbs.so.1"],
    extra_compile_args=["-O2", "-Wall", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
