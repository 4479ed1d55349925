# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The LIST_RANGES result-vector reader of rangelist.py compiled (optional: rangelist.py uses it
when it is built and falls back to its own pure-Python reader otherwise, or with
SBPSTREAM_PURE_PYTHON=1).

``read_results`` gives what ``rangelist.ResultsReader.read`` gives for a buffer; on any
malformation (a read out of bounds, a vector too long, bad UTF-8, a status that does not decode)
it returns None and the caller reads the vector again in Python, which raises the exact error.
Objects are made as the pure reader makes them: ``object.__new__`` and each slot set through the
type's descriptor (``PyObject_GenericSetAttr``, what ``object.__setattr__`` does). They are
then untracked by the cyclic garbage collector: frozen values of ints, strings and tuples of
such values cannot be part of a cycle, and a node's listing is a million of them, which the
collector would otherwise traverse again and again while they are made (three quarters of the
time, measured). No I/O.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.long cimport PyLong_FromLong, PyLong_FromLongLong
from cpython.object cimport PyObject_GenericSetAttr
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF, PyObject
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t
from libc.string cimport memcpy

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)

cdef object _new = object.__new__
cdef str _STREAM_ID = "stream_id"
cdef str _STATUS = "status"
cdef str _RANGES = "ranges"
cdef str _RANGE_INDEX = "range_index"
cdef str _START = "start_offset"
cdef str _NEXT = "next_offset"
cdef str _END = "end_offset"
cdef str _REPLICAS = "replica_nodes"
cdef str _DATA_NODE = "data_node"
cdef str _PRIMARY = "is_primary"
cdef str _NODE_ID = "node_id"
cdef str _ADDR = "advertise_addr"

DEF MAX_REPLICAS = 64  # a replica set longer than this is read by the pure reader


cdef inline bint _u32(const unsigned char* b, Py_ssize_t size, Py_ssize_t pos,
                      uint32_t* out) noexcept:
    if pos < 0 or pos + 4 > size:
        return False
    memcpy(out, b + pos, 4)
    return True


cdef inline bint _i32(const unsigned char* b, Py_ssize_t size, Py_ssize_t pos,
                      int32_t* out) noexcept:
    if pos < 0 or pos + 4 > size:
        return False
    memcpy(out, b + pos, 4)
    return True


cdef inline bint _i64(const unsigned char* b, Py_ssize_t size, Py_ssize_t pos,
                      int64_t* out) noexcept:
    if pos < 0 or pos + 8 > size:
        return False
    memcpy(out, b + pos, 8)
    return True


cdef bint _slots(const unsigned char* b, Py_ssize_t size, Py_ssize_t pos, int count,
                 uint16_t* out) noexcept:
    """The ``count`` slot offsets of the table at ``pos`` (0 = absent), as fbtable reads them."""
    cdef int32_t soff
    cdef uint16_t vsize, e
    cdef Py_ssize_t vt
    cdef int n, k
    if not _i32(b, size, pos, &soff):
        return False
    vt = pos - soff
    if vt < 0 or vt + 2 > size:
        return False
    memcpy(&vsize, b + vt, 2)
    n = (<int>vsize - 4) >> 1
    if n > count:
        n = count
    if n > 0 and vt + 4 + 2 * n > size:
        return False
    for k in range(count):
        if k < n:
            memcpy(&e, b + vt + 4 + 2 * k, 2)
            out[k] = e
        else:
            out[k] = 0
    return True


cdef bint _vector(const unsigned char* b, Py_ssize_t size, Py_ssize_t at,
                  Py_ssize_t* first, Py_ssize_t* n) noexcept:
    """The positions of a table vector's uoffsets: ``first``, ``n`` of them (4 bytes apart)."""
    cdef uint32_t rel, count
    cdef Py_ssize_t start
    if not _u32(b, size, at, &rel):
        return False
    start = at + rel
    if not _u32(b, size, start, &count):
        return False
    if <Py_ssize_t>count * 4 > size:
        return False
    first[0] = start + 4
    n[0] = count
    return True


cdef inline bint _table(const unsigned char* b, Py_ssize_t size, Py_ssize_t e,
                        Py_ssize_t* pos) noexcept:
    cdef uint32_t rel
    if not _u32(b, size, e, &rel):
        return False
    pos[0] = e + rel
    return True


def read_results(const unsigned char[::1] data, Py_ssize_t at, object result_cls,
                 object range_cls, object replica_cls, object node_cls, object default_node,
                 object read_status, object buf, object ok):
    """The vector of ListRangesResult whose uoffset is at ``at``, or None (malformed)."""
    cdef const unsigned char* b = &data[0] if data.shape[0] else NULL
    cdef Py_ssize_t size = data.shape[0]
    cdef Py_ssize_t first, n, i, rfirst, rn, j, pfirst, pn, k
    cdef Py_ssize_t pos, rp, pp, npos, spos
    cdef uint16_t so[3]
    cdef uint16_t ro[6]
    cdef uint16_t po[2]
    cdef uint16_t no[2]
    cdef int64_t sid, rsid, start, nxt, end
    cdef int32_t idx, node_id
    cdef uint32_t rel, alen
    cdef bint primary
    cdef unsigned char keybuf[MAX_REPLICAS * 10]
    cdef Py_ssize_t keylen
    cdef const unsigned char* addrs[MAX_REPLICAS]
    cdef uint32_t alens[MAX_REPLICAS]
    cdef dict sets = {}
    cdef object out, ranges, item, reps, key, status, node, rep
    cdef bytes last_key = None
    cdef object last_reps = None
    if size == 0 or not _vector(b, size, at, &first, &n):
        return None
    out = PyTuple_New(n)
    for i in range(n):
        if not _table(b, size, first + 4 * i, &pos) or not _slots(b, size, pos, 3, so):
            return None
        sid = 0
        if so[0] and not _i64(b, size, pos + so[0], &sid):
            return None
        status = ok
        if so[1]:
            if not _u32(b, size, pos + so[1], &rel):
                return None
            try:
                status = read_status(buf, pos + so[1] + rel)
            except Exception:
                return None
        ranges = ()
        if so[2]:
            if not _vector(b, size, pos + so[2], &rfirst, &rn):
                return None
            ranges = PyTuple_New(rn)
            for j in range(rn):
                if not _table(b, size, rfirst + 4 * j, &rp) or not _slots(b, size, rp, 6, ro):
                    return None
                rsid = 0
                idx = 0
                start = nxt = 0
                end = -1
                if ro[0] and not _i64(b, size, rp + ro[0], &rsid):
                    return None
                if ro[1] and not _i32(b, size, rp + ro[1], &idx):
                    return None
                if ro[2] and not _i64(b, size, rp + ro[2], &start):
                    return None
                if ro[3] and not _i64(b, size, rp + ro[3], &nxt):
                    return None
                if ro[4] and not _i64(b, size, rp + ro[4], &end):
                    return None
                reps = ()
                if ro[5]:
                    if not _vector(b, size, rp + ro[5], &pfirst, &pn) or pn > MAX_REPLICAS:
                        return None
                    keylen = 0
                    for k in range(pn):
                        if (not _table(b, size, pfirst + 4 * k, &pp)
                                or not _slots(b, size, pp, 2, po)):
                            return None
                        primary = False
                        if po[1]:
                            if pp + po[1] >= size:
                                return None
                            primary = b[pp + po[1]] != 0
                        node_id = 0
                        alen = 0
                        addrs[k] = NULL
                        keybuf[keylen] = (2 if po[0] else 0) | (1 if primary else 0)
                        if po[0]:
                            if not _u32(b, size, pp + po[0], &rel):
                                return None
                            npos = pp + po[0] + rel
                            if not _slots(b, size, npos, 2, no):
                                return None
                            if no[0] and not _i32(b, size, npos + no[0], &node_id):
                                return None
                            if no[1]:
                                if not _u32(b, size, npos + no[1], &rel):
                                    return None
                                spos = npos + no[1] + rel
                                if not _u32(b, size, spos, &alen) or spos + 4 + alen > size:
                                    return None
                                addrs[k] = b + spos + 4
                        alens[k] = alen
                        memcpy(keybuf + keylen + 1, &node_id, 4)
                        memcpy(keybuf + keylen + 5, &alen, 4)
                        keylen += 9
                    # the key: per replica its flags, node id and address length, then the
                    # addresses
                    key = PyBytes_FromStringAndSize(<char*>keybuf, keylen)
                    for k in range(pn):
                        if alens[k]:
                            key += PyBytes_FromStringAndSize(<char*>addrs[k], alens[k])
                    if last_key is not None and key == last_key:
                        reps = last_reps
                    else:
                        reps = sets.get(key)
                        if reps is None:
                            reps = PyTuple_New(pn)
                            for k in range(pn):
                                flags = keybuf[9 * k]
                                if flags & 2:
                                    memcpy(&node_id, keybuf + 9 * k + 1, 4)
                                    node = _new(node_cls)
                                    PyObject_GenericSetAttr(node, _NODE_ID, PyLong_FromLong(node_id))
                                    try:
                                        addr = (PyUnicode_DecodeUTF8(<char*>addrs[k], alens[k], NULL)
                                                if alens[k] else "")
                                    except UnicodeDecodeError:
                                        return None
                                    PyObject_GenericSetAttr(node, _ADDR, addr)
                                    PyObject_GC_UnTrack(<void*>node)
                                else:
                                    node = default_node
                                rep = _new(replica_cls)
                                PyObject_GenericSetAttr(rep, _DATA_NODE, node)
                                PyObject_GenericSetAttr(rep, _PRIMARY, bool(flags & 1))
                                PyObject_GC_UnTrack(<void*>rep)
                                Py_INCREF(rep)
                                PyTuple_SET_ITEM(reps, k, rep)
                            sets[key] = reps
                        last_key, last_reps = key, reps
                item = _new(range_cls)
                PyObject_GenericSetAttr(item, _STREAM_ID, PyLong_FromLongLong(rsid))
                PyObject_GenericSetAttr(item, _RANGE_INDEX, PyLong_FromLong(idx))
                PyObject_GenericSetAttr(item, _START, PyLong_FromLongLong(start))
                PyObject_GenericSetAttr(item, _NEXT, PyLong_FromLongLong(nxt))
                PyObject_GenericSetAttr(item, _END, PyLong_FromLongLong(end))
                PyObject_GenericSetAttr(item, _REPLICAS, reps)
                PyObject_GC_UnTrack(<void*>item)
                Py_INCREF(item)
                PyTuple_SET_ITEM(ranges, j, item)
        item = _new(result_cls)
        PyObject_GenericSetAttr(item, _STREAM_ID, PyLong_FromLongLong(sid))
        PyObject_GenericSetAttr(item, _STATUS, status)
        PyObject_GenericSetAttr(item, _RANGES, ranges)
        PyObject_GC_UnTrack(<void*>item)
        Py_INCREF(item)
        PyTuple_SET_ITEM(out, i, item)
    return out
