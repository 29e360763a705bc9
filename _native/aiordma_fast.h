/*
 * aiordma_fast.h -- the native data path of one RDMA connection ("chan").
 *
 * Theory of operation
 * -------------------
 * The per-message work of the RDMA transport -- credits, send-queue and
 * send-ring budgets, signaling, checking and retiring completions, copying
 * payloads, re-posting receive buffers -- is the same arithmetic the Python
 * session (aiordma/_rdma/session.py, the "checked" mode) does, done here so a
 * message costs one C call to send and one per wake to receive.  The state of
 * a connection is one struct aiordma_chan that Python allocates (ffi.new)
 * together with the arrays it points to; C never allocates, never calls back
 * into Python and keeps no global state.  Python reads and writes the struct's
 * fields on the cold paths (set-up, close, drain).
 *
 * Calls:
 *   aiordma_chan_send      copy the bytes of one write into send-ring slots
 *                          (or inline into the WR) and post: one call per send;
 *   aiordma_chan_credit    post a credit-only SEND if one is due;
 *   aiordma_chan_marker    post a signaled zero-length RDMA WRITE (probe, fence);
 *   aiordma_chan_repost_all post every receive slot not posted (set-up);
 *   aiordma_wake           one call per wake: read the channel event, poll the
 *                          CQ, process every completion, copy payloads into the
 *                          caller's delivery buffer, re-post the receive
 *                          buffers in one batch per connection, post credit
 *                          SENDs that became due, optionally spin (bounded)
 *                          and arm the CQ, then poll once more;
 *   aiordma_chan_process   the processing part of aiordma_wake, for
 *                          completions the caller polled itself (the
 *                          simulated wire of aiordma.testing).
 *
 * Record mode: a chan whose qp is NULL does not post; it appends the work
 * requests it would post to rec_send / rec_recv (inline payloads copied to
 * rec_inline) and the caller posts them.  The simulated wire runs this very C
 * code that way, on the host.
 *
 * wr_id layout (64 bits): bit 63 set for sends; bits 40..55 the chan's cid
 * (its index in the poller's table); bits 32..39 the chan's generation (a
 * cid is reused only with a new generation: a late completion of a destroyed
 * QP -- a flushed unsignaled send -- never reaches its successor); sends: kind
 * in bits 56..62, sequence number (low 32 bits) in bits 0..31; receives: the
 * slot index in bits 0..31.
 *
 * Immediate data (host order): bit 31 credit-only SEND, bits 24..30 control
 * credits returned, bits 0..23 data credits returned.
 *
 * Errors: the first one found is stored in error / error_arg / error_wr_id
 * (AIORDMA_E_*) and the chan stops posting data; completions are still
 * accounted (buffer ownership never depends on the peer behaving).
 */
#ifndef AIORDMA_FAST_H
#define AIORDMA_FAST_H

#include <stdint.h>
#include <infiniband/verbs.h>
#include "aiordma_verbs.h"

#define AIORDMA_CID_SHIFT 40
#define AIORDMA_CID_MASK 0xFFFFu
#define AIORDMA_KIND_SHIFT 56
#define AIORDMA_SEQ_MASK 0xFFFFFFFFULL
#define AIORDMA_GEN_SHIFT 32
#define AIORDMA_GEN_MASK 0xFFu
#define AIORDMA_SQ_BIT (1ULL << 63)

enum {
    AIORDMA_KIND_DATA = 0, AIORDMA_KIND_CREDIT = 1, AIORDMA_KIND_PROBE = 2, AIORDMA_KIND_FENCE = 3,
    AIORDMA_KIND_ONESIDED = 4   /* an RDMA READ / WRITE of the application's (aiordma_chan_onesided) */
};

/* o_slot of a one-sided WR in the outstanding ring (no send slot; its completion is reported) */
#define AIORDMA_SLOT_ONESIDED (-2)

/* chan.state */
enum {
    AIORDMA_CS_SETUP = 0,     /* receives posted, SENDs accepted and delivered (flagged early) */
    AIORDMA_CS_OPEN = 1,
    AIORDMA_CS_CLOSING = 2,   /* still posts; Python stops queueing */
    AIORDMA_CS_DRAINING = 3   /* QP in ERROR (or failed): flushes are expected, nothing is posted */
};

/* chan.error */
enum {
    AIORDMA_E_NONE = 0,
    AIORDMA_E_UNKNOWN_WR = 1,     /* a completion for nothing outstanding; arg: 0 recv, 1 send */
    AIORDMA_E_WC_STATUS = 2,      /* an error completion; arg: the status */
    AIORDMA_E_OPCODE = 3,         /* a receive that is not a SEND (an RDMA WRITE with immediate); arg: opcode */
    AIORDMA_E_NO_IMM = 4,         /* a SEND without immediate data */
    AIORDMA_E_CREDIT_PAYLOAD = 5, /* a credit-only SEND with bytes; arg: byte_len */
    AIORDMA_E_TOO_LONG = 6,       /* a SEND longer than our buffers; arg: byte_len */
    AIORDMA_E_CREDITS = 7,        /* the peer broke the credit rules; arg: AIORDMA_CE_* */
    AIORDMA_E_POST = 8,           /* ibv_post_send / ibv_post_recv refused; arg: errno */
    AIORDMA_E_EARLY = 9           /* a SEND before the session started */
};

/* error_arg of AIORDMA_E_CREDITS */
enum {
    AIORDMA_CE_DATA_NO_CREDIT = 1,    /* data without a credit */
    AIORDMA_CE_CTRL_NO_CREDIT = 2,    /* a credit message without a control credit */
    AIORDMA_CE_RETURNS_NOTHING = 3,   /* a credit message that returns nothing */
    AIORDMA_CE_TOO_MANY = 4           /* more credits returned than could be owed */
};

/* chan.events: what happened since Python last cleared it */
enum {
    AIORDMA_EVT_DATA = 1,       /* bytes delivered */
    AIORDMA_EVT_ROOM = 2,       /* credits came back or sends retired: a sender may go on */
    AIORDMA_EVT_ERROR = 4,      /* error was set */
    AIORDMA_EVT_PROBE = 8,      /* the probe's completion came back */
    AIORDMA_EVT_CLOSE_SENT = 16,/* the last send before close completed */
    AIORDMA_EVT_DRAIN = 32,     /* a receive or a signaled send came back while draining */
    AIORDMA_EVT_ONESIDED = 64   /* one-sided WRs completed: os_done[0..os_n) */
};

/* chan.blocked: why the last aiordma_chan_send stopped short */
enum { AIORDMA_BLOCK_NONE = 0, AIORDMA_BLOCK_CREDITS = 1, AIORDMA_BLOCK_SQ = 2 };

struct aiordma_chan {
    struct ibv_qp *qp;          /* NULL: record mode */
    uint32_t cid;
    uint32_t state;             /* AIORDMA_CS_* */
    uint32_t started;           /* the send side and credits are set (after the peer's HELLO) */
    uint32_t error;             /* AIORDMA_E_* (first one wins) */
    uint32_t error_arg;
    uint32_t events;            /* AIORDMA_EVT_* */
    uint64_t error_wr_id;
    uint32_t blocked;           /* AIORDMA_BLOCK_* */
    uint32_t stamp;             /* the last wake that listed this chan (aiordma_wake's) */

    /* receive ring: rcount slots of rslot bytes; each receive posts buffer_size bytes */
    uint64_t raddr;
    uint32_t rlkey, rslot, rcount, buffer_size;
    uint8_t *rposted;           /* rcount flags: posted, the device's */
    uint32_t rq_posted;
    uint32_t *pend;             /* rcount: slots to re-post at the end of this wake */
    uint32_t npend;

    /* send ring: scount slots of sslot bytes; a SEND carries at most send_size bytes */
    uint64_t saddr;
    uint32_t slkey, sslot, scount, send_size;
    uint32_t slot_head, slots_used;
    uint32_t sq_depth, sq_used, every, run, max_inline;
    uint32_t signaled_out;
    uint64_t seq;

    /* posted sends not yet retired, oldest first: a ring of sq_depth entries */
    uint64_t *o_seq;
    int32_t *o_slot;            /* -1: no slot (inline, credit, marker) */
    uint8_t *o_sig;
    uint32_t o_head, o_len;

    /* credits (see aiordma/_rdma/credits.py) */
    int32_t available, control_available, to_return, control_to_return;
    int32_t peer_available, peer_control_available;
    int32_t window, control, local_window, local_control, threshold;

    /* flow control: bytes delivered and not yet read (Python lowers it), credits withheld */
    uint64_t unread, high_water;
    uint32_t withheld;

    uint64_t posted_bytes, received_bytes;
    uint64_t sends, inline_sends, credit_sends, recvs;

    /* probe and close */
    uint64_t probe_seq, close_seq;  /* 0: none */
    int32_t probe_status;           /* -1: not back yet */
    uint32_t close_sent;

    /* record mode */
    struct aiordma_send_wr *rec_send;
    uint32_t rec_send_n, rec_send_cap;
    uint64_t *rec_recv;             /* wr_ids (the slot's address and length follow from them) */
    uint32_t rec_recv_n, rec_recv_cap;
    uint8_t *rec_inline;            /* rec_send_cap * max_inline bytes */
    uint32_t gen;                   /* generation of the cid (bits 32..39 of every wr_id) */

    /* one-sided WRs completed since Python last read them: (seq << 8) | wc status; sq_depth
     * entries (each one-sided WR holds a send-queue entry until it completes, so they fit) */
    uint64_t *os_done;
    uint32_t os_n;

    /* 1: post nothing more (the peer said goodbye: its QP is going away); receives are still
     * processed and delivered */
    uint32_t quiet;
};

/* One run of delivered bytes: deliv[offset:offset+length] belongs to chans[cid]
 * (length 0: only events).  early: delivered before the session was activated. */
struct aiordma_delivery {
    uint32_t cid;
    uint32_t early;
    uint64_t offset;
    uint64_t length;
};

struct aiordma_wake_result {
    int32_t events_read;      /* channel events read and acknowledged */
    int32_t polled;           /* completions polled */
    int32_t others;           /* completions for no chan, copied to others[] */
    int32_t armed;            /* 1: the CQ was armed in this call */
    int32_t more;             /* 1: stopped at max_polled; call again */
    int32_t err;              /* -errno of a failed poll / event read, else 0 */
    uint64_t deliv_used;
    int64_t spun_ns;
};

int64_t aiordma_chan_send(struct aiordma_chan *c, const char *a, uint64_t na,
                          const char *b, uint64_t nb, int last);
int aiordma_chan_credit(struct aiordma_chan *c);
int aiordma_chan_marker(struct aiordma_chan *c, uint32_t kind);
/* Post a signaled RDMA READ (opcode IBV_WR_RDMA_READ) or WRITE (IBV_WR_RDMA_WRITE) of the
 * application's: length bytes between [laddr, lkey] and [raddr, rkey].  Returns its sequence
 * number (> 0; its completion appears in os_done), -EAGAIN when the send queue is full, or
 * -errno (the chan failed).  Bounds and keys are the caller's to check first. */
int64_t aiordma_chan_onesided(struct aiordma_chan *c, uint32_t opcode, uint64_t laddr, uint32_t length,
                              uint32_t lkey, uint64_t raddr, uint32_t rkey);
/* Reserve a send-queue entry for a signaled work request the caller posts itself (a BIND_MW):
 * accounted as a one-sided WR (its completion appears in os_done).  Returns its sequence number
 * (> 0) and writes the wr_id to post it with, or -EAGAIN (send queue full), -ENOTCONN. */
int64_t aiordma_chan_reserve(struct aiordma_chan *c, uint64_t *wr_id);
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

#endif
