# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The record loops of the Kafka gateway compiled (optional: sbpstream/kafka/records.py uses them
when built and its own pure-Python loops otherwise, or with SBPSTREAM_PURE_PYTHON=1).

A Kafka v2 record is an sbpstream record plus an attributes byte and an offset delta (both
formats: length varint, then the timestamp delta, key, value and headers encoded alike), so
neither direction decodes a record into objects: each record is copied behind a new length,
without (Produce) or with (Fetch) those two fields.

``kafka_to_sbp`` returns None for anything it does not take whole (malformed, a first timestamp
delta other than 0, a null header value, a timestamp out of range): the caller then decodes the
records in Python, which raises the exact error or converts the record the slow way. No I/O.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport INT64_MAX, int64_t, uint64_t
from libc.string cimport memcpy

DEF MAX_VARINT_BYTES = 10
DEF KAFKA_EXTRA = 7  # attributes byte + offset delta (int32: 5 bytes) + a longer length varint


cdef inline int _varint(const unsigned char* buf, Py_ssize_t end, Py_ssize_t* pos,
                        int64_t* out) noexcept:
    """Zigzag varint at pos[0] (int64, at most 10 bytes): 0 and the value, or -1 when it is
    truncated, too long or overflows (records._speedups' decoder)."""
    cdef uint64_t zz = 0
    cdef int shift = 0
    cdef Py_ssize_t p = pos[0]
    cdef Py_ssize_t lim = p + MAX_VARINT_BYTES
    cdef unsigned char b
    if lim > end:
        lim = end
    while p < lim:
        b = buf[p]
        p += 1
        if shift == 63 and b > 1:
            return -1
        zz |= (<uint64_t>(b & 0x7F)) << shift
        if b < 0x80:
            out[0] = <int64_t>((zz >> 1) ^ (<uint64_t>0 - (zz & 1)))
            pos[0] = p
            return 0
        shift += 7
    return -1


cdef inline Py_ssize_t _put_varint(unsigned char* out, int64_t v) noexcept:
    """Write zigzag varint ``v`` at ``out``; the bytes written."""
    cdef uint64_t zz = (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)
    cdef Py_ssize_t n = 0
    while zz >= 0x80:
        out[n] = <unsigned char>((zz & 0x7F) | 0x80)
        zz >>= 7
        n += 1
    out[n] = <unsigned char>zz
    return n + 1


def kafka_to_sbp(const unsigned char[::1] section, Py_ssize_t count, int64_t base_ts):
    """(sbpstream records section, max timestamp) of a Kafka records section of ``count``
    records whose timestamps are ``base_ts`` + delta, or None (see the module's docstring)."""
    cdef const unsigned char* buf = &section[0] if section.shape[0] else NULL
    cdef Py_ssize_t end = section.shape[0]
    cdef Py_ssize_t pos = 0, rec_end, ts_start, ts_end, body, w = 0, i, h
    cdef int64_t length, ts_delta, od, kn, vn, hn, nn, ts, max_ts = base_ts
    cdef bytes out
    cdef unsigned char* o
    if end == 0 or count <= 0:
        return None
    out = PyBytes_FromStringAndSize(NULL, end)  # an sbpstream record is shorter
    o = <unsigned char*>PyBytes_AS_STRING(out)
    for i in range(count):
        if _varint(buf, end, &pos, &length) or length < 6 or length > end - pos:
            return None
        rec_end = pos + length
        pos += 1  # attributes
        ts_start = pos
        if _varint(buf, rec_end, &pos, &ts_delta):
            return None
        ts_end = pos
        if _varint(buf, rec_end, &pos, &od):
            return None
        body = pos
        if i == 0 and ts_delta != 0:
            return None
        if ts_delta > INT64_MAX - base_ts:
            return None
        ts = base_ts + ts_delta
        if ts < 0:
            return None
        if ts > max_ts:
            max_ts = ts
        if _varint(buf, rec_end, &pos, &kn) or kn < -1 or kn > rec_end - pos:
            return None
        if kn > 0:
            pos += kn
        if _varint(buf, rec_end, &pos, &vn) or vn < -1 or vn > rec_end - pos:
            return None
        if vn > 0:
            pos += vn
        if _varint(buf, rec_end, &pos, &hn) or hn < 0 or hn > (rec_end - pos) // 2:
            return None
        for h in range(hn):
            if _varint(buf, rec_end, &pos, &nn) or nn < 0 or nn > rec_end - pos:
                return None
            try:
                PyUnicode_DecodeUTF8(<const char*>buf + pos, nn, NULL)
            except UnicodeDecodeError:
                return None
            pos += nn
            if _varint(buf, rec_end, &pos, &nn) or nn < 0 or nn > rec_end - pos:
                return None  # a null header value (-1) is converted the slow way
            pos += nn
        if pos != rec_end:
            return None
        length = (ts_end - ts_start) + (rec_end - body)
        w += _put_varint(o + w, length)
        memcpy(o + w, buf + ts_start, ts_end - ts_start)
        w += ts_end - ts_start
        memcpy(o + w, buf + body, rec_end - body)
        w += rec_end - body
    if pos != end:
        return None
    return out[:w], max_ts


def sbp_to_kafka_records(const unsigned char[::1] section, Py_ssize_t count, Py_ssize_t skip):
    """(Kafka records section, records) of an sbpstream records section of ``count`` records
    without its first ``skip``, or None when it is malformed (the caller's Python loop raises
    the error)."""
    cdef const unsigned char* buf = &section[0] if section.shape[0] else NULL
    cdef Py_ssize_t end = section.shape[0]
    cdef Py_ssize_t pos = 0, ts_start, rec_end, w = 0, i
    cdef int64_t length, ts_delta, od
    cdef bytes out
    cdef unsigned char* o
    if count <= skip or end == 0:
        return None
    out = PyBytes_FromStringAndSize(NULL, end + KAFKA_EXTRA * (count - skip))
    o = <unsigned char*>PyBytes_AS_STRING(out)
    for i in range(count):
        if _varint(buf, end, &pos, &length) or length < 1 or length > end - pos:
            return None
        rec_end = pos + length
        if i >= skip:
            ts_start = pos
            if _varint(buf, rec_end, &pos, &ts_delta):
                return None
            od = i - skip
            # length: attributes + offset delta + the sbpstream record
            w += _put_varint(o + w, length + 1 + _vlen(od))
            o[w] = 0
            w += 1
            memcpy(o + w, buf + ts_start, pos - ts_start)
            w += pos - ts_start
            w += _put_varint(o + w, od)
            memcpy(o + w, buf + pos, rec_end - pos)
            w += rec_end - pos
        pos = rec_end
    if pos != end:
        return None
    return out[:w], count - skip


cdef inline Py_ssize_t _vlen(int64_t v) noexcept:
    cdef uint64_t zz = (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)
    cdef Py_ssize_t n = 1
    while zz >= 0x80:
        zz >>= 7
        n += 1
    return n
