# cython: language_level=3
"""The compiled twin of :mod:`.records` (issue 33, goals 2 and 4): a record's derived
msg-id and the rest of its HPUB frame in one call, and a window's frames.

Same functions, same bytes as the pure-Python module (both run the same golden vectors in
``tests/core/publish/test_records_twins.py``). BLAKE2b is RFC 7693's reference algorithm
(digest length 15 in the parameter block, unkeyed: ``docs/protocol.md`` section 6), in C
below, so a record's id costs no Python call; the producer's prefix is hashed once per
publisher (:class:`RestForm`) and its state copied per record, as the pure path copies its
``hashlib`` object.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    typedef struct {
        uint64_t h[8];
        uint64_t t[2];
        size_t c;
        size_t outlen;
        uint8_t b[128];
    } nor_b2b_ctx;

    static const uint64_t nor_b2b_iv[8] = {
        0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL,
        0xA54FF53A5F1D36F1ULL, 0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL,
        0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL};

    static const uint8_t nor_b2b_sigma[12][16] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
        {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
        {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
        {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
        {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
        {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
        {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
        {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
        {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
        {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
        {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

    #define NOR_ROTR64(x, y) (((x) >> (y)) ^ ((x) << (64 - (y))))
    #define NOR_G(a, b, c, d, x, y) do { \
        v[a] = v[a] + v[b] + (x); v[d] = NOR_ROTR64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];       v[b] = NOR_ROTR64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y); v[d] = NOR_ROTR64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];       v[b] = NOR_ROTR64(v[b] ^ v[c], 63); } while (0)

    static uint64_t nor_load64(const uint8_t *p) {
        return ((uint64_t)p[0]) | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
               ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
               ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
    }

    static void nor_b2b_compress(nor_b2b_ctx *ctx, int last) {
        uint64_t v[16], m[16];
        int i;
        for (i = 0; i < 8; i++) { v[i] = ctx->h[i]; v[i + 8] = nor_b2b_iv[i]; }
        v[12] ^= ctx->t[0];
        v[13] ^= ctx->t[1];
        if (last) v[14] = ~v[14];
        for (i = 0; i < 16; i++) m[i] = nor_load64(&ctx->b[8 * i]);
        /* unrolled, each round's message schedule is a constant: about 2x faster */
    #if defined(__GNUC__) && !defined(__clang__)
        #pragma GCC unroll 12
    #endif
        for (i = 0; i < 12; i++) {
            const uint8_t *s = nor_b2b_sigma[i];
            NOR_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
            NOR_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
            NOR_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
            NOR_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
            NOR_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
            NOR_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
            NOR_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
            NOR_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
        }
        for (i = 0; i < 8; i++) ctx->h[i] ^= v[i] ^ v[i + 8];
    }

    static void nor_b2b_init(nor_b2b_ctx *ctx, size_t outlen) {
        int i;
        for (i = 0; i < 8; i++) ctx->h[i] = nor_b2b_iv[i];
        ctx->h[0] ^= 0x01010000ULL ^ (uint64_t)outlen;  /* unkeyed, fanout 1, depth 1 */
        ctx->t[0] = 0;
        ctx->t[1] = 0;
        ctx->c = 0;
        ctx->outlen = outlen;
    }

    static void nor_b2b_update(nor_b2b_ctx *ctx, const uint8_t *in, size_t inlen) {
        while (inlen > 0) {
            size_t take;
            if (ctx->c == 128) {  /* a full block, and more input: it is not the last */
                ctx->t[0] += 128;
                if (ctx->t[0] < 128) ctx->t[1]++;
                nor_b2b_compress(ctx, 0);
                ctx->c = 0;
            }
            take = 128 - ctx->c;
            if (take > inlen) take = inlen;
            memcpy(ctx->b + ctx->c, in, take);
            ctx->c += take;
            in += take;
            inlen -= take;
        }
    }

    static void nor_b2b_final_hex(nor_b2b_ctx *ctx, char *out) {
        static const char hexd[] = "0123456789abcdef";
        size_t i;
        ctx->t[0] += ctx->c;
        if (ctx->t[0] < ctx->c) ctx->t[1]++;
        memset(ctx->b + ctx->c, 0, 128 - ctx->c);
        nor_b2b_compress(ctx, 1);
        for (i = 0; i < ctx->outlen; i++) {
            uint8_t x = (uint8_t)(ctx->h[i >> 3] >> (8 * (i & 7)));
            out[2 * i] = hexd[x >> 4];
            out[2 * i + 1] = hexd[x & 15];
        }
    }

    /* decimal digits of a non-negative number into out (at least 20 bytes); their count */
    static Py_ssize_t nor_digits(unsigned long long x, char *out) {
        char tmp[24];
        Py_ssize_t n = 0, i;
        do { tmp[n++] = (char)('0' + (x % 10)); x /= 10; } while (x);
        for (i = 0; i < n; i++) out[i] = tmp[n - 1 - i];
        return n;
    }
    """
    ctypedef struct nor_b2b_ctx:
        pass
    void nor_b2b_init(nor_b2b_ctx *ctx, size_t outlen) nogil
    void nor_b2b_update(nor_b2b_ctx *ctx, const uint8_t *inp, size_t inlen) nogil
    void nor_b2b_final_hex(nor_b2b_ctx *ctx, char *out) nogil
    Py_ssize_t nor_digits(unsigned long long x, char *out) nogil

cdef enum:
    ID_LEN = 30  # the msg-id: 15 bytes in hex

cdef bytes _PRE = b"NATS/1.0\r\nNats-Msg-Id: "
cdef bytes _SEQ = b"\r\nNats-Ordered-Seq: "  # after the msg-id line's text: see _rest


cdef class RestForm:
    """What every record of one producer shares: its msg-id prefix's digest state and the
    fixed parts of its header block (:func:`rest_form`)."""

    cdef nor_b2b_ctx base
    cdef bytes tail  # b"\r\nNats-Ordered-Producer: <producer>\r\n\r\n"
    cdef readonly bytes producer

    def __init__(self, bytes producer not None):
        self.producer = producer
        nor_b2b_init(&self.base, 15)
        nor_b2b_update(&self.base, <const uint8_t *>PyBytes_AS_STRING(producer),
                       <size_t>PyBytes_GET_SIZE(producer))
        nor_b2b_update(&self.base, <const uint8_t *>b"\x00", 1)
        self.tail = b"\r\nNats-Ordered-Producer: " + producer + b"\r\n\r\n"


def rest_form(bytes producer not None):
    """The form of ``producer``'s records (``producer``: the producer id's UTF-8 bytes)."""
    return RestForm(producer)


cdef inline void _id_hex(RestForm form, unsigned long long place, bytes kb, bytes data,
                         char *out):
    cdef nor_b2b_ctx h = form.base
    cdef char num[24]
    cdef Py_ssize_t n = nor_digits(place, num)
    num[n] = 0
    nor_b2b_update(&h, <const uint8_t *>num, <size_t>(n + 1))
    nor_b2b_update(&h, <const uint8_t *>PyBytes_AS_STRING(kb), <size_t>PyBytes_GET_SIZE(kb))
    nor_b2b_update(&h, <const uint8_t *>b"\x00", 1)
    nor_b2b_update(&h, <const uint8_t *>PyBytes_AS_STRING(data),
                   <size_t>PyBytes_GET_SIZE(data))
    nor_b2b_final_hex(&h, out)


def msg_id(RestForm form not None, unsigned long long place, bytes kb not None,
           bytes data not None):
    """The derived msg-id (hex, as bytes) of the record at ``place`` with key bytes ``kb``
    and payload ``data`` (``docs/protocol.md`` section 6)."""
    cdef bytes out = PyBytes_FromStringAndSize(NULL, ID_LEN)
    _id_hex(form, place, kb, data, PyBytes_AS_STRING(out))
    return out


def record_rest(RestForm form not None, unsigned long long place, bytes kb not None,
                bytes key_line not None, unsigned long long seq, bytes data not None):
    """One accepted record (the publisher's ``_Rec``): ``(rest, payload bytes, header +
    payload bytes)``, its rest being ``.1.$FI <hdr len> <total len>\\r\\n<header block>
    <payload>\\r\\n`` with the derived msg-id of ``place``, ``kb`` and ``data``, the key's
    header line ``key_line`` (empty: keyless) and ``Nats-Ordered-Seq: seq``."""
    cdef char hnum[24]
    cdef char tnum[24]
    cdef char snum[24]
    cdef Py_ssize_t ns = nor_digits(seq, snum)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t kl = PyBytes_GET_SIZE(key_line)
    cdef Py_ssize_t tl = PyBytes_GET_SIZE(form.tail)
    cdef Py_ssize_t pl = PyBytes_GET_SIZE(_PRE)
    cdef Py_ssize_t ql = PyBytes_GET_SIZE(_SEQ)
    # the header block: NATS/1.0..Msg-Id: <id>\r\n<key line>Nats-Ordered-Seq: <seq><tail>
    cdef Py_ssize_t hlen = pl + ID_LEN + kl + ql + ns + tl
    cdef Py_ssize_t total = hlen + size
    cdef Py_ssize_t nh = nor_digits(<unsigned long long>hlen, hnum)
    cdef Py_ssize_t nt = nor_digits(<unsigned long long>total, tnum)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 7 + nh + 1 + nt + 2 + total + 2)
    cdef char *w = PyBytes_AS_STRING(out)
    memcpy(w, b".1.$FI ", 7)
    w += 7
    memcpy(w, hnum, nh)
    w += nh
    w[0] = 32  # " "
    w += 1
    memcpy(w, tnum, nt)
    w += nt
    w[0] = 13
    w[1] = 10
    w += 2
    memcpy(w, PyBytes_AS_STRING(_PRE), pl)
    w += pl
    _id_hex(form, place, kb, data, w)
    w += ID_LEN
    # the msg-id line's end, then the key line between it and the sequence's line
    w[0] = 13
    w[1] = 10
    w += 2
    memcpy(w, PyBytes_AS_STRING(key_line), kl)
    w += kl
    memcpy(w, PyBytes_AS_STRING(_SEQ) + 2, ql - 2)
    w += ql - 2
    memcpy(w, snum, ns)
    w += ns
    memcpy(w, PyBytes_AS_STRING(form.tail), tl)
    w += tl
    memcpy(w, PyBytes_AS_STRING(data), size)
    w += size
    w[0] = 13
    w[1] = 10
    return (out, size, total)


def record_rest_id(RestForm form not None, unsigned long long place, bytes kb not None,
                   bytes key_line not None, unsigned long long seq, bytes data not None,
                   list ids not None):
    """:func:`record_rest`, and the record's derived msg-id (hex, as bytes) appended to
    ``ids`` (taken from the frame: one digest per record)."""
    cdef tuple rec = record_rest(form, place, kb, key_line, seq, data)
    cdef bytes rest = <bytes>rec[0]
    cdef const char *r = PyBytes_AS_STRING(rest)
    cdef Py_ssize_t i = 7
    while r[i] != 10:  # the end of ".1.$FI <hdr len> <total len>\r\n"
        i += 1
    ids.append(PyBytes_FromStringAndSize(r + i + 1 + PyBytes_GET_SIZE(_PRE), ID_LEN))
    return rec


def window_frames(bytes head not None, Py_ssize_t seq, object queue, object inflight,
                  Py_ssize_t n, list frames not None):
    """Move ``n`` records from the head of ``queue`` to the end of ``inflight`` and append
    their frames, ``head + <batch seq> + rest``, batch seqs from ``seq + 1``, to
    ``frames``; their (payload bytes, largest header + payload)."""
    cdef Py_ssize_t payload = 0
    cdef Py_ssize_t largest = 0
    cdef Py_ssize_t total
    cdef Py_ssize_t hl = PyBytes_GET_SIZE(head)
    cdef Py_ssize_t nd, rl
    cdef char num[24]
    cdef tuple rec
    cdef bytes rest, out
    cdef char *w
    popleft = queue.popleft
    push = inflight.append
    for _ in range(n):
        rec = <tuple>popleft()
        push(rec)
        seq += 1
        rest = <bytes>rec[0]
        rl = PyBytes_GET_SIZE(rest)
        nd = nor_digits(<unsigned long long>seq, num)
        out = PyBytes_FromStringAndSize(NULL, hl + nd + rl)
        w = PyBytes_AS_STRING(out)
        memcpy(w, PyBytes_AS_STRING(head), hl)
        memcpy(w + hl, num, nd)
        memcpy(w + hl + nd, PyBytes_AS_STRING(rest), rl)
        frames.append(out)
        payload += <Py_ssize_t>rec[1]
        total = <Py_ssize_t>rec[2]
        if total > largest:
            largest = total
    return payload, largest


def take_acked(object inflight, Py_ssize_t n):
    """Drop the first ``n`` records of ``inflight`` (acknowledged); their payload bytes."""
    cdef Py_ssize_t nbytes = 0
    cdef tuple rec
    popleft = inflight.popleft
    for _ in range(n):
        rec = <tuple>popleft()
        nbytes += <Py_ssize_t>rec[1]
    return nbytes
