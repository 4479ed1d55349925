# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The LIST_RANGES result-vector reader and writer of rangelist.py compiled (optional: rangelist.py uses it
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
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

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


# ------------------------------------------------------------------------------------- writing
#
# rangelist.put_results's pure-Python writer, compiled: the same decisions in the same order
# (children first, fields in slot order, alignment, zero padding, vtables deduplicated through
# the builder's ``vtables`` dict), written backwards into one C buffer as the builder writes.

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.unicode cimport PyUnicode_AsUTF8AndSize

DEF KEY_MAX = 8  # entries of a vtable key: at most six slots, then the object size
DEF CACHED_VTABLES = 32


cdef struct _W:
    unsigned char* buf
    Py_ssize_t cap
    Py_ssize_t head  # the bytes written are buf[head:cap]
    Py_ssize_t off0  # the builder's offset when the block started
    bint wrote64


cdef struct _VKey:
    int n
    Py_ssize_t key[KEY_MAX]
    Py_ssize_t found


cdef struct _Cache:
    int n
    _VKey keys[CACHED_VTABLES]


cdef inline Py_ssize_t _off(_W* w) noexcept:
    return w.off0 + w.cap - w.head


cdef int _room(_W* w, Py_ssize_t n) except -1:
    cdef Py_ssize_t used, cap
    cdef unsigned char* grown
    if w.head >= n:
        return 0
    used = w.cap - w.head
    cap = w.cap * 2
    while cap - used < n:
        cap *= 2
    grown = <unsigned char*>PyMem_Realloc(w.buf, cap)
    if grown == NULL:
        raise MemoryError()
    memcpy(grown + cap - used, grown + w.head, used)  # realloc kept the bytes at the front
    w.buf, w.cap, w.head = grown, cap, cap - used
    return 0


cdef int _put(_W* w, const void* p, Py_ssize_t n) except -1:
    _room(w, n)
    w.head -= n
    memcpy(w.buf + w.head, p, n)
    return 0


cdef int _zeros(_W* w, Py_ssize_t n) except -1:
    cdef Py_ssize_t k
    _room(w, n)
    for k in range(n):
        w.head -= 1
        w.buf[w.head] = 0
    return 0


cdef int _put_u32(_W* w, uint32_t v) except -1:
    cdef unsigned char b[4]
    b[0] = v & 0xFF
    b[1] = (v >> 8) & 0xFF
    b[2] = (v >> 16) & 0xFF
    b[3] = (v >> 24) & 0xFF
    return _put(w, b, 4)


cdef int _put_u64(_W* w, uint64_t v) except -1:
    cdef unsigned char b[8]
    cdef int k
    for k in range(8):
        b[k] = (v >> (8 * k)) & 0xFF
    return _put(w, b, 8)


cdef Py_ssize_t _align(_W* w, int to) except -1:
    cdef Py_ssize_t pad = (-_off(w)) & (to - 1)
    if pad:
        _zeros(w, pad)
    return _off(w)


cdef Py_ssize_t _int64_slot(_W* w, int64_t v) except -1:
    _align(w, 8)
    _put_u64(w, <uint64_t>v)
    w.wrote64 = True
    return _off(w)


cdef Py_ssize_t _int32_slot(_W* w, int32_t v) except -1:
    _align(w, 4)
    _put_u32(w, <uint32_t>v)
    return _off(w)


cdef Py_ssize_t _uoffset_slot(_W* w, Py_ssize_t target) except -1:
    cdef Py_ssize_t off = _align(w, 4) + 4
    _put_u32(w, <uint32_t>(off - target))
    return off


cdef Py_ssize_t _vector_of(_W* w, Py_ssize_t* offsets, Py_ssize_t n) except -1:
    cdef Py_ssize_t pad = (-(_off(w) + 4 * n)) & 3
    cdef Py_ssize_t k
    if pad:
        _zeros(w, pad)
    for k in range(n - 1, -1, -1):
        _put_u32(w, <uint32_t>(_off(w) + 4 - offsets[k]))
    _put_u32(w, <uint32_t>n)
    return _off(w)


cdef Py_ssize_t _end(_W* w, dict vtables, _Cache* cache, Py_ssize_t* slots, int nslots,
                     Py_ssize_t object_end) except -1:
    """Builder.EndObject: the object's offset (its vtable written unless an equal one was)."""
    cdef Py_ssize_t obj = _align(w, 4) + 4
    cdef Py_ssize_t key[KEY_MAX]
    cdef int n = 0, i, c
    cdef bint trim = True
    cdef Py_ssize_t e, found = -1, size
    cdef unsigned char vt[2 * (KEY_MAX + 1)]
    for i in range(nslots - 1, -1, -1):
        e = slots[i]
        if e == 0:
            if trim:
                continue
        else:
            e = obj - e
            trim = False
        key[n] = e
        n += 1
    key[n] = obj - object_end
    n += 1
    for c in range(cache.n):
        if cache.keys[c].n == n and memcmp(cache.keys[c].key, key, n * sizeof(Py_ssize_t)) == 0:
            found = cache.keys[c].found
            break
    else:
        t = tuple([key[i] for i in range(n)])
        got = vtables.get(t)
        if got is not None:
            found = got
        else:
            size = 2 * (n + 1)
            _put_u32(w, <uint32_t>size)
            vt[0] = size & 0xFF
            vt[1] = size >> 8
            for i in range(n):  # the vtable holds the key reversed
                vt[2 + 2 * i] = key[n - 1 - i] & 0xFF
                vt[3 + 2 * i] = (key[n - 1 - i] >> 8) & 0xFF
            _put(w, vt, size)
            found = obj + size
            vtables[t] = found
        if cache.n < CACHED_VTABLES:
            cache.keys[cache.n].n = n
            memcpy(cache.keys[cache.n].key, key, n * sizeof(Py_ssize_t))
            cache.keys[cache.n].found = found
            cache.n += 1
        if got is None:
            return obj
    _put_u32(w, <uint32_t>(found - obj))
    return obj


cdef Py_ssize_t _data_node(_W* w, dict vtables, _Cache* cache, object node) except -1:
    cdef Py_ssize_t addr = 0, n = 0, start, pad
    cdef const char* p
    cdef Py_ssize_t slots[2]
    cdef int32_t node_id
    text = node.advertise_addr
    if text:
        p = PyUnicode_AsUTF8AndSize(text, &n)
        pad = (-(_off(w) + n + 1)) & 3
        if pad:
            _zeros(w, pad)
        _zeros(w, 1)
        _put(w, p, n)
        _put_u32(w, <uint32_t>n)
        addr = _off(w)
    start = _off(w)
    slots[0] = slots[1] = 0
    node_id = node.node_id
    if node_id != 0:
        slots[0] = _int32_slot(w, node_id)
    if addr:
        slots[1] = _uoffset_slot(w, addr)
    return _end(w, vtables, cache, slots, 2, start)


cdef Py_ssize_t _replica(_W* w, dict vtables, _Cache* cache, object rep) except -1:
    cdef Py_ssize_t node = 0, start
    cdef Py_ssize_t slots[2]
    cdef unsigned char one = 1
    data_node = rep.data_node
    if data_node is not None:
        node = _data_node(w, vtables, cache, data_node)
    start = _off(w)
    slots[0] = slots[1] = 0
    if node:
        slots[0] = _uoffset_slot(w, node)
    if rep.is_primary:
        _put(w, &one, 1)
        slots[1] = _off(w)
    return _end(w, vtables, cache, slots, 2, start)


cdef Py_ssize_t _range(_W* w, dict vtables, _Cache* cache, object r) except -1:
    cdef Py_ssize_t reps = 0, start, k, n
    cdef Py_ssize_t slots[6]
    cdef Py_ssize_t* offsets
    cdef int64_t v
    cdef int32_t idx
    replicas = r.replica_nodes
    if replicas:
        n = len(replicas)
        offsets = <Py_ssize_t*>PyMem_Malloc(n * sizeof(Py_ssize_t))
        if offsets == NULL:
            raise MemoryError()
        try:
            for k in range(n):
                offsets[k] = _replica(w, vtables, cache, replicas[k])
            reps = _vector_of(w, offsets, n)
        finally:
            PyMem_Free(offsets)
    start = _off(w)
    for k in range(6):
        slots[k] = 0
    v = r.stream_id
    if v != 0:
        slots[0] = _int64_slot(w, v)
    idx = r.range_index
    if idx != 0:
        slots[1] = _int32_slot(w, idx)
    v = r.start_offset
    if v != 0:
        slots[2] = _int64_slot(w, v)
    v = r.next_offset
    if v != 0:
        slots[3] = _int64_slot(w, v)
    v = r.end_offset
    if v != -1:
        slots[4] = _int64_slot(w, v)
    if reps:
        slots[5] = _uoffset_slot(w, reps)
    return _end(w, vtables, cache, slots, 6, start)


def write_results(object items, Py_ssize_t off0, dict vtables):
    """The block ``put_results`` writes for ``items`` (every status OK) at builder offset
    ``off0``: (its bytes, the vector's offset, whether an int64 field was written)."""
    cdef _W w
    cdef _Cache cache
    cdef Py_ssize_t n = len(items), i, j, nr, ranges, start
    cdef Py_ssize_t* results
    cdef Py_ssize_t* offsets
    cdef Py_ssize_t slots[3]
    cdef Py_ssize_t end
    cdef int64_t sid
    cache.n = 0
    w.cap = 1 << 16
    w.head = w.cap
    w.off0 = off0
    w.wrote64 = False
    w.buf = <unsigned char*>PyMem_Malloc(w.cap)
    results = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    if w.buf == NULL or results == NULL:
        PyMem_Free(w.buf)
        PyMem_Free(results)
        raise MemoryError()
    try:
        for i in range(n):
            it = items[i]
            ranges = 0
            rs = it.ranges
            if rs:
                nr = len(rs)
                offsets = <Py_ssize_t*>PyMem_Malloc(nr * sizeof(Py_ssize_t))
                if offsets == NULL:
                    raise MemoryError()
                try:
                    for j in range(nr):
                        offsets[j] = _range(&w, vtables, &cache, rs[j])
                    ranges = _vector_of(&w, offsets, nr)
                finally:
                    PyMem_Free(offsets)
            start = _off(&w)
            slots[0] = slots[1] = slots[2] = 0
            sid = it.stream_id
            if sid != 0:
                slots[0] = _int64_slot(&w, sid)
            if ranges:
                slots[2] = _uoffset_slot(&w, ranges)
            results[i] = _end(&w, vtables, &cache, slots, 3, start)
        end = _vector_of(&w, results, n)
        block = PyBytes_FromStringAndSize(<char*>w.buf + w.head, w.cap - w.head)
        return block, end, w.wrote64
    finally:
        PyMem_Free(results)
        PyMem_Free(w.buf)
