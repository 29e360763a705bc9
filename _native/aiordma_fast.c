/*
 * aiordma_fast.c -- the native data path; see aiordma_fast.h for the contract.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "aiordma_fast.h"

#define FAST_CHUNK 32
#define MAX_INLINE_STACK 1024

static inline int64_t fast_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void fast_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline int active(const struct aiordma_chan *c)
{
    return (c->state == AIORDMA_CS_OPEN || c->state == AIORDMA_CS_CLOSING) && c->error == AIORDMA_E_NONE
           && !c->quiet;
}

static void fail(struct aiordma_chan *c, uint32_t code, uint32_t arg, uint64_t wr_id)
{
    if (c->error == AIORDMA_E_NONE) {
        c->error = code;
        c->error_arg = arg;
        c->error_wr_id = wr_id;
    }
    c->events |= AIORDMA_EVT_ERROR;
}

static inline uint32_t pack_imm(uint32_t credit_kind, uint32_t data, uint32_t ctrl)
{
    return (credit_kind << 31) | (ctrl << 24) | data;
}

/* The credits this SEND returns (and forget them: the peer holds them now). */
static inline uint32_t take_returns(struct aiordma_chan *c, uint32_t credit_kind)
{
    int32_t data = c->to_return, ctrl = c->control_to_return;
    c->to_return = c->control_to_return = 0;
    c->peer_available += data;
    c->peer_control_available += ctrl;
    return pack_imm(credit_kind, (uint32_t)data & 0xFFFFFFu, (uint32_t)ctrl & 0x7Fu);
}

static inline uint64_t send_wr_id(const struct aiordma_chan *c, uint32_t kind, uint64_t seq)
{
    return AIORDMA_SQ_BIT | ((uint64_t)kind << AIORDMA_KIND_SHIFT)
           | ((uint64_t)(c->cid & AIORDMA_CID_MASK) << AIORDMA_CID_SHIFT)
           | ((uint64_t)(c->gen & AIORDMA_GEN_MASK) << AIORDMA_GEN_SHIFT) | (seq & AIORDMA_SEQ_MASK);
}

static inline uint64_t recv_wr_id(const struct aiordma_chan *c, uint32_t slot)
{
    return ((uint64_t)(c->cid & AIORDMA_CID_MASK) << AIORDMA_CID_SHIFT)
           | ((uint64_t)(c->gen & AIORDMA_GEN_MASK) << AIORDMA_GEN_SHIFT) | slot;
}

/* Post one send WR (or record it).  Returns 0 or -errno. */
static int post_rdma(struct aiordma_chan *c, uint64_t wr_id, uint32_t opcode, uint64_t addr,
                     uint32_t length, uint32_t lkey, uint32_t imm, uint32_t flags,
                     uint64_t raddr, uint32_t rkey);

static inline int post_one(struct aiordma_chan *c, uint64_t wr_id, uint32_t opcode, uint64_t addr,
                           uint32_t length, uint32_t lkey, uint32_t imm, uint32_t flags)
{
    return post_rdma(c, wr_id, opcode, addr, length, lkey, imm, flags, 0, 0);
}

static int post_rdma(struct aiordma_chan *c, uint64_t wr_id, uint32_t opcode, uint64_t addr,
                     uint32_t length, uint32_t lkey, uint32_t imm, uint32_t flags,
                     uint64_t raddr, uint32_t rkey)
{
    if (c->qp == NULL) {
        if (c->rec_send_n >= c->rec_send_cap)
            return -ENOBUFS;
        struct aiordma_send_wr *w = &c->rec_send[c->rec_send_n];
        if ((flags & IBV_SEND_INLINE) && length) {
            /* the bytes must outlive this call: the caller posts the record later */
            uint8_t *dst = c->rec_inline + (size_t)c->rec_send_n * c->max_inline;
            memcpy(dst, (const void *)(uintptr_t)addr, length);
            addr = (uint64_t)(uintptr_t)dst;
        }
        w->wr_id = wr_id;
        w->addr = addr;
        w->remote_addr = raddr;
        w->length = length;
        w->lkey = lkey;
        w->rkey = rkey;
        w->imm_data = imm;
        w->opcode = opcode;
        w->send_flags = flags;
        c->rec_send_n++;
        return 0;
    }
    struct ibv_sge sge = { .addr = addr, .length = length, .lkey = lkey };
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.opcode = (enum ibv_wr_opcode)opcode;
    wr.send_flags = flags;
    if (length) {
        wr.sg_list = &sge;
        wr.num_sge = 1;
    }
    if (opcode == IBV_WR_SEND_WITH_IMM)
        wr.imm_data = htonl(imm);
    if (opcode == IBV_WR_RDMA_READ || opcode == IBV_WR_RDMA_WRITE) {
        wr.wr.rdma.remote_addr = raddr;
        wr.wr.rdma.rkey = rkey;
    }
    int rc = ibv_post_send(c->qp, &wr, &bad);
    return rc ? -(rc > 0 ? rc : EIO) : 0;
}

/* Post a SEND_WITH_IMM whose immediate data returns the credits owed; a refused post gives them
 * back and fails the chan (a refused post is fatal; nothing was posted).  Returns 0 or -errno. */
static int post_with_returns(struct aiordma_chan *c, uint32_t kind, uint64_t seq, uint64_t addr,
                             uint32_t length, uint32_t lkey, uint32_t flags)
{
    int32_t save_tr = c->to_return, save_ctr = c->control_to_return;
    int32_t save_pa = c->peer_available, save_pca = c->peer_control_available;
    uint32_t imm = take_returns(c, kind == AIORDMA_KIND_CREDIT);
    int rc = post_one(c, send_wr_id(c, kind, seq), IBV_WR_SEND_WITH_IMM, addr, length, lkey, imm, flags);
    if (rc) {
        c->to_return = save_tr;
        c->control_to_return = save_ctr;
        c->peer_available = save_pa;
        c->peer_control_available = save_pca;
        fail(c, AIORDMA_E_POST, (uint32_t)-rc, 0);
    }
    return rc;
}

static inline void push_outstanding(struct aiordma_chan *c, uint64_t seq, int signaled, int32_t slot)
{
    uint32_t i = (c->o_head + c->o_len) % c->sq_depth;
    c->o_seq[i] = seq;
    c->o_sig[i] = (uint8_t)signaled;
    c->o_slot[i] = slot;
    c->o_len++;
    c->sq_used++;
    if (signaled)
        c->signaled_out++;
}

int64_t aiordma_chan_send(struct aiordma_chan *c, const char *a, uint64_t na,
                          const char *b, uint64_t nb, int last)
{
    uint64_t taken = 0;
    uint8_t stack[MAX_INLINE_STACK];

    c->blocked = AIORDMA_BLOCK_NONE;
    if (!active(c) || !c->started)
        return 0;
    while (na + nb > 0) {
        if (c->available <= 0) {
            c->blocked = AIORDMA_BLOCK_CREDITS;
            break;
        }
        if (c->sq_used >= c->sq_depth) {
            c->blocked = AIORDMA_BLOCK_SQ;
            break;
        }
        uint64_t want = na + nb;
        uint32_t len = want < c->send_size ? (uint32_t)want : c->send_size;
        int inl = len <= c->max_inline && len <= MAX_INLINE_STACK;
        if (!inl && c->slots_used >= c->scount) {
            c->blocked = AIORDMA_BLOCK_SQ;
            break;
        }
        uint8_t *dst = inl ? stack : (uint8_t *)(uintptr_t)(c->saddr + (uint64_t)c->slot_head * c->sslot);
        uint32_t filled = 0;
        if (na) {
            uint32_t t = na < len ? (uint32_t)na : len;
            memcpy(dst, a, t);
            a += t;
            na -= t;
            filled = t;
        }
        if (filled < len) {
            uint32_t t = len - filled;
            memcpy(dst + filled, b, t);
            b += t;
            nb -= t;
            filled += t;
        }
        int done = na + nb == 0;
        uint64_t seq = c->seq + 1;
        c->run++;
        int signal = c->run >= c->every || c->sq_used + 1 >= c->sq_depth
                     || (!inl && c->slots_used + 1 >= c->scount) || (last && done);
        uint32_t flags = IBV_SEND_SOLICITED | (signal ? IBV_SEND_SIGNALED : 0) | (inl ? IBV_SEND_INLINE : 0);
        int rc = post_with_returns(c, AIORDMA_KIND_DATA, seq, (uint64_t)(uintptr_t)dst, len,
                                   inl ? 0 : c->slkey, flags);
        if (rc) {
            c->run--;
            return rc;
        }
        c->seq = seq;
        c->available--;
        if (signal)
            c->run = 0;
        int32_t slot = -1;
        if (!inl) {
            slot = (int32_t)c->slot_head;
            c->slot_head = c->slot_head + 1 < c->scount ? c->slot_head + 1 : 0;
            c->slots_used++;
        } else {
            c->inline_sends++;
        }
        push_outstanding(c, seq, signal, slot);
        c->posted_bytes += len;
        c->sends++;
        taken += len;
    }
    return (int64_t)taken;
}

int aiordma_chan_credit(struct aiordma_chan *c)
{
    if (!active(c) || !c->started || c->to_return <= 0 || c->control_available <= 0)
        return 0;
    if (!(c->to_return >= c->threshold || c->peer_available == 0))
        return 0;
    if (c->sq_used >= c->sq_depth) {
        c->blocked = AIORDMA_BLOCK_SQ; /* due, but only a send completion makes room */
        return 0;
    }
    uint64_t seq = c->seq + 1;
    c->run++;
    int signal = c->run >= c->every || c->sq_used + 1 >= c->sq_depth;
    int rc = post_with_returns(c, AIORDMA_KIND_CREDIT, seq, 0, 0, 0,
                               IBV_SEND_SOLICITED | (signal ? IBV_SEND_SIGNALED : 0));
    if (rc) {
        c->run--;
        return rc;
    }
    c->seq = seq;
    c->control_available--;
    if (signal)
        c->run = 0;
    push_outstanding(c, seq, signal, -1);
    c->credit_sends++;
    return 1;
}

int aiordma_chan_marker(struct aiordma_chan *c, uint32_t kind)
{
    if (c->quiet)
        return -ENOTCONN;
    if (c->sq_used >= c->sq_depth)
        return -EAGAIN;
    uint64_t seq = c->seq + 1;
    int rc = post_one(c, send_wr_id(c, kind, seq), IBV_WR_RDMA_WRITE, 0, 0, 0, 0, IBV_SEND_SIGNALED);
    if (rc) {
        fail(c, AIORDMA_E_POST, (uint32_t)-rc, 0);
        return rc;
    }
    c->seq = seq;
    push_outstanding(c, seq, 1, -1);
    if (kind == AIORDMA_KIND_PROBE) {
        c->probe_seq = seq;
        c->probe_status = -1;
    } else {
        c->close_seq = seq;
    }
    return 0;
}

int64_t aiordma_chan_onesided(struct aiordma_chan *c, uint32_t opcode, uint64_t laddr, uint32_t length,
                              uint32_t lkey, uint64_t raddr, uint32_t rkey)
{
    if (!active(c) || !c->started)
        return -ENOTCONN;
    if (opcode != IBV_WR_RDMA_READ && opcode != IBV_WR_RDMA_WRITE)
        return -EINVAL;
    if (c->sq_used >= c->sq_depth)
        return -EAGAIN;
    uint64_t seq = c->seq + 1;
    int rc = post_rdma(c, send_wr_id(c, AIORDMA_KIND_ONESIDED, seq), opcode, laddr, length, lkey, 0,
                       IBV_SEND_SIGNALED, raddr, rkey);
    if (rc) {
        fail(c, AIORDMA_E_POST, (uint32_t)-rc, 0);
        return rc;
    }
    c->seq = seq;
    c->run = 0; /* (signaled: it retires every unsignaled send before it) */
    push_outstanding(c, seq, 1, AIORDMA_SLOT_ONESIDED);
    return (int64_t)seq;
}

int64_t aiordma_chan_reserve(struct aiordma_chan *c, uint64_t *wr_id)
{
    if (!active(c) || !c->started)
        return -ENOTCONN;
    if (c->sq_used >= c->sq_depth)
        return -EAGAIN;
    uint64_t seq = c->seq + 1;
    *wr_id = send_wr_id(c, AIORDMA_KIND_ONESIDED, seq);
    c->seq = seq;
    c->run = 0; /* (signaled) */
    push_outstanding(c, seq, 1, AIORDMA_SLOT_ONESIDED);
    return (int64_t)seq;
}

/* Post the receives queued in c->pend (one linked list, one call). */
int aiordma_chan_flush_reposts(struct aiordma_chan *c)
{
    uint32_t n = c->npend, done = 0;
    if (!n)
        return 0;
    c->npend = 0;
    if (c->qp == NULL) {
        for (uint32_t i = 0; i < n; i++) {
            if (c->rec_recv_n >= c->rec_recv_cap) {
                fail(c, AIORDMA_E_POST, ENOBUFS, 0);
                return -ENOBUFS;
            }
            c->rec_recv[c->rec_recv_n++] = recv_wr_id(c, c->pend[i]);
        }
        return (int)n;
    }
    while (done < n) {
        struct ibv_recv_wr wrs[FAST_CHUNK], *bad = NULL;
        struct ibv_sge sges[FAST_CHUNK];
        uint32_t k = n - done < FAST_CHUNK ? n - done : FAST_CHUNK;
        for (uint32_t i = 0; i < k; i++) {
            uint32_t slot = c->pend[done + i];
            sges[i].addr = c->raddr + (uint64_t)slot * c->rslot;
            sges[i].length = c->buffer_size;
            sges[i].lkey = c->rlkey;
            wrs[i].wr_id = recv_wr_id(c, slot);
            wrs[i].sg_list = &sges[i];
            wrs[i].num_sge = 1;
            wrs[i].next = i + 1 < k ? &wrs[i + 1] : NULL;
        }
        int rc = ibv_post_recv(c->qp, wrs, &bad);
        if (rc) {
            /* the ones before bad were posted; the rest stay ours */
            uint32_t posted = 0;
            for (uint32_t i = 0; i < k && &wrs[i] != bad; i++)
                posted++;
            for (uint32_t i = posted; i < k; i++) {
                c->rposted[c->pend[done + i]] = 0;
                c->rq_posted--;
            }
            for (uint32_t i = done + k; i < n; i++) {
                c->rposted[c->pend[i]] = 0;
                c->rq_posted--;
            }
            fail(c, AIORDMA_E_POST, (uint32_t)(rc > 0 ? rc : EIO), 0);
            return -(rc > 0 ? rc : EIO);
        }
        done += k;
    }
    return (int)n;
}

int aiordma_chan_repost_all(struct aiordma_chan *c)
{
    for (uint32_t i = 0; i < c->rcount; i++) {
        if (!c->rposted[i]) {
            c->rposted[i] = 1;
            c->rq_posted++;
            c->pend[c->npend++] = i;
        }
    }
    return aiordma_chan_flush_reposts(c);
}

static inline void repost(struct aiordma_chan *c, uint32_t slot)
{
    c->rposted[slot] = 1;
    c->rq_posted++;
    c->pend[c->npend++] = slot;
}

static void retire(struct aiordma_chan *c, const struct aiordma_wc *w)
{
    uint64_t seq = w->wr_id & AIORDMA_SEQ_MASK;
    uint32_t k, found = 0;
    for (k = 0; k < c->o_len; k++) {
        if ((c->o_seq[(c->o_head + k) % c->sq_depth] & AIORDMA_SEQ_MASK) == seq) {
            found = 1;
            break;
        }
    }
    if (!found) {
        fail(c, AIORDMA_E_UNKNOWN_WR, 1, w->wr_id);
        return;
    }
    if (w->status && (w->status != IBV_WC_WR_FLUSH_ERR || active(c)))
        fail(c, AIORDMA_E_WC_STATUS, w->status, w->wr_id);
    uint64_t full = 0;
    for (uint32_t i = 0; i <= k; i++) {
        uint32_t j = c->o_head;
        full = c->o_seq[j];
        c->sq_used--;
        if (c->o_sig[j])
            c->signaled_out--;
        if (c->o_slot[j] >= 0)
            c->slots_used--;
        else if (c->o_slot[j] == AIORDMA_SLOT_ONESIDED && c->os_n < c->sq_depth) {
            c->os_done[c->os_n++] = ((full & AIORDMA_SEQ_MASK) << 8) | (w->status & 0xFF);
            c->events |= AIORDMA_EVT_ONESIDED;
        }
        if (c->probe_seq && full == c->probe_seq) {
            c->probe_status = (int32_t)w->status;
            c->events |= AIORDMA_EVT_PROBE;
        }
        c->o_head = j + 1 < c->sq_depth ? j + 1 : 0;
        c->o_len--;
    }
    if (c->close_seq && full >= c->close_seq && !c->close_sent) {
        c->close_sent = 1;
        c->events |= AIORDMA_EVT_CLOSE_SENT;
    }
    c->events |= AIORDMA_EVT_ROOM;
    if (c->state == AIORDMA_CS_DRAINING)
        c->events |= AIORDMA_EVT_DRAIN;
}

/* One receive completion; returns the bytes copied to *dst (0 if none). */
static uint32_t receive(struct aiordma_chan *c, const struct aiordma_wc *w, uint8_t *dst)
{
    uint64_t slot64 = w->wr_id & 0xFFFFFFFFull;
    if (slot64 >= c->rcount || !c->rposted[slot64]) {
        fail(c, AIORDMA_E_UNKNOWN_WR, 0, w->wr_id);
        return 0;
    }
    uint32_t slot = (uint32_t)slot64;
    c->rposted[slot] = 0;
    c->rq_posted--;
    if (c->state == AIORDMA_CS_DRAINING)
        c->events |= AIORDMA_EVT_DRAIN;
    int live = c->error == AIORDMA_E_NONE && c->state != AIORDMA_CS_DRAINING;
    if (w->status) {
        if (w->status != IBV_WC_WR_FLUSH_ERR || active(c))
            fail(c, AIORDMA_E_WC_STATUS, w->status, w->wr_id);
        return 0;
    }
    if (!live)
        return 0; /* failed or draining: the slot just comes back */
    if (!c->started) {
        fail(c, AIORDMA_E_EARLY, 0, w->wr_id);
        return 0;
    }
    if (w->opcode != IBV_WC_RECV) {
        fail(c, AIORDMA_E_OPCODE, w->opcode, w->wr_id);
        return 0;
    }
    if (!(w->wc_flags & IBV_WC_WITH_IMM)) {
        fail(c, AIORDMA_E_NO_IMM, 0, w->wr_id);
        return 0;
    }
    uint32_t imm = w->imm_data;
    int32_t ctrl = (int32_t)(imm >> 24 & 0x7F);
    int32_t returned = (int32_t)(imm & 0xFFFFFF);
    if (imm >> 31) {
        if (w->byte_len) {
            fail(c, AIORDMA_E_CREDIT_PAYLOAD, w->byte_len, w->wr_id);
            return 0;
        }
        if (c->peer_control_available <= 0) {
            fail(c, AIORDMA_E_CREDITS, AIORDMA_CE_CTRL_NO_CREDIT, w->wr_id);
            return 0;
        }
        if (returned == 0) {
            fail(c, AIORDMA_E_CREDITS, AIORDMA_CE_RETURNS_NOTHING, w->wr_id);
            return 0;
        }
        if (c->available + returned > c->window || c->control_available + ctrl > c->control) {
            fail(c, AIORDMA_E_CREDITS, AIORDMA_CE_TOO_MANY, w->wr_id);
            return 0;
        }
        c->peer_control_available--;
        c->available += returned;
        c->control_available += ctrl;
        repost(c, slot);
        c->control_to_return++;
        c->events |= AIORDMA_EVT_ROOM;
        return 0;
    }
    if (w->byte_len > c->buffer_size) {
        fail(c, AIORDMA_E_TOO_LONG, w->byte_len, w->wr_id);
        return 0;
    }
    if (c->peer_available <= 0) {
        fail(c, AIORDMA_E_CREDITS, AIORDMA_CE_DATA_NO_CREDIT, w->wr_id);
        return 0;
    }
    if (c->available + returned > c->window || c->control_available + ctrl > c->control) {
        fail(c, AIORDMA_E_CREDITS, AIORDMA_CE_TOO_MANY, w->wr_id);
        return 0;
    }
    c->peer_available--;
    c->available += returned;
    c->control_available += ctrl;
    if (returned || ctrl)
        c->events |= AIORDMA_EVT_ROOM;
    uint32_t n = w->byte_len;
    if (n)
        memcpy(dst, (const void *)(uintptr_t)(c->raddr + (uint64_t)slot * c->rslot), n);
    c->unread += n;
    c->received_bytes += n;
    c->recvs++;
    repost(c, slot);
    if (c->unread < c->high_water && !c->withheld)
        c->to_return++;
    else
        c->withheld++;
    c->events |= AIORDMA_EVT_DATA;
    return n;
}

int aiordma_chan_process(struct aiordma_chan *const *chans, uint32_t nchans,
                         const struct aiordma_wc *wcs, int n,
                         struct aiordma_delivery *out, int out_cap, int n_out, uint32_t stamp,
                         uint8_t *deliv, uint64_t deliv_cap, uint64_t *deliv_used,
                         struct aiordma_wc *others, int others_cap, int *n_others)
{
    for (int i = 0; i < n; i++) {
        const struct aiordma_wc *w = &wcs[i];
        uint32_t cid = (uint32_t)(w->wr_id >> AIORDMA_CID_SHIFT) & AIORDMA_CID_MASK;
        struct aiordma_chan *c = cid < nchans ? chans[cid] : NULL;
        if (c == NULL || c->cid != cid
            || ((w->wr_id >> AIORDMA_GEN_SHIFT) & AIORDMA_GEN_MASK) != (c->gen & AIORDMA_GEN_MASK)) {
            /* not a chan's (a checked-mode connection's, or a destroyed one's): the caller routes it */
            if (*n_others < others_cap)
                others[*n_others] = *w;
            (*n_others)++;
            continue;
        }
        uint32_t got = 0;
        uint32_t early = c->state == AIORDMA_CS_SETUP;
        if (w->wr_id & AIORDMA_SQ_BIT) {
            retire(c, w);
        } else {
            if (*deliv_used + c->buffer_size > deliv_cap) {
                /* cannot happen when max_polled * largest buffer <= deliv_cap (the caller's rule) */
                fail(c, AIORDMA_E_POST, ENOBUFS, w->wr_id);
                uint64_t slot = w->wr_id & 0xFFFFFFFFull;
                if (slot < c->rcount && c->rposted[slot]) {
                    c->rposted[slot] = 0;
                    c->rq_posted--;
                }
            } else {
                got = receive(c, w, deliv + *deliv_used);
            }
        }
        /* one delivery per run of this chan's bytes; an events-only entry once per wake */
        if (got) {
            struct aiordma_delivery *last = n_out ? &out[n_out - 1] : NULL;
            if (last && last->cid == cid && last->early == early && last->offset + last->length == *deliv_used) {
                last->length += got;
            } else if (n_out < out_cap) {
                out[n_out].cid = cid;
                out[n_out].early = early;
                out[n_out].offset = *deliv_used;
                out[n_out].length = got;
                n_out++;
            }
            *deliv_used += got;
            c->stamp = stamp;
        } else if (c->stamp != stamp && n_out < out_cap) {
            out[n_out].cid = cid;
            out[n_out].early = early;
            out[n_out].offset = *deliv_used;
            out[n_out].length = 0;
            n_out++;
            c->stamp = stamp;
        }
    }
    return n_out;
}

int aiordma_chan_finish(struct aiordma_chan *const *chans, uint32_t nchans,
                        const struct aiordma_delivery *out, int n_out)
{
    int posted = 0;
    for (int i = 0; i < n_out; i++) {
        uint32_t cid = out[i].cid;
        struct aiordma_chan *c = cid < nchans ? chans[cid] : NULL;
        if (c == NULL)
            continue;
        if (c->npend) {
            if (c->state == AIORDMA_CS_DRAINING || c->error != AIORDMA_E_NONE) {
                /* nothing is posted any more: the slots stay ours */
                for (uint32_t k = 0; k < c->npend; k++) {
                    c->rposted[c->pend[k]] = 0;
                    c->rq_posted--;
                }
                c->npend = 0;
            } else if (aiordma_chan_flush_reposts(c) > 0) {
                posted++;
            }
        }
        if (active(c) && aiordma_chan_credit(c) > 0)
            posted++;
    }
    return posted;
}

int aiordma_wake(struct ibv_comp_channel *channel, struct ibv_cq *cq, int read_event,
                 int arm, int64_t spin_ns, int max_polled,
                 struct aiordma_chan *const *chans, uint32_t nchans,
                 struct aiordma_wc *others, int others_cap,
                 struct aiordma_delivery *out, int out_cap, uint32_t stamp,
                 uint8_t *deliv, uint64_t deliv_cap,
                 struct aiordma_wake_result *res)
{
    int n_out = 0, armed = 0;
    int64_t start = 0;
    memset(res, 0, sizeof(*res));
    if (read_event && channel != NULL) {
        struct ibv_cq *ev_cq;
        void *ev_ctx;
        if (ibv_get_cq_event(channel, &ev_cq, &ev_ctx) == 0) {
            ibv_ack_cq_events(ev_cq, 1);
            res->events_read = 1;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
            res->err = errno > 0 ? -errno : -EIO;
            return 0;
        }
    }
    struct aiordma_wc wcs[FAST_CHUNK];
    int n_others = 0;
    for (;;) {
        int want = max_polled - res->polled;
        if (want <= 0) {
            res->more = 1;
            break;
        }
        if (want > FAST_CHUNK)
            want = FAST_CHUNK;
        struct ibv_wc raw[FAST_CHUNK];
        int got = ibv_poll_cq(cq, want, raw);
        if (got < 0) {
            res->err = -EIO;
            break;
        }
        if (got > 0) {
            for (int i = 0; i < got; i++)
                aiordma_flatten_wc(&raw[i], &wcs[i]);
            res->polled += got;
            n_out = aiordma_chan_process(chans, nchans, wcs, got, out, out_cap, n_out, stamp,
                                         deliv, deliv_cap, &res->deliv_used, others, others_cap, &n_others);
            continue; /* until a poll comes back empty (or max_polled) */
        }
        /* empty */
        if (spin_ns > 0) {
            int64_t now = fast_now_ns();
            if (start == 0)
                start = now;
            if (now - start < spin_ns) {
                for (int i = 0; i < 16; i++)
                    fast_relax();
                continue;
            }
            res->spun_ns = now - start;
            spin_ns = 0;
        }
        if (arm && !armed) {
            if (ibv_req_notify_cq(cq, arm == 1)) {
                res->err = -EIO;
                break;
            }
            armed = 1;
            res->armed = 1;
            continue; /* arm-then-poll: what landed before the arming raised no event */
        }
        break;
    }
    res->others = n_others;
    aiordma_chan_finish(chans, nchans, out, n_out);
    return n_out;
}
