# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :mod:`airflow_nats_ordered.core.stream.frames` (issue 33, goal 4).

The same functions, with the same results (tests/core/stream/test_frames_golden.py runs
every golden vector through both): :func:`cut` does in one call per socket read what the
pure loop does per frame (find the control line's end, read the HMSG arguments, look the
route up, slice header block and payload, read the reply subject's sequences, hand the
delivery over), reading the parser's bytearray in place (no copy of the read);
:func:`parse_headers` is nats-py's header parsing on the bytes, without a decode of the
whole block. Anything unusual (a number that is not plain digits, a reply subject that is
not a JetStream ACK subject) is left to the same Python code the pure twin runs.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_FromLongLong
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeASCII, PyUnicode_DecodeUTF8
from libc.string cimport memchr, memcmp
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cimport cython

import logging

log = logging.getLogger("airflow_nats_ordered.core.worker.worker")

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL

cdef enum:
    HDR_LINE = 8  # len(b"NATS/1.0")


cdef inline bint _blank(unsigned char c) noexcept nogil:
    # what bytes.split() and bytes.strip() take for whitespace
    return c == 32 or 9 <= c <= 13


cdef inline bint _plain(const unsigned char* p, Py_ssize_t a, Py_ssize_t b, long long* out) noexcept nogil:
    # p[a:b] is 1 to 18 ASCII digits: its value in out
    cdef long long v = 0
    cdef Py_ssize_t i
    if b <= a or b - a > 18:
        return False
    for i in range(a, b):
        if not 48 <= p[i] <= 57:
            return False
        v = v * 10 + (p[i] - 48)
    out[0] = v
    return True


@cython.boundscheck(True)
@cython.wraparound(True)
cdef object _hmsg_slow(bytes line):
    # (sid, header size, total size) of an HMSG line as the pure twin's hmsg_py reads
    # them, or None
    args = line.split()
    try:
        if len(args) == 5:
            sid, hs, tot = int(args[1]), int(args[3]), int(args[4])
        elif len(args) == 4:
            sid, hs, tot = int(args[1]), int(args[2]), int(args[3])
        else:
            return None
    except ValueError:
        return None
    if not 0 <= hs <= tot:
        return None
    return sid, hs, tot


cdef Py_ssize_t _crlf(const unsigned char* p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    # bytes.find(b"\r\n", i) on p[:n]
    cdef const unsigned char* q
    while i < n - 1:
        q = <const unsigned char*>memchr(p + i, 13, n - 1 - i)
        if q == NULL:
            return -1
        i = q - p
        if p[i + 1] == 10:
            return i
        i += 1
    return -1


cdef object _seqs(const unsigned char* p, Py_ssize_t a, Py_ssize_t b):
    # sequences() of the reply p[a:b], or None where the pure twin's code must decide
    cdef Py_ssize_t starts[11]
    cdef Py_ssize_t ends[11]
    cdef int k = 0
    cdef Py_ssize_t i, s = a
    cdef long long x, y
    for i in range(a, b):
        if p[i] == 46:  # "."
            if k < 11:
                starts[k] = s
                ends[k] = i
            k += 1
            s = i + 1
    if k < 11:
        starts[k] = s
        ends[k] = b
    k += 1  # tokens
    if k == 9:
        i = 5
    elif k >= 10:
        i = 7
    else:
        return None
    if _plain(p, starts[i], ends[i], &x) and _plain(p, starts[i + 1], ends[i + 1], &y):
        return (x, y)
    return None


@cython.boundscheck(True)
@cython.wraparound(True)
def sequences(str reply):
    """(stream sequence, consumer sequence) from a JetStream delivery's reply subject."""
    cdef Py_ssize_t n
    cdef const char* s = PyUnicode_AsUTF8AndSize(reply, &n)
    r = _seqs(<const unsigned char*>s, 0, n)
    if r is not None:
        return r
    t = reply.split(".")
    return (int(t[5]), int(t[6])) if len(t) == 9 else (int(t[7]), int(t[8]))


# header names seen: trimmed bytes -> the same str each time (its hash computed once)
cdef list _name_keys = []
cdef list _name_vals = []
cdef enum:
    NAMES_MAX = 64


cdef object _name(const unsigned char* p, Py_ssize_t a, Py_ssize_t b):
    cdef Py_ssize_t i, L = b - a, count = PyList_GET_SIZE(_name_keys)
    cdef object k
    for i in range(count):
        k = <object>PyList_GET_ITEM(_name_keys, i)
        if PyBytes_GET_SIZE(k) == L and memcmp(PyBytes_AS_STRING(k), p + a, L) == 0:
            return <object>PyList_GET_ITEM(_name_vals, i)
    name = PyUnicode_DecodeASCII(<const char*>p + a, L, NULL)
    if count >= NAMES_MAX:
        del _name_keys[:]
        del _name_vals[:]
    _name_keys.append(PyBytes_FromStringAndSize(<const char*>p + a, L))
    _name_vals.append(name)
    return name


def parse_headers(bytes raw):
    """A data message's header block as nats-py parses it (``Client._parse_header_lines``
    of the block after its first line): names ASCII without blanks, names and values
    trimmed of ASCII whitespace, values decoded as UTF-8 with replacement, the last of a
    repeated name wins."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(raw)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(raw)
    cdef Py_ssize_t i, e, c, a, b
    cdef const unsigned char* q
    cdef unsigned char ch
    cdef bint ok
    cdef dict out = {}
    i = _crlf(p, 0, n)
    if i < 0:
        return out
    i += 2
    while i < n:
        e = _crlf(p, i, n)
        if e < 0:
            e = n
        q = <const unsigned char*>memchr(p + i, 58, e - i)  # ":"
        if q != NULL:
            c = q - p
            a = i
            b = c
            while a < b and _blank(p[a]):
                a += 1
            while b > a and _blank(p[b - 1]):
                b -= 1
            ok = True
            for k in range(a, b):
                ch = p[k]
                # ASCII, and no str.isspace() character (\x1c-\x1f included)
                if ch >= 128 or ch == 32 or 9 <= ch <= 13 or 28 <= ch <= 31:
                    ok = False
                    break
            if ok:
                name = _name(p, a, b)
                a = c + 1
                b = e
                while a < b and _blank(p[a]):
                    a += 1
                while b > a and _blank(p[b - 1]):
                    b -= 1
                out[name] = PyUnicode_DecodeUTF8(<const char*>p + a, b - a, "replace")
        i = e + 2
    return out


# a reader's deliveries all come on its inbox: the last subject decoded is used again
cdef object _last_subject = ""


cdef object _subject(const unsigned char* s, Py_ssize_t n):
    global _last_subject
    cdef Py_ssize_t have
    cdef const char* last = PyUnicode_AsUTF8AndSize(_last_subject, &have)
    if have == n and memcmp(last, s, n) == 0:
        return _last_subject
    _last_subject = PyUnicode_DecodeUTF8(<const char*>s, n, NULL)
    return _last_subject


cdef class Delivery:
    """A message of a reader's inbox taken off the socket by the fast route, with the
    attributes of nats-py's ``Msg`` the worker uses (the twin of ``frames.Delivery_py``):
    ``headers`` is parsed from the raw block on first use; ``seqs`` holds the reply
    subject's (stream, consumer) sequences when :func:`cut` read them, else None."""

    cdef public object subject
    cdef public object reply
    cdef public object data
    cdef public object _raw
    cdef public object _headers
    cdef public object seqs

    def __init__(self, subject, reply, data, raw, headers=None):
        self.subject = subject
        self.reply = reply
        self.data = data
        self._raw = raw
        self._headers = headers
        self.seqs = None

    @property
    def headers(self):
        if self._raw is not None:
            self._headers = parse_headers(self._raw)
            self._raw = None
        return self._headers


cdef inline double _monotonic() noexcept nogil:
    # time.monotonic() (CLOCK_MONOTONIC, as CPython reads it on POSIX)
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class Inbox:
    """A reader's intake (the twin of ``frames.Inbox_py``, which says what it does): the
    route's entry is the object itself, which :func:`cut` calls without a Python call."""

    cdef public object buf
    cdef public Py_ssize_t buf_bytes
    cdef public object requests
    cdef public object ready
    cdef public object on_gap
    cdef public long long cseq
    cdef public bint lost
    cdef public double last_activity
    cdef object _append
    cdef object _set

    def __init__(self, ready, on_gap):
        from collections import deque

        self.buf = deque()
        self.buf_bytes = 0
        self.requests = deque()
        self.ready = ready
        self.on_gap = on_gap
        self.cseq = 0
        self.lost = False
        self.last_activity = 0.0
        self._append = self.buf.append
        self._set = ready.set

    @property
    def entry(self):
        return self

    def __call__(self, m, Py_ssize_t hsize):
        self._take(m, hsize)

    def take(self, m, Py_ssize_t hsize):
        """A delivery ``m`` whose header block is ``hsize`` bytes long."""
        self._take(m, hsize)

    cdef int _take(self, object m, Py_ssize_t hsize) except -1:
        cdef Delivery d
        cdef Py_ssize_t size
        cdef long long cseq
        self.last_activity = _monotonic()
        if type(m) is Delivery:
            d = <Delivery>m
            reply = d.reply
            seqs = d.seqs
            subject = d.subject
            data = d.data
        else:
            reply = m.reply
            seqs = None
            subject = m.subject
            data = m.data
        if self.lost or not reply:
            return 0  # the consumer is being re-created; or not a delivery
        if seqs is None:
            seqs = sequences(reply)
        seq, cseq_o = seqs
        cseq = cseq_o
        if cseq != self.cseq + 1:
            self.on_gap(cseq_o)
            self.lost = True
            self._set()
            return 0
        self.cseq = cseq
        # its size as the server counts it against max_bytes (approximately)
        size = len(subject) + len(reply) + hsize + len(data)
        requests = self.requests
        if requests:
            req = requests[0]
            req[0] -= 1
            req[1] -= size
            req[2] += 1
            if req[0] <= 0:
                requests.popleft()
        if not self.buf:
            self._set()
        self._append((seq, m, size))
        self.buf_bytes += size
        return 0

    def drain(self, Py_ssize_t batch, next_seq):
        """What ``frames.Inbox_py.drain`` does."""
        cdef list out = []
        cdef Py_ssize_t taken = 0
        cdef tuple item
        buf = self.buf
        popleft = buf.popleft
        while buf and len(out) < batch:
            item = popleft()
            seq = item[0]
            taken += <Py_ssize_t>item[2]
            if seq < next_seq:
                continue
            out.append((seq, item[1]))
            next_seq = seq + 1
        self.buf_bytes -= taken
        return out, next_seq


cdef int _args(const unsigned char* p, Py_ssize_t a, Py_ssize_t b,
               Py_ssize_t* starts, Py_ssize_t* ends) noexcept nogil:
    # the blank-separated words of p[a:b] (at most 6 recorded): their count
    cdef int k = 0
    while True:
        while a < b and _blank(p[a]):
            a += 1
        if a >= b:
            return k
        if k < 6:
            starts[k] = a
        while a < b and not _blank(p[a]):
            a += 1
        if k < 6:
            ends[k] = a
        k += 1


cdef bint _digits_only(const unsigned char* p, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(a, b):
        if not 48 <= p[i] <= 57:
            return False
    return b > a


def cut(object chunk, Py_ssize_t pos, dict table, dict stats):
    """What ``frames.cut_py`` does, on ``chunk`` (the parser's bytearray, read in place, or
    bytes), in one call for all the data deliveries of a read."""
    cdef Py_buffer view
    cdef const unsigned char* p
    cdef Py_ssize_t n, end, frame_end, start, sa, sl, ra, rl, hsize, total
    cdef Py_ssize_t starts[6]
    cdef Py_ssize_t ends[6]
    cdef long long sid, hs, tot
    cdef bint ok
    cdef int k
    cdef long long in_msgs = 0, in_bytes = 0
    cdef PyObject* found
    cdef Delivery m
    PyObject_GetBuffer(chunk, &view, PyBUF_SIMPLE)
    try:
        p = <const unsigned char*>view.buf
        n = view.len
        while pos < n:
            end = _crlf(p, pos, n)
            if end < 0:
                break  # a control line not complete yet
            frame_end = end + 2
            if end - pos >= 5 and memcmp(p + pos, b"HMSG ", 5) == 0:
                k = _args(p, pos + 5, end, starts, ends)
                if k == 5 or k == 4:
                    sa = starts[0]
                    sl = ends[0] - sa
                    if k == 5:
                        ra = starts[2]
                        rl = ends[2] - ra
                    else:
                        ra = 0
                        rl = 0
                    if (
                        _plain(p, starts[1], ends[1], &sid)
                        and _plain(p, starts[k - 2], ends[k - 2], &hs)
                        and _plain(p, starts[k - 1], ends[k - 1], &tot)
                    ):
                        key = PyLong_FromLongLong(sid)
                        ok = hs <= tot
                    else:  # a number that is not plain digits: Python's int() reads it
                        slow = _hmsg_slow(PyBytes_FromStringAndSize(<const char*>p + pos + 5, end - pos - 5))
                        ok = slow is not None
                        if ok:
                            key, hs_o, tot_o = slow
                            if tot_o > n - end - 4:
                                break  # the payload not complete yet
                            hs = hs_o
                            tot = tot_o
                    if ok:
                        if tot > n - end - 4:
                            break  # the payload not complete yet
                        hsize = <Py_ssize_t>hs
                        total = <Py_ssize_t>tot
                        frame_end = end + 4 + total
                        found = PyDict_GetItem(table, key)
                        if found != NULL:
                            start = end + 2
                            route = <object>found
                            on_data = route[1]
                            if on_data is not None and hsize > 0 and not (
                                hsize > HDR_LINE and p[start + HDR_LINE] == 32
                            ):
                                in_msgs += 1
                                in_bytes += total - hsize
                                pos = frame_end
                                try:
                                    m = Delivery.__new__(Delivery)
                                    m.subject = _subject(p + sa, sl)
                                    m.reply = PyUnicode_DecodeUTF8(<const char*>p + ra, rl, NULL)
                                    m.data = PyBytes_FromStringAndSize(
                                        <const char*>p + start + hsize, total - hsize
                                    )
                                    m._raw = PyBytes_FromStringAndSize(<const char*>p + start, hsize)
                                    m.seqs = _seqs(p, ra, ra + rl)
                                    if type(on_data) is Inbox:
                                        (<Inbox>on_data)._take(m, hsize)
                                    else:
                                        on_data(m, hsize)  # no coroutine per message
                                except Exception:  # never into the read loop
                                    log.warning(
                                        "a message on %r could not be read; dropped",
                                        PyBytes_FromStringAndSize(<const char*>p + sa, sl),
                                        exc_info=True,
                                    )
                                continue
                            return pos, frame_end, (
                                key,
                                PyBytes_FromStringAndSize(<const char*>p + sa, sl),
                                PyBytes_FromStringAndSize(<const char*>p + ra, rl),
                                PyBytes_FromStringAndSize(<const char*>p + start + hsize, total - hsize),
                                PyBytes_FromStringAndSize(<const char*>p + start, hsize),
                            )
            elif end - pos >= 4 and memcmp(p + pos, b"MSG ", 4) == 0:
                k = _args(p, pos + 4, end, starts, ends)
                if (k == 3 or k == 4) and _plain(p, starts[k - 1], ends[k - 1], &tot):
                    frame_end = end + 4 + <Py_ssize_t>tot
                    if frame_end > n:
                        break
                elif (k == 3 or k == 4) and _digits_only(p, starts[k - 1], ends[k - 1]):
                    break  # a size of 19 digits or more: never complete
            return pos, frame_end, None
        return pos, -1, None
    finally:
        PyBuffer_Release(&view)
        if in_msgs:
            stats["in_msgs"] += in_msgs
            stats["in_bytes"] += in_bytes


