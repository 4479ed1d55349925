# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The record-decode loop of reader.py compiled (optional: reader.py uses it when it is built and
falls back to its own pure-Python loop otherwise, or with SBPSTREAM_PURE_PYTHON=1).

``decode_section`` does what ``reader._decode_section`` does for a ``bytes`` records section,
returning a list; on any malformation it returns None and the caller decodes the section again in
Python, which raises the exact BatchError. Records with headers have them decoded by the Python
``decode_headers`` passed in (rare; it raises BatchError itself). No I/O.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint64_t

# the smallest record body after its length: timestamp_delta, key_length, value_length,
# header_count, one byte each (reader.MIN_RECORD_BODY_BYTES)
DEF MIN_BODY = 4
DEF MAX_VARINT_BYTES = 10


cdef inline int _varint(const unsigned char* buf, Py_ssize_t end, Py_ssize_t* pos,
                        int64_t* out) noexcept:
    """Zigzag varint at pos[0] (int64, at most 10 bytes): 0 and the value, or -1 when it is
    truncated, too long or overflows."""
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


def decode_section(bytes data, Py_ssize_t count, object base_offset, object first_ts,
                   object cls, object stream_id, object decode_headers):
    """``count`` records of ``data`` as ``cls`` tuples (led by ``stream_id`` unless it is None),
    or None when the section is malformed."""
    cdef const unsigned char* buf = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t rec_end
    cdef Py_ssize_t index
    cdef int64_t length, delta, n
    cdef bint lead = stream_id is not None
    cdef list out = []
    new = tuple.__new__
    for index in range(count):
        if _varint(buf, end, &pos, &length) < 0:
            return None
        if length < MIN_BODY or length > end - pos:
            return None
        rec_end = pos + length
        if _varint(buf, end, &pos, &delta) < 0 or _varint(buf, end, &pos, &n) < 0:
            return None
        if 0 <= n <= rec_end - pos:
            key = PyBytes_FromStringAndSize(<const char*>buf + pos, n)
            pos += n
        elif n == -1:
            key = None
        else:
            return None
        if _varint(buf, end, &pos, &n) < 0:
            return None
        if 0 <= n <= rec_end - pos:
            value = PyBytes_FromStringAndSize(<const char*>buf + pos, n)
            pos += n
        elif n == -1:
            value = None
        else:
            return None
        if pos >= end:
            return None
        if buf[pos] == 0:
            headers = ()
            pos += 1
        else:
            headers, pos = decode_headers(data, pos, rec_end)
        if pos != rec_end:
            return None
        if lead:
            out.append(new(cls, (stream_id, base_offset + index, first_ts + delta, key, value,
                                 headers)))
        else:
            out.append(new(cls, (base_offset + index, first_ts + delta, key, value, headers)))
    if pos != end:
        return None
    return out
