/*
 * aiordma_verbs.c -- see aiordma_verbs.h for the contract (flat structs in,
 * counts or -errno out, no callbacks into Python, no allocation).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <string.h>
#include <time.h>

#include "aiordma_verbs.h"

/* Work requests / completions handled per inner loop; they live on the stack. */
#define AIORDMA_CHUNK 32

static inline int neg_errno(int fallback)
{
    return errno > 0 ? -errno : -fallback;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Make fd non-blocking (the completion channel fd, the context's async fd). */
int aiordma_set_nonblock(int fd)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0)
        return neg_errno(EBADF);
    if (fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return neg_errno(EBADF);
    return 0;
}

int aiordma_query_device(struct ibv_context *ctx, struct aiordma_device_info *out)
{
    struct ibv_device_attr a;
    int rc = ibv_query_device(ctx, &a);
    if (rc)
        return -rc;
    memset(out, 0, sizeof(*out));
    out->node_guid = a.node_guid;
    out->max_mr_size = a.max_mr_size;
    out->vendor_id = a.vendor_id;
    out->vendor_part_id = a.vendor_part_id;
    out->max_qp = (uint32_t)a.max_qp;
    out->max_qp_wr = (uint32_t)a.max_qp_wr;
    out->max_sge = (uint32_t)a.max_sge;
    out->max_cq = (uint32_t)a.max_cq;
    out->max_cqe = (uint32_t)a.max_cqe;
    out->max_mr = (uint32_t)a.max_mr;
    out->max_pd = (uint32_t)a.max_pd;
    out->max_qp_rd_atom = (uint32_t)a.max_qp_rd_atom;
    out->max_qp_init_rd_atom = (uint32_t)a.max_qp_init_rd_atom;
    out->phys_port_cnt = a.phys_port_cnt;
    memcpy(out->fw_ver, a.fw_ver, sizeof(out->fw_ver) - 1);
    return 0;
}

int aiordma_query_port(struct ibv_context *ctx, uint32_t port_num, struct aiordma_port_info *out)
{
    struct ibv_port_attr a;
    int rc = ibv_query_port(ctx, (uint8_t)port_num, &a);
    if (rc)
        return -rc;
    out->state = a.state;
    out->max_mtu = a.max_mtu;
    out->active_mtu = a.active_mtu;
    out->gid_tbl_len = (uint32_t)a.gid_tbl_len;
    out->lid = a.lid;
    out->link_layer = a.link_layer;
    out->active_speed = a.active_speed;
    out->active_width = a.active_width;
    out->phys_state = a.phys_state;
    out->max_msg_sz = a.max_msg_sz;
    return 0;
}

int aiordma_query_gid(struct ibv_context *ctx, uint32_t port_num, int index, uint8_t *gid16)
{
    union ibv_gid gid;
    if (ibv_query_gid(ctx, (uint8_t)port_num, index, &gid))
        return neg_errno(EINVAL);
    memcpy(gid16, gid.raw, 16);
    return 0;
}

_Static_assert(sizeof(struct aiordma_gid_entry) == sizeof(struct ibv_gid_entry),
               "aiordma_gid_entry must mirror ibv_gid_entry");
_Static_assert(offsetof(struct aiordma_gid_entry, gid_index) == offsetof(struct ibv_gid_entry, gid_index) &&
               offsetof(struct aiordma_gid_entry, ndev_ifindex) == offsetof(struct ibv_gid_entry, ndev_ifindex),
               "aiordma_gid_entry must mirror ibv_gid_entry");

/* Every valid GID of every port in one call (no sysfs walk over empty
 * entries).  Returns the number of entries or -errno (-EINVAL if max is too
 * small for the table). */
int aiordma_query_gid_table(struct ibv_context *ctx, struct aiordma_gid_entry *out, int max)
{
    ssize_t n = ibv_query_gid_table(ctx, (struct ibv_gid_entry *)out, (size_t)max, 0);
    return (int)n;   /* libibverbs already returns -errno on failure */
}

int aiordma_context_fds(struct ibv_context *ctx, int *async_fd, int *num_comp_vectors)
{
    *async_fd = ctx->async_fd;
    *num_comp_vectors = ctx->num_comp_vectors;
    return 0;
}

int aiordma_channel_fd(struct ibv_comp_channel *channel)
{
    return channel->fd;
}

/* ---- queue pairs ------------------------------------------------------ */

/* Post n receive buffers (one sge each, same lkey) to qp's receive queue, or to srq when qp is
 * NULL, as chained WRs of AIORDMA_CHUNK.  0, or -errno with *posted = how many went. */
static int post_recv_chains(struct ibv_qp *qp, struct ibv_srq *srq, int n, const uint64_t *addrs,
                            const uint32_t *lens, uint32_t lkey,
                            const uint64_t *wr_ids, int *posted)
{
    struct ibv_recv_wr wr[AIORDMA_CHUNK], *bad = NULL;
    struct ibv_sge sge[AIORDMA_CHUNK];
    int done = 0;

    while (done < n) {
        int m = n - done < AIORDMA_CHUNK ? n - done : AIORDMA_CHUNK;
        int rc;
        for (int i = 0; i < m; i++) {
            sge[i].addr = addrs[done + i];
            sge[i].length = lens[done + i];
            sge[i].lkey = lkey;
            wr[i].wr_id = wr_ids[done + i];
            wr[i].sg_list = &sge[i];
            wr[i].num_sge = 1;
            wr[i].next = i + 1 < m ? &wr[i + 1] : NULL;
        }
        rc = qp ? ibv_post_recv(qp, wr, &bad) : ibv_post_srq_recv(srq, wr, &bad);
        if (rc) {
            *posted = done + (bad ? (int)(bad - wr) : 0);
            return -rc;
        }
        done += m;
    }
    *posted = done;
    return 0;
}

struct ibv_qp *aiordma_create_rc_qp(struct ibv_pd *pd, struct ibv_cq *send_cq,
                                    struct ibv_cq *recv_cq, struct ibv_srq *srq,
                                    struct aiordma_qp_caps *caps, int sq_sig_all)
{
    struct ibv_qp_init_attr ia;
    struct ibv_qp *qp;

    memset(&ia, 0, sizeof(ia));
    ia.send_cq = send_cq;
    ia.recv_cq = recv_cq;
    ia.srq = srq;               /* NULL: the QP has a receive queue of its own */
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = sq_sig_all;
    ia.cap.max_send_wr = caps->max_send_wr;
    ia.cap.max_recv_wr = caps->max_recv_wr;
    ia.cap.max_send_sge = caps->max_send_sge;
    ia.cap.max_recv_sge = caps->max_recv_sge;
    ia.cap.max_inline_data = caps->max_inline_data;
    qp = ibv_create_qp(pd, &ia);   /* NULL + errno on failure */
    if (qp) {
        /* ibv_create_qp wrote back what the device actually granted. */
        caps->max_send_wr = ia.cap.max_send_wr;
        caps->max_recv_wr = ia.cap.max_recv_wr;
        caps->max_send_sge = ia.cap.max_send_sge;
        caps->max_recv_sge = ia.cap.max_recv_sge;
        caps->max_inline_data = ia.cap.max_inline_data;
    }
    return qp;
}

/* A shared receive queue; *max_wr and *max_sge are what was asked and, on
 * success, what the device granted.  NULL + errno on failure. */
struct ibv_srq *aiordma_create_srq(struct ibv_pd *pd, uint32_t *max_wr,
                                   uint32_t *max_sge, uint32_t srq_limit)
{
    struct ibv_srq_init_attr ia;
    struct ibv_srq *srq;

    memset(&ia, 0, sizeof(ia));
    ia.attr.max_wr = *max_wr;
    ia.attr.max_sge = *max_sge;
    ia.attr.srq_limit = srq_limit;
    srq = ibv_create_srq(pd, &ia);
    if (srq) {
        *max_wr = ia.attr.max_wr;
        *max_sge = ia.attr.max_sge;
    }
    return srq;
}

/* ibv_modify_srq(IBV_SRQ_LIMIT): 0 or the errno. */
int aiordma_arm_srq(struct ibv_srq *srq, uint32_t limit)
{
    struct ibv_srq_attr a;
    memset(&a, 0, sizeof(a));
    a.srq_limit = limit;
    return ibv_modify_srq(srq, &a, IBV_SRQ_LIMIT);
}

/* ibv_query_srq: the armed limit in *limit; 0 or the errno. */
int aiordma_query_srq_limit(struct ibv_srq *srq, uint32_t *limit)
{
    struct ibv_srq_attr a;
    int rc;
    memset(&a, 0, sizeof(a));
    rc = ibv_query_srq(srq, &a);
    if (!rc)
        *limit = a.srq_limit;
    return rc;
}

/* Post n receive buffers to an SRQ, as aiordma_post_recv_batch does to a QP
 * (the same chains: post_recv_chains). */
int aiordma_post_srq_recv_batch(struct ibv_srq *srq, int n, const uint64_t *addrs,
                                const uint32_t *lens, uint32_t lkey,
                                const uint64_t *wr_ids, int *posted)
{
    return post_recv_chains(NULL, srq, n, addrs, lens, lkey, wr_ids, posted);
}

uint32_t aiordma_qp_num(struct ibv_qp *qp)
{
    return qp->qp_num;
}

int aiordma_qp_to_init(struct ibv_qp *qp, uint32_t port_num, uint32_t pkey_index,
                       uint32_t access_flags)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = (uint16_t)pkey_index;
    a.port_num = (uint8_t)port_num;
    a.qp_access_flags = access_flags;
    return -ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                  IBV_QP_ACCESS_FLAGS);
}

int aiordma_qp_to_rtr(struct ibv_qp *qp, const struct aiordma_rtr_attr *r)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)r->path_mtu;
    a.dest_qp_num = r->dest_qp_num;
    a.rq_psn = r->rq_psn & 0xffffff;
    a.max_dest_rd_atomic = (uint8_t)r->max_dest_rd_atomic;
    a.min_rnr_timer = (uint8_t)r->min_rnr_timer;
    a.ah_attr.is_global = (uint8_t)(r->is_global ? 1 : 0);
    a.ah_attr.dlid = (uint16_t)r->dlid;
    a.ah_attr.sl = (uint8_t)r->sl;
    a.ah_attr.src_path_bits = 0;
    a.ah_attr.port_num = (uint8_t)r->port_num;
    if (r->is_global) {
        memcpy(a.ah_attr.grh.dgid.raw, r->dgid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)r->sgid_index;
        a.ah_attr.grh.hop_limit = (uint8_t)r->hop_limit;
        a.ah_attr.grh.traffic_class = (uint8_t)r->traffic_class;
        a.ah_attr.grh.flow_label = r->flow_label;
    }
    return -ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                                  IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

int aiordma_qp_to_rts(struct ibv_qp *qp, const struct aiordma_rts_attr *r)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = r->sq_psn & 0xffffff;
    a.timeout = (uint8_t)r->timeout;
    a.retry_cnt = (uint8_t)r->retry_cnt;
    a.rnr_retry = (uint8_t)r->rnr_retry;
    a.max_rd_atomic = (uint8_t)r->max_rd_atomic;
    return -ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                  IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                  IBV_QP_MAX_QP_RD_ATOMIC);
}

/* A transition that needs only the state (ERR, RESET, SQD). */
int aiordma_qp_to_state(struct ibv_qp *qp, uint32_t state)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = (enum ibv_qp_state)state;
    return -ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

/* Current state (enum ibv_qp_state) or -errno. */
int aiordma_qp_state(struct ibv_qp *qp)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    int rc = ibv_query_qp(qp, &a, IBV_QP_STATE, &ia);
    if (rc)
        return -rc;
    return (int)a.qp_state;
}

/* ---- completion queues ------------------------------------------------ */

int aiordma_req_notify(struct ibv_cq *cq, int solicited_only)
{
    int rc = ibv_req_notify_cq(cq, solicited_only);
    return rc > 0 ? -rc : (rc < 0 ? -EIO : 0);
}

/* Poll up to n completions into out[]; returns how many (0 if the CQ is
 * empty) or -EIO if the provider reports a polling failure. */
int aiordma_poll_batch(struct ibv_cq *cq, int n, struct aiordma_wc *out)
{
    struct ibv_wc wc[AIORDMA_CHUNK];
    int total = 0;

    while (total < n) {
        int want = n - total < AIORDMA_CHUNK ? n - total : AIORDMA_CHUNK;
        int got = ibv_poll_cq(cq, want, wc);
        if (got < 0)
            return total ? total : -EIO;
        for (int i = 0; i < got; i++)
            aiordma_flatten_wc(&wc[i], &out[total + i]);
        total += got;
        if (got < want)
            break;      /* CQ is empty now */
    }
    return total;
}

/* Busy-poll for up to spin_ns nanoseconds: returns as soon as at least one
 * completion was found (after taking up to n of them), or 0 when the time is
 * up.  spin_ns <= 0 polls exactly once.  cffi releases the GIL around this
 * call, so other Python threads keep running while it spins. */
int aiordma_poll_spin(struct ibv_cq *cq, int n, struct aiordma_wc *out, int64_t spin_ns)
{
    int64_t deadline = 0;
    for (;;) {
        int got = aiordma_poll_batch(cq, n, out);
        if (got != 0)
            return got;
        if (spin_ns <= 0)
            return 0;
        if (deadline == 0)
            deadline = now_ns() + spin_ns;
        else if (now_ns() >= deadline)
            return 0;
        for (int i = 0; i < 16; i++)
            cpu_relax();
    }
}

/* Read completion events from a (non-blocking) channel until EAGAIN or max
 * events, then acknowledge them with one ibv_ack_cq_events per CQ.
 * cqs[] / counts[] (capacity max) receive the distinct CQs and their event
 * counts, *n_cqs how many distinct CQs.  Returns the total number of events
 * (0 if none was pending) or -errno if reading failed for another reason
 * than EAGAIN before any event was read. */
int aiordma_drain_cq_events(struct ibv_comp_channel *channel, int max,
                            struct ibv_cq **cqs, unsigned int *counts, int *n_cqs)
{
    int total = 0, distinct = 0, err = 0;

    while (total < max) {
        struct ibv_cq *cq;
        void *cq_ctx;
        int i;
        if (ibv_get_cq_event(channel, &cq, &cq_ctx)) {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                err = neg_errno(EIO);
            break;
        }
        total++;
        for (i = 0; i < distinct; i++)
            if (cqs[i] == cq)
                break;
        if (i == distinct) {
            cqs[distinct] = cq;
            counts[distinct] = 0;
            distinct++;
        }
        counts[i]++;
    }
    for (int i = 0; i < distinct; i++)
        ibv_ack_cq_events(cqs[i], counts[i]);
    *n_cqs = distinct;
    return total ? total : err;
}

/* ---- posting ---------------------------------------------------------- */

/* Post n receive WRs (one sge each, all with the same lkey) as chains of up
 * to AIORDMA_CHUNK.  *posted gets how many were accepted by the provider.
 * Returns 0 or -errno (then the WRs from *posted onwards were not posted). */
int aiordma_post_recv_batch(struct ibv_qp *qp, int n, const uint64_t *addrs,
                            const uint32_t *lens, uint32_t lkey,
                            const uint64_t *wr_ids, int *posted)
{
    return post_recv_chains(qp, NULL, n, addrs, lens, lkey, wr_ids, posted);
}

/* Post n send WRs (SEND, SEND_WITH_IMM, RDMA_WRITE, RDMA_WRITE_WITH_IMM,
 * RDMA_READ) built from wrs[], chained by AIORDMA_CHUNK.  Same result
 * convention as aiordma_post_recv_batch. */
int aiordma_post_send_batch(struct ibv_qp *qp, int n,
                            const struct aiordma_send_wr *wrs, int *posted)
{
    struct ibv_send_wr wr[AIORDMA_CHUNK], *bad = NULL;
    struct ibv_sge sge[AIORDMA_CHUNK];
    int done = 0;

    while (done < n) {
        int m = n - done < AIORDMA_CHUNK ? n - done : AIORDMA_CHUNK;
        int rc;
        memset(wr, 0, sizeof(wr[0]) * (size_t)m);
        for (int i = 0; i < m; i++) {
            const struct aiordma_send_wr *s = &wrs[done + i];
            switch (s->opcode) {
            case IBV_WR_SEND:
            case IBV_WR_SEND_WITH_IMM:
            case IBV_WR_RDMA_WRITE:
            case IBV_WR_RDMA_WRITE_WITH_IMM:
            case IBV_WR_RDMA_READ:
                break;
            default:
                *posted = done;
                return -EINVAL;
            }
            sge[i].addr = s->addr;
            sge[i].length = s->length;
            sge[i].lkey = s->lkey;
            wr[i].wr_id = s->wr_id;
            wr[i].sg_list = s->length ? &sge[i] : NULL;
            wr[i].num_sge = s->length ? 1 : 0;
            wr[i].opcode = (enum ibv_wr_opcode)s->opcode;
            wr[i].send_flags = s->send_flags;
            if (s->opcode == IBV_WR_SEND_WITH_IMM || s->opcode == IBV_WR_RDMA_WRITE_WITH_IMM)
                wr[i].imm_data = htonl(s->imm_data);
            if (s->opcode != IBV_WR_SEND && s->opcode != IBV_WR_SEND_WITH_IMM) {
                wr[i].wr.rdma.remote_addr = s->remote_addr;
                wr[i].wr.rdma.rkey = s->rkey;
            }
            wr[i].next = i + 1 < m ? &wr[i + 1] : NULL;
        }
        rc = ibv_post_send(qp, wr, &bad);
        if (rc) {
            *posted = done + (bad ? (int)(bad - wr) : 0);
            return -rc;
        }
        done += m;
    }
    *posted = done;
    return 0;
}

/* One SEND_WITH_IMM (imm_data in host order), the data path's common case:
 * the same work request aiordma_post_send_batch would build, without the
 * array.  length 0 posts no sge.  Returns 0 or -errno. */
int aiordma_post_send_imm(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr,
                          uint32_t length, uint32_t lkey, uint32_t imm_data,
                          uint32_t send_flags)
{
    struct ibv_send_wr wr, *bad = NULL;
    struct ibv_sge sge;

    memset(&wr, 0, sizeof(wr));
    sge.addr = addr;
    sge.length = length;
    sge.lkey = lkey;
    wr.wr_id = wr_id;
    wr.sg_list = length ? &sge : NULL;
    wr.num_sge = length ? 1 : 0;
    wr.opcode = IBV_WR_SEND_WITH_IMM;
    wr.send_flags = send_flags;
    wr.imm_data = htonl(imm_data);
    return -ibv_post_send(qp, &wr, &bad);
}

/* One receive buffer (one sge).  Returns 0 or -errno. */
int aiordma_post_recv_one(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr,
                          uint32_t length, uint32_t lkey)
{
    struct ibv_recv_wr wr, *bad = NULL;
    struct ibv_sge sge;

    sge.addr = addr;
    sge.length = length;
    sge.lkey = lkey;
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.next = NULL;
    return -ibv_post_recv(qp, &wr, &bad);
}

/* ---- asynchronous events --------------------------------------------- */

/* Read one async event from the context's (non-blocking) async fd, decode
 * which object it concerns, and acknowledge it.  Returns 0, -EAGAIN if none
 * is pending, or -errno. */
int aiordma_get_async_event(struct ibv_context *ctx, struct aiordma_async_event *out)
{
    struct ibv_async_event ev;

    if (ibv_get_async_event(ctx, &ev))
        return neg_errno(EIO);
    memset(out, 0, sizeof(*out));
    out->event_type = ev.event_type;
    switch (ev.event_type) {
    case IBV_EVENT_CQ_ERR:
        out->element_kind = AIORDMA_EV_CQ;
        out->element = (uint64_t)(uintptr_t)ev.element.cq;
        break;
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
        out->element_kind = AIORDMA_EV_QP;
        out->element = (uint64_t)(uintptr_t)ev.element.qp;
        break;
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
        out->element_kind = AIORDMA_EV_SRQ;
        out->element = (uint64_t)(uintptr_t)ev.element.srq;
        break;
    case IBV_EVENT_WQ_FATAL:
        out->element_kind = AIORDMA_EV_WQ;
        out->element = (uint64_t)(uintptr_t)ev.element.wq;
        break;
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
        out->element_kind = AIORDMA_EV_PORT;
        out->port_num = (uint32_t)ev.element.port_num;
        break;
    case IBV_EVENT_DEVICE_FATAL:
        out->element_kind = AIORDMA_EV_DEVICE;
        break;
    default:
        out->element_kind = AIORDMA_EV_NONE;
        break;
    }
    ibv_ack_async_event(&ev);
    return 0;
}

/* ---- memory windows (type 2: bound to one QP) ---------------------------------------------- */

/* Allocate a type 2 memory window; NULL with errno set when the device has none. */
struct ibv_mw *aiordma_alloc_mw2(struct ibv_pd *pd)
{
    return ibv_alloc_mw(pd, IBV_MW_TYPE_2);
}

/* Invalidate and free it (synchronous: when this returns, no rkey of it is valid). */
int aiordma_dealloc_mw(struct ibv_mw *mw)
{
    int rc = ibv_dealloc_mw(mw);
    return rc ? -(rc > 0 ? rc : EIO) : 0;
}

uint32_t aiordma_mw_rkey(struct ibv_mw *mw)
{
    return mw->rkey;
}

/* The next rkey of a window: its index bits kept, its 8-bit key changed (ibv_inc_rkey). */
uint32_t aiordma_inc_rkey(uint32_t rkey)
{
    return ibv_inc_rkey(rkey);
}

/* Post a BIND_MW work request on qp: window mw, bound to [addr, addr + length) of mr with
 * mw_access (IBV_ACCESS_REMOTE_*), its new rkey new_rkey.  Returns 0 or -errno. */
int aiordma_post_bind_mw(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw, struct ibv_mr *mr,
                         uint64_t addr, uint64_t length, uint32_t mw_access, uint32_t new_rkey,
                         uint32_t send_flags)
{
    struct ibv_send_wr wr, *bad = NULL;

    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.opcode = IBV_WR_BIND_MW;
    wr.send_flags = send_flags;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = new_rkey;
    wr.bind_mw.bind_info.mr = mr;
    wr.bind_mw.bind_info.addr = addr;
    wr.bind_mw.bind_info.length = length;
    wr.bind_mw.bind_info.mw_access_flags = mw_access;
    int rc = ibv_post_send(qp, &wr, &bad);
    return rc ? -(rc > 0 ? rc : EIO) : 0;
}

/* Change the access flags of a QP in RTS (what its peer may do: IBV_ACCESS_REMOTE_*). */
int aiordma_qp_set_access(struct ibv_qp *qp, uint32_t access_flags)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_access_flags = access_flags;
    return -ibv_modify_qp(qp, &a, IBV_QP_ACCESS_FLAGS);
}
