# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The record-decode loop of reader.py compiled (optional: reader.py uses it when it is built and
falls back to its own pure-Python loop otherwise, or with SBPSTREAM_PURE_PYTHON=1).

``decode_section`` does what ``reader._decode_section`` does for a ``bytes`` records section,
returning a list; on any malformation it returns None and the caller decodes the section again in
Python, which raises the exact BatchError. Records with headers have them decoded by the Python
``decode_headers`` passed in (rare; it raises BatchError itself). No I/O.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_FromLongLong
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport INT64_MAX, INT64_MIN, int64_t, uint64_t


cdef extern from "Python.h":
    object PyType_GenericAlloc(type t, Py_ssize_t nitems)  # a tuple subclass's allocator
    void PyObject_GC_UnTrack(object o)

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


cdef inline void _put(object t, Py_ssize_t i, object v):
    Py_INCREF(v)  # PyTuple_SET_ITEM steals a reference
    PyTuple_SET_ITEM(t, i, v)


def decode_section(bytes data, Py_ssize_t count, object base_offset, object first_ts,
                   object cls, object stream_id, object decode_headers):
    """``count`` records of ``data`` as ``cls`` tuples (led by ``stream_id`` unless it is None),
    or None when the section is malformed.

    Led by a stream id, with ``cls`` a tuple or a tuple subclass (ConsumedRecord) and offsets
    and timestamps within int64, each record is allocated and filled here, its offset and
    timestamp computed in C (what ``tuple.__new__(cls, (...))`` gives, without the call, the
    argument tuple and the Python additions). A record without headers holds only ints, bytes,
    None and the empty tuple, so it can be in no reference cycle: unless ``cls`` instances have
    a ``__dict__``, it is untracked by the garbage collector at once (which CPython does to such
    tuples anyway at their first collection; until then the thousands buffered between two
    frames made every young collection walk them: ~0.3 us a record)."""
    cdef bint direct = (stream_id is not None and isinstance(cls, type) and issubclass(cls, tuple)
                        and INT64_MIN <= first_ts <= INT64_MAX
                        and 0 <= base_offset <= INT64_MAX - count)
    cdef bint exact = cls is tuple
    cdef int64_t base64 = base_offset if direct else 0
    cdef int64_t ts64 = first_ts if direct else 0
    if direct:
        return _decode_direct(data, count, base64, ts64, first_ts, cls, exact,
                              cls.__dictoffset__ == 0, stream_id, decode_headers)
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


cdef object _decode_direct(bytes data, Py_ssize_t count, int64_t base64, int64_t ts64,
                           object first_ts, type cls, bint exact, bint untrack,
                           object stream_id, object decode_headers):
    """decode_section's loop for records led by a stream id, built in place (see there)."""
    cdef const unsigned char* buf = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t rec_end
    cdef Py_ssize_t index
    cdef int64_t length, delta, n
    cdef list out = []
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
        if (delta > 0 and ts64 > INT64_MAX - delta) or (delta < 0 and ts64 < INT64_MIN - delta):
            ts = first_ts + delta  # beyond int64: as Python adds them
        else:
            ts = PyLong_FromLongLong(ts64 + delta)
        rec = PyTuple_New(6) if exact else PyType_GenericAlloc(cls, 6)
        _put(rec, 0, stream_id)
        _put(rec, 1, PyLong_FromLongLong(base64 + index))
        _put(rec, 2, ts)
        _put(rec, 3, key)
        _put(rec, 4, value)
        _put(rec, 5, headers)
        if untrack and not headers:
            PyObject_GC_UnTrack(rec)  # atomic contents: no cycle (see decode_section)
        out.append(rec)
    if pos != end:
        return None
    return out
