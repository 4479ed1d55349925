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
from libc.stdint cimport INT64_MAX, INT64_MIN, int32_t, int64_t, uint64_t


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


cdef inline void _set_item(object t, Py_ssize_t i, object v):
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


# --- columns in Arrow layout (the Spark source's path: no Python object per record) ---

from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

DEF INT32_MAX = 0x7FFFFFFF


cdef struct _Buf:
    char* p
    Py_ssize_t n
    Py_ssize_t cap


cdef int _reserve(_Buf* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t cap
    cdef char* p
    if b.n + extra <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 4096
    while cap < b.n + extra:
        cap *= 2
    p = <char*>realloc(b.p, cap)
    if p == NULL:
        raise MemoryError()
    b.p = p
    b.cap = cap
    return 0


cdef inline bytes _take(_Buf* b):
    return PyBytes_FromStringAndSize(b.p, b.n)


def _ts_error(offset, timestamp_ms):
    return (f"record at offset {offset} has timestamp_ms {timestamp_ms}, outside what an int64 "
            "timestamp at this scale (a Spark timestamp: microseconds) holds")


cdef class ColumnSink:
    """Growable little-endian Arrow buffers for offsets, timestamps (ms times ``ts_scale``),
    keys and values (int32 offsets, data, validity bitmap), filled section by section by
    ``add_section``. Records with headers (rare) are kept aside as (row, headers) pairs."""

    cdef _Buf _offsets, _stamps, _koffs, _kdata, _kvalid, _voffs, _vdata, _vvalid
    cdef readonly Py_ssize_t rows, key_nulls, value_nulls
    cdef readonly list headers
    cdef int64_t _scale, _ts_lo, _ts_hi  # timestamps (ms) whose scaled value fits int64

    def __cinit__(self, int64_t ts_scale=1):
        if ts_scale <= 0:
            raise ValueError(f"ts_scale must be positive, got {ts_scale}")
        self._scale = ts_scale
        self._ts_hi = INT64_MAX // ts_scale
        self._ts_lo = -(INT64_MAX // ts_scale)
        self.headers = []
        _reserve(&self._koffs, 4)
        _reserve(&self._voffs, 4)
        (<int32_t*>self._koffs.p)[0] = 0
        (<int32_t*>self._voffs.p)[0] = 0
        self._koffs.n = 4
        self._voffs.n = 4

    def __dealloc__(self):
        free(self._offsets.p)
        free(self._stamps.p)
        free(self._koffs.p)
        free(self._kdata.p)
        free(self._kvalid.p)
        free(self._voffs.p)
        free(self._vdata.p)
        free(self._vvalid.p)

    def add_section(self, bytes data, Py_ssize_t count, int64_t base_offset, int64_t first_ts,
                    int64_t lo, int64_t hi, object decode_headers):
        """Append the records of one ``bytes`` records section whose offsets lie in [lo, hi)
        (all of them are checked). False, with nothing appended, when it is malformed: the
        caller decodes it again in Python for the exact BatchError."""
        cdef const unsigned char* buf = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t end = PyBytes_GET_SIZE(data)
        cdef Py_ssize_t pos = 0, rec_end, index, kpos, vpos, row
        cdef int64_t length, delta, kn, vn, off
        cdef Py_ssize_t saved[8]
        cdef Py_ssize_t saved_rows = self.rows, saved_kn = self.key_nulls
        cdef Py_ssize_t saved_vn = self.value_nulls, saved_h = len(self.headers)
        cdef _Buf* bufs[8]
        cdef int i
        cdef bint keep
        cdef unsigned char bit
        bufs[0] = &self._offsets; bufs[1] = &self._stamps; bufs[2] = &self._koffs
        bufs[3] = &self._kdata; bufs[4] = &self._kvalid; bufs[5] = &self._voffs
        bufs[6] = &self._vdata; bufs[7] = &self._vvalid
        for i in range(8):
            saved[i] = bufs[i].n
        if self._kdata.n + end > INT32_MAX or self._vdata.n + end > INT32_MAX:
            raise OverflowError("more than 2 GiB of keys or values in one Arrow batch")
        # upper bounds for this section: no reallocation inside the loop
        _reserve(&self._offsets, 8 * count)
        _reserve(&self._stamps, 8 * count)
        _reserve(&self._koffs, 4 * count)
        _reserve(&self._voffs, 4 * count)
        _reserve(&self._kdata, end)
        _reserve(&self._vdata, end)
        _reserve(&self._kvalid, count // 8 + 2)
        _reserve(&self._vvalid, count // 8 + 2)
        for index in range(count):
            if _varint(buf, end, &pos, &length) < 0:
                break
            if length < MIN_BODY or length > end - pos:
                break
            rec_end = pos + length
            if _varint(buf, end, &pos, &delta) < 0 or _varint(buf, end, &pos, &kn) < 0:
                break
            if 0 <= kn <= rec_end - pos:
                kpos = pos
                pos += kn
            elif kn == -1:
                kpos = -1
                kn = 0
            else:
                break
            if _varint(buf, end, &pos, &vn) < 0:
                break
            if 0 <= vn <= rec_end - pos:
                vpos = pos
                pos += vn
            elif vn == -1:
                vpos = -1
                vn = 0
            else:
                break
            if pos >= end:
                break
            off = base_offset + index
            keep = lo <= off < hi
            row = self.rows
            if buf[pos] == 0:
                pos += 1
            else:
                hdrs, pos = decode_headers(data, pos, rec_end)
                if keep:
                    self.headers.append((row, hdrs))
            if pos != rec_end:
                break
            if not keep:
                continue
            (<int64_t*>(self._offsets.p + self._offsets.n))[0] = off
            self._offsets.n += 8
            if ((delta > 0 and first_ts > INT64_MAX - delta)
                    or (delta < 0 and first_ts < INT64_MIN - delta)
                    or not self._ts_lo <= first_ts + delta <= self._ts_hi):
                raise OverflowError(_ts_error(off, first_ts + <object>delta))
            (<int64_t*>(self._stamps.p + self._stamps.n))[0] = (first_ts + delta) * self._scale
            self._stamps.n += 8
            if row % 8 == 0:
                self._kvalid.p[self._kvalid.n] = 0
                self._vvalid.p[self._vvalid.n] = 0
                self._kvalid.n += 1
                self._vvalid.n += 1
            bit = <unsigned char>(1 << (row % 8))
            if kpos >= 0:
                memcpy(self._kdata.p + self._kdata.n, buf + kpos, kn)
                self._kdata.n += kn
                self._kvalid.p[self._kvalid.n - 1] |= bit
            else:
                self.key_nulls += 1
            (<int32_t*>(self._koffs.p + self._koffs.n))[0] = <int32_t>self._kdata.n
            self._koffs.n += 4
            if vpos >= 0:
                memcpy(self._vdata.p + self._vdata.n, buf + vpos, vn)
                self._vdata.n += vn
                self._vvalid.p[self._vvalid.n - 1] |= bit
            else:
                self.value_nulls += 1
            (<int32_t*>(self._voffs.p + self._voffs.n))[0] = <int32_t>self._vdata.n
            self._voffs.n += 4
            self.rows = row + 1
        else:
            if pos == end:
                return True
        for i in range(8):  # malformed: roll back to where this section began
            bufs[i].n = saved[i]
        self.rows = saved_rows
        self.key_nulls = saved_kn
        self.value_nulls = saved_vn
        del self.headers[saved_h:]
        return False

    def buffers(self):
        """(offsets, timestamps, key_offsets, key_data, key_validity, value_offsets, value_data,
        value_validity) as ``bytes``."""
        return (_take(&self._offsets), _take(&self._stamps), _take(&self._koffs),
                _take(&self._kdata), _take(&self._kvalid), _take(&self._voffs),
                _take(&self._vdata), _take(&self._vvalid))


# --- records encoded from Arrow-layout columns (the Spark sink's path) ---

from libc.stdlib cimport malloc
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer

DEF HEADER_BYTES = 61  # header.HEADER_SIZE


cdef inline int _vlen(int64_t v) noexcept:
    """Bytes of the zigzag varint of v."""
    cdef uint64_t zz = (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)
    cdef int n = 1
    while zz >= 0x80:
        zz >>= 7
        n += 1
    return n


cdef inline Py_ssize_t _put(char* out, int64_t v) noexcept:
    cdef uint64_t zz = (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)
    cdef Py_ssize_t n = 0
    while zz >= 0x80:
        out[n] = <char>((zz & 0x7F) | 0x80)
        zz >>= 7
        n += 1
    out[n] = <char>zz
    return n + 1


cdef class _View:
    """A held buffer (released on collection): a column's offsets, data or validity."""
    cdef Py_buffer view
    cdef bint held
    cdef const unsigned char* p

    def __cinit__(self, object obj):
        self.held = False
        self.p = NULL
        if obj is not None:
            PyObject_GetBuffer(obj, &self.view, PyBUF_SIMPLE)
            self.held = True
            self.p = <const unsigned char*>self.view.buf

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


cdef inline bint _valid(const unsigned char* bitmap, Py_ssize_t i) noexcept:
    return bitmap == NULL or (bitmap[i >> 3] >> (i & 7)) & 1


def encode_rows(tuple values, object keys, object stamps, int64_t default_ts, Py_ssize_t start,
                Py_ssize_t stop, Py_ssize_t room, Py_ssize_t max_count, int64_t first_ts,
                bint has_first):
    """Encode rows [start, stop) as records (no headers) while they fit in ``room`` bytes and
    ``max_count`` records: the bytes ``BatchBuilder.add`` makes for each. ``values`` and
    ``keys`` (or None) are Arrow binary columns ``(int32 offsets, data, validity or None,
    array offset)``; ``stamps`` (or None) ``(int64 values, validity or None, array offset,
    divisor)``: timestamp_ms = floor(value / divisor), ``default_ts`` when null or absent. Deltas
    are from ``first_ts`` when ``has_first`` (the batch is not empty), else from the first row's.
    Returns (records bytes, rows encoded, first_ts, max_ts); ValueError on a negative
    timestamp."""
    cdef _View vo = _View(values[0]), vd = _View(values[1]), vv = _View(values[2])
    cdef Py_ssize_t voff = values[3]
    cdef _View ko = _View(None), kd = _View(None), kv = _View(None)
    cdef Py_ssize_t koff = 0
    cdef bint has_keys = keys is not None
    cdef _View tv = _View(None), tn = _View(None)
    cdef Py_ssize_t toff = 0
    cdef int64_t div = 1, raw, ts, max_ts = -1, delta
    cdef bint has_stamps = stamps is not None
    if has_keys:
        ko = _View(keys[0]); kd = _View(keys[1]); kv = _View(keys[2]); koff = keys[3]
    if has_stamps:
        tv = _View(stamps[0]); tn = _View(stamps[1]); toff = stamps[2]; div = stamps[3]
    cdef const int32_t* vofs = <const int32_t*>vo.p
    cdef const int32_t* kofs = <const int32_t*>ko.p
    cdef const int64_t* tvals = <const int64_t*>tv.p
    cdef Py_ssize_t cap = room if room > 0 else 0
    cdef char* out = <char*>malloc(cap + 1)
    cdef Py_ssize_t used = 0, i = start, n, body, rec
    cdef int64_t klen, vlen
    cdef Py_ssize_t kstart = 0, vstart = 0
    if out == NULL:
        raise MemoryError()
    try:
        while i < stop and i - start < max_count:
            if has_stamps and _valid(tn.p, i + toff):
                raw = tvals[i + toff]
                ts = raw // div
                if raw % div != 0 and raw < 0:
                    ts -= 1  # floor, as Python's //
            else:
                ts = default_ts
            if ts < 0:
                raise ValueError(f"timestamp_ms {ts} not in [0, 2**63)")
            if not has_first:
                first_ts = ts
            delta = ts - first_ts
            if _valid(vv.p, i + voff):
                vstart = vofs[i + voff]
                vlen = vofs[i + voff + 1] - vstart
            else:
                vlen = -1
            if has_keys and _valid(kv.p, i + koff):
                kstart = kofs[i + koff]
                klen = kofs[i + koff + 1] - kstart
            else:
                klen = -1
            body = (_vlen(delta) + _vlen(klen) + (klen if klen > 0 else 0) + _vlen(vlen)
                    + (vlen if vlen > 0 else 0) + 1)
            rec = _vlen(body) + body
            if used + rec > cap:
                break
            has_first = True
            used += _put(out + used, body)
            used += _put(out + used, delta)
            used += _put(out + used, klen)
            if klen > 0:
                memcpy(out + used, kd.p + kstart, klen)
                used += klen
            used += _put(out + used, vlen)
            if vlen > 0:
                memcpy(out + used, vd.p + vstart, vlen)
                used += vlen
            out[used] = 0
            used += 1
            if ts > max_ts:
                max_ts = ts
            i += 1
        return PyBytes_FromStringAndSize(out, used), i - start, first_ts, max_ts
    finally:
        free(out)
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
        _set_item(rec, 0, stream_id)
        _set_item(rec, 1, PyLong_FromLongLong(base64 + index))
        _set_item(rec, 2, ts)
        _set_item(rec, 3, key)
        _set_item(rec, 4, value)
        _set_item(rec, 5, headers)
        if untrack and not headers:
            PyObject_GC_UnTrack(rec)  # atomic contents: no cycle (see decode_section)
        out.append(rec)
    if pos != end:
        return None
    return out
