/* Optional C helpers for the samplers: the compact store's packing and rebuilding (_store.py), and the
 * dealer of the unshuffled and the windowed paths (samplers.py).
 *
 * A whole-epoch shuffle stores this rank's share compactly and rebuilds each batch as a list when it is
 * yielded. In pure Python the cheapest conversions (array.fromlist, memoryview.tolist) cost more per index
 * than the user's sampler spends making it; here packing costs a few nanoseconds per index and rebuilding
 * is a plain int allocation. The pure-Python path in _store.py stays the reference: this module converts
 * only exact ints and exact lists or tuples of them, and hands anything else to the caller's Python
 * converter, so both paths store the same indices and raise the same errors. The dealer yields exactly
 * what its pure-Python counterparts in samplers.py yield, errors included.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* the layout of ints, which Python.h includes itself from 3.11 */
#endif
#include <stdint.h>
#include <string.h>

/* Buffers of int64 are read and written as Py_ssize_t (window permutations, dealt positions): a platform where
 * that is narrower fails the (optional) build here, and the package runs its pure-Python path instead. */
#if SIZEOF_SIZE_T != 8
#error "lightning_ddp_ext._compact needs a 64-bit Py_ssize_t"
#endif

/* Ask for a cache line ahead of use where the compiler offers it (not MSVC's C compiler): a hint only. */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif

/* Accept a C-contiguous buffer of native signed integers of 8 bytes (array('q'), numpy int64); `flags` may add
 * PyBUF_WRITABLE for a buffer that is written. */
static int
get_index_buffer(PyObject *obj, Py_buffer *view, const char *name, int flags)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | flags) < 0) {
        return -1;
    }
    const char *format = view->format == NULL ? "B" : view->format;
    if (format[0] == '@' || format[0] == '=') {
        format++;
    }
    if (view->itemsize != 8 || (strcmp(format, "q") != 0 && strcmp(format, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous buffer of int64, got format '%s' of %zd bytes", name,
                     view->format == NULL ? "B" : view->format, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The items of an exact list or tuple, or NULL (no exception set) for anything else. */
static PyObject **
sequence_items(PyObject *obj, Py_ssize_t *size)
{
    if (PyList_CheckExact(obj)) {
        *size = PyList_GET_SIZE(obj);
        return ((PyListObject *)obj)->ob_item;
    }
    if (PyTuple_CheckExact(obj)) {
        *size = PyTuple_GET_SIZE(obj);
        return ((PyTupleObject *)obj)->ob_item;
    }
    return NULL;
}

/* The value of an exact int, or -1 with *overflow set past the int64 range. Ints of one internal digit
 * (below 2**30 in magnitude: nearly every index) are read inline; PyLong_AsLongLongAndOverflow, a call
 * per index, takes the others (on exact ints it runs no Python code and cannot fail). */
static inline long long
exact_int_value(PyObject *value, int *overflow)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)value)) {
        *overflow = 0;
        return (long long)PyUnstable_Long_CompactValue((PyLongObject *)value);
    }
#else
    Py_ssize_t size = Py_SIZE(value);
    if (size >= -1 && size <= 1) {
        *overflow = 0;
        return (long long)size * (long long)((PyLongObject *)value)->ob_digit[0];
    }
#endif
    return PyLong_AsLongLongAndOverflow(value, overflow);
}

/* New lists of ints with the values of an int32 or an int64 array. */
#define DEFINE_LIST_OF(name, type)                                  \
    static PyObject *                                               \
    name(const type *values, Py_ssize_t size)                       \
    {                                                               \
        PyObject *list = PyList_New(size);                          \
        for (Py_ssize_t j = 0; list != NULL && j < size; j++) {     \
            PyObject *index = PyLong_FromLongLong(values[j]);       \
            if (index == NULL) {                                    \
                Py_CLEAR(list);                                     \
                break;                                              \
            }                                                       \
            PyList_SET_ITEM(list, j, index);                        \
        }                                                           \
        return list;                                                \
    }
DEFINE_LIST_OF(int32_list, int32_t)
DEFINE_LIST_OF(int64_list, long long)

/* Store(batched, convert, expected): the C half of _store.CompactStore. read() packs the indices of the items
 * it stores straight from the sampler's stream into one array, int32 while every index fits and int64 from
 * the first that does not, with the end of each item; lists() rebuilds items as new lists of ints. Nothing
 * is copied between reads, and expected (how many items will be stored) sizes the array from the first
 * items' lengths, so it is allocated about once and its pages are touched once. Items that are not exact
 * ints (or exact lists or tuples of them) go through convert(item), the pure-Python path, which returns
 * their indices as int64 bytes or raises the error users see. */
typedef struct {
    PyObject_HEAD
    PyObject *convert;
    int batched, wide;
    char *values;                     /* int32_t, or long long where wide */
    Py_ssize_t size, capacity;        /* in values */
    long long *ends;                  /* ends[i + 1]: where item i ends in values; ends[0] = 0 */
    Py_ssize_t items, ends_capacity;  /* items stored; entries of ends */
    Py_ssize_t expected;
} StoreObject;

/* A reservation grows the values to at most this many times what they need: the first items project the
 * epoch's size, but a sampler whose first batches are its longest (sorted by length) would project many times
 * the memory it needs, and an address-space limit (RLIMIT_AS) or the kernel's overcommit check refuses that. */
#define MAX_PROJECTED_GROWTH 16
/* ... or by this many values, if more: reserving ahead up to 64 MiB (of int32) costs only address space, and
 * saves a copy of the array at each growth below glibc's mmap threshold (a few percent of a 1e6-batch epoch). */
#define PROJECTION_ALLOWANCE ((Py_ssize_t)1 << 24)

/* Room for extra more values: as many as the items so far project for the expected items (at most
 * MAX_PROJECTED_GROWTH times what is needed now, or PROJECTION_ALLOWANCE more), else 1/8 more. */
static int
store_reserve(StoreObject *self, Py_ssize_t extra)
{
    if (extra <= self->capacity - self->size) {
        return 0;
    }
    if (extra > PY_SSIZE_T_MAX / 32 / MAX_PROJECTED_GROWTH - self->size) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t needed = self->size + extra, capacity = needed + needed / 8;
    if (self->items > 0 && self->items < self->expected) {
        double projected = (double)needed / (double)(self->items + 1) * (double)self->expected;
        double most = (double)needed * MAX_PROJECTED_GROWTH;
        if (most < (double)(needed + PROJECTION_ALLOWANCE)) {
            most = (double)(needed + PROJECTION_ALLOWANCE);
        }
        if (projected > (double)capacity) {
            capacity = (Py_ssize_t)(projected < most ? projected : most);
        }
    }
    /* Large blocks come from mmap, where growing remaps pages instead of copying them. */
    char *values = PyMem_Realloc(self->values, (size_t)capacity * (self->wide ? 8 : 4));
    if (values == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->values = values;
    self->capacity = capacity;
    return 0;
}

/* Hold the values as int64 from now on. */
static int
store_widen(StoreObject *self)
{
    long long *wide = PyMem_Malloc((size_t)(self->capacity > 0 ? self->capacity : 1) * 8);
    if (wide == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    const int32_t *narrow = (const int32_t *)self->values;
    for (Py_ssize_t i = 0; i < self->size; i++) {
        wide[i] = narrow[i];
    }
    PyMem_Free(self->values);
    self->values = (char *)wide;
    self->wide = 1;
    return 0;
}

/* Append the values of items[0:count] if all are exact ints in the int64 range and return 0; return 1 (nothing
 * appended, no exception set) for anything else, -1 on error. */
static int
store_pack(StoreObject *self, PyObject **items, Py_ssize_t count)
{
    if (store_reserve(self, count) < 0) {
        return -1;
    }
    int overflow;
    Py_ssize_t i = 0;
    if (!self->wide) {
        int32_t *out = (int32_t *)self->values + self->size;
        for (; i < count; i++) {
            if (!PyLong_CheckExact(items[i])) {
                return 1;
            }
            long long value = exact_int_value(items[i], &overflow);
            if (overflow) {
                return 1;
            }
            if (value < INT32_MIN || value > INT32_MAX) {
                break;
            }
            out[i] = (int32_t)value;
        }
        if (i == count) {
            self->size += count;
            return 0;
        }
        if (store_widen(self) < 0) {
            return -1;
        }
    }
    long long *out = (long long *)self->values + self->size;
    for (i = 0; i < count; i++) {
        if (!PyLong_CheckExact(items[i])) {
            return 1;
        }
        out[i] = exact_int_value(items[i], &overflow);
        if (overflow) {
            return 1;
        }
    }
    self->size += count;
    return 0;
}

/* Append the int64 values convert(item) returns. */
static int
store_converted(StoreObject *self, PyObject *item)
{
    if (self->convert == NULL) { /* cleared by the garbage collector (tp_clear) while something still reads */
        PyErr_SetString(PyExc_RuntimeError, "Store was cleared by the garbage collector");
        return -1;
    }
    PyObject *converted = PyObject_CallOneArg(self->convert, item);
    if (converted == NULL) {
        return -1;
    }
    /* A single index is one value: lists() reads the values of an unbatched store by item number. */
    if (!PyBytes_Check(converted) || PyBytes_GET_SIZE(converted) % 8 != 0
        || (!self->batched && PyBytes_GET_SIZE(converted) != 8)) {
        PyErr_SetString(PyExc_TypeError, "convert must return the item's indices as int64 bytes (8 bytes for an"
                        " unbatched store)");
        Py_DECREF(converted);
        return -1;
    }
    Py_ssize_t count = PyBytes_GET_SIZE(converted) / 8;
    const char *bytes = PyBytes_AS_STRING(converted);
    int failed = store_reserve(self, count) < 0;
    for (Py_ssize_t i = 0; !failed && !self->wide && i < count; i++) {
        long long value;
        memcpy(&value, bytes + 8 * i, 8);
        if (value < INT32_MIN || value > INT32_MAX) {
            failed = store_widen(self) < 0;
        }
    }
    for (Py_ssize_t i = 0; !failed && i < count; i++) {
        long long value;
        memcpy(&value, bytes + 8 * i, 8);
        if (self->wide) {
            ((long long *)self->values)[self->size + i] = value;
        }
        else {
            ((int32_t *)self->values)[self->size + i] = (int32_t)value;
        }
    }
    Py_DECREF(converted);
    if (failed) {
        return -1;
    }
    self->size += count;
    return 0;
}

/* Store one item: its values, and where batched, its end. */
static int
store_item(StoreObject *self, PyObject *item)
{
    /* Room for the end first: once the item's values are appended, nothing may fail before its end is. */
    if (self->batched && self->items + 1 == self->ends_capacity) {
        /* Up to the expected items in one go, but like the values at most MAX_PROJECTED_GROWTH times as
         * many as are stored: expected is a hint, and a wrong one must not reserve (or overflow) anything. */
        Py_ssize_t capacity = self->items + self->items / 2 + 2;
        if (self->items < self->expected) {
            Py_ssize_t most = MAX_PROJECTED_GROWTH * (self->items + 2);
            capacity = self->expected < most ? self->expected + 1 : most;
        }
        long long *ends = PyMem_Realloc(self->ends, (size_t)capacity * sizeof(long long));
        if (ends == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->ends = ends;
        self->ends_capacity = capacity;
    }
    Py_ssize_t count = 1;
    PyObject **items = self->batched ? sequence_items(item, &count) : &item;
    int packed = items == NULL ? 1 : store_pack(self, items, count);
    if (packed == 1) {
        packed = store_converted(self, item); /* a float, a bool, a numpy integer, or an int past int64 */
    }
    if (packed < 0) {
        return -1;
    }
    if (self->batched) {
        self->ends[self->items + 1] = self->size;
    }
    self->items++;
    return 0;
}

static PyObject *
store_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    int batched;
    PyObject *convert;
    Py_ssize_t expected = 0;
    static char *keywords[] = {"batched", "convert", "expected", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "pO|n:Store", keywords, &batched, &convert, &expected)) {
        return NULL;
    }
    if (!PyCallable_Check(convert)) {
        PyErr_SetString(PyExc_TypeError, "convert must be callable");
        return NULL;
    }
    StoreObject *self = (StoreObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->ends = PyMem_Malloc(sizeof(long long));
    if (self->ends == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->ends[0] = 0;
    self->ends_capacity = 1;
    Py_INCREF(convert);
    self->convert = convert;
    self->batched = batched;
    self->expected = expected;
    return (PyObject *)self;
}

static int
store_traverse(StoreObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->convert);
    return 0;
}

static int
store_clear(StoreObject *self)
{
    Py_CLEAR(self->convert);
    return 0;
}

static void
store_dealloc(StoreObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_XDECREF(self->convert);
    PyMem_Free(self->values);
    PyMem_Free(self->ends);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
store_length(StoreObject *self)
{
    return self->items;
}

PyDoc_STRVAR(store_read_doc,
"read(items, actions) -> (kept, count)\n\n"
"Take up to len(actions) items from the iterator items, and act on item i as actions[i] says: bit 1 stores\n"
"it, bit 2 keeps the object (in kept). count is how many items were taken: fewer than len(actions) when the\n"
"iterator ran out. Every item is released as soon as it was handled, so the sampler's next item reuses its\n"
"memory while it is still in the caches.");

static PyObject *
store_read(StoreObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read(items, actions) takes 2 arguments");
        return NULL;
    }
    PyObject *iterator = args[0];
    if (!PyIter_Check(iterator)) {
        PyErr_SetString(PyExc_TypeError, "items must be an iterator");
        return NULL;
    }
    Py_buffer actions;
    if (PyObject_GetBuffer(args[1], &actions, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *action = actions.buf;
    PyObject *kept = PyList_New(0), *result = NULL;
    Py_ssize_t count = 0;
    for (; kept != NULL && count < actions.len; count++) {
        PyObject *item = PyIter_Next(iterator);
        if (item == NULL) {
            if (PyErr_Occurred()) {
                goto done;
            }
            break;
        }
        int failed = (action[count] & 1) && store_item(self, item) < 0;
        failed = failed || ((action[count] & 2) && PyList_Append(kept, item) < 0);
        Py_DECREF(item);
        if (failed) {
            goto done;
        }
    }
    if (kept != NULL) {
        result = Py_BuildValue("(On)", kept, count);
    }
done:
    Py_XDECREF(kept);
    PyBuffer_Release(&actions);
    return result;
}

PyDoc_STRVAR(store_lists_doc,
"lists(slots) -> list\n\n"
"The stored items numbered slots (an int64 buffer), rebuilt: new lists of ints where batched, else ints.");

static PyObject *
store_lists(StoreObject *self, PyObject *slots_object)
{
    Py_buffer view;
    if (get_index_buffer(slots_object, &view, "slots", 0) < 0) {
        return NULL;
    }
    const long long *slots = view.buf;
    Py_ssize_t count = view.len / 8, itemsize = self->wide ? 8 : 4;
    if (self->batched) {
        /* Slots come in random order: ask for all their memory first, so the cache misses overlap. */
        for (Py_ssize_t i = 0; i < count; i++) {
            if (slots[i] >= 0 && slots[i] < self->items) {
                const char *end = self->values + self->ends[slots[i] + 1] * itemsize;
                for (const char *line = self->values + self->ends[slots[i]] * itemsize; line < end; line += 64) {
                    PREFETCH(line);
                }
            }
        }
    }
    PyObject *result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        long long slot = slots[i];
        if (slot < 0 || slot >= self->items) {
            PyErr_Format(PyExc_IndexError, "slot %lld is out of range: the store holds %zd items", slot, self->items);
            Py_CLEAR(result);
            break;
        }
        Py_ssize_t start = self->batched ? (Py_ssize_t)self->ends[slot] : (Py_ssize_t)slot;
        Py_ssize_t size = self->batched ? (Py_ssize_t)(self->ends[slot + 1] - start) : 1;
        PyObject *item = self->wide ? int64_list((const long long *)self->values + start, size)
                                    : int32_list((const int32_t *)self->values + start, size);
        if (item != NULL && !self->batched) {
            PyObject *index = PyList_GET_ITEM(item, 0);
            Py_INCREF(index);
            Py_SETREF(item, index);
        }
        if (item == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, item);
    }
    PyBuffer_Release(&view);
    return result;
}

static PyObject *
store_itemsize(StoreObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->wide ? 8 : 4);
}

static PyMethodDef store_methods[] = {
    {"read", (PyCFunction)(void (*)(void))store_read, METH_FASTCALL, store_read_doc},
    {"lists", (PyCFunction)store_lists, METH_O, store_lists_doc},
    {NULL},
};

static PyGetSetDef store_getset[] = {
    {"itemsize", (getter)store_itemsize, NULL, "bytes per stored index: 4 while every index fits in int32, then 8", NULL},
    {NULL},
};

static PySequenceMethods store_as_sequence = {.sq_length = (lenfunc)store_length};

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lightning_ddp_ext._compact.Store",
    .tp_basicsize = sizeof(StoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("Store(batched, convert, expected=0): items' indices, packed (see _compact.c)."),
    .tp_new = store_new,
    .tp_dealloc = (destructor)store_dealloc,
    .tp_traverse = (traverseproc)store_traverse,
    .tp_clear = (inquiry)store_clear,
    .tp_methods = store_methods,
    .tp_getset = store_getset,
    .tp_as_sequence = &store_as_sequence,
};

/* WindowDealer(items, seed, window, world, rank, first, end, sample_windows, on_sample): deal the windows
 * first .. end - 1, each of `window` positions, in C: read a window, keep this rank's items of it, and once
 * the window was read whole yield them (a window the iterator does not finish yields nothing, so every rank
 * yields the same number of items). With a seed, window w is permuted by a Fisher-Yates shuffle whose draws
 * are a counter-based hash of seed + w * window + i (see window_permutation; _windows.window_permutations
 * computes the same in numpy), and this rank yields the items at positions rank, rank + world, ... of that
 * permutation: the windowed shuffle, drawn at a few nanoseconds per position with nothing planned in
 * Python. With seed None the windows are not permuted: windows of one round deal the unshuffled sequence.
 *
 * The item at the last position of each window listed in sample_windows (ascending window indices, int64) is
 * passed to on_sample (the digest's sample) as it is read, unless on_sample is None; an error it raises ends
 * the dealing like the sampler's own. Nothing is kept for later: a batch held past its turn keeps its memory
 * from being reused, and holding one in every few hundred slowed the whole epoch by several percent. .read
 * counts the positions read. A rank holds one window's items, which stay in the core's caches, and hands
 * each over when it yields it. */
typedef struct {
    PyObject_HEAD
    PyObject *source, *on_sample;
    PyObject **held;         /* this rank's items of the current window, in yield order */
    Py_ssize_t *slot;        /* per position of the window: its index in held, or -1 */
    Py_ssize_t *permutation; /* scratch for window_permutation */
    uint64_t seed;
    int shuffled;            /* else the windows keep their order, and slot is fixed */
    Py_ssize_t window, world, rank, own, next_window, end;
    Py_buffer sample_windows;
    Py_ssize_t next_sample;  /* the next entry of sample_windows */
    Py_ssize_t available, next_yield, position; /* held[next_yield .. available) are yet to be yielded */
    int done;
    int reading;             /* set while a window is read: a next() from inside (the source, on_sample) is refused */
} WindowDealerObject;

/* SplitMix64's output function: a bijective mix of a 64-bit counter into well-spread bits. */
static inline uint64_t
mix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* A permutation of `size` positions: Fisher-Yates from the last position down, position i swapping with
 * j = (high 32 bits of mix64(base + i)) * (i + 1) >> 32, which is in [0, i]. Window w of a shuffle has
 * base = seed + w * window (the epoch's last window too, however few positions it has). Integer arithmetic
 * only, so every machine (and numpy) computes the same. */
static void
window_permutation(uint64_t base, Py_ssize_t size, Py_ssize_t *out)
{
    for (Py_ssize_t i = 0; i < size; i++) {
        out[i] = i;
    }
    for (Py_ssize_t i = size - 1; i > 0; i--) {
        uint64_t j = ((mix64(base + (uint64_t)i) >> 32) * (uint64_t)(i + 1)) >> 32;
        Py_ssize_t swapped = out[i];
        out[i] = out[j];
        out[j] = swapped;
    }
}

/* Drop what the dealer still holds of the current window (after a complete window: the items not yielded yet;
 * after an incomplete one: what was read of it). */
static void
window_dealer_release(WindowDealerObject *self)
{
    self->next_yield = self->available = 0;
    for (Py_ssize_t k = 0; k < self->own; k++) {
        Py_CLEAR(self->held[k]);
    }
}

static PyObject *
window_dealer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *items, *seed, *sample_windows, *on_sample;
    Py_ssize_t window, world, rank, first, end;
    static char *keywords[] = {"items", "seed", "window", "world", "rank", "first", "end", "sample_windows",
                               "on_sample", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOnnnnnOO:WindowDealer", keywords, &items, &seed, &window,
                                     &world, &rank, &first, &end, &sample_windows, &on_sample)) {
        return NULL;
    }
    if (on_sample != Py_None && !PyCallable_Check(on_sample)) {
        PyErr_Format(PyExc_TypeError, "on_sample must be callable or None, got %.100s", Py_TYPE(on_sample)->tp_name);
        return NULL;
    }
    if (!PyIter_Check(items)) {
        PyErr_SetString(PyExc_TypeError, "items must be an iterator");
        return NULL;
    }
    if (world < 1 || window < world || window % world != 0 || window > ((Py_ssize_t)1 << 31)) {
        PyErr_Format(PyExc_ValueError, "WindowDealer needs 1 <= world <= window <= 2**31 with window a multiple"
                     " of world, got window %zd, world %zd", window, world);
        return NULL;
    }
    if (rank < 0 || rank >= world || first < 0 || end < first) {
        PyErr_Format(PyExc_ValueError, "WindowDealer needs 0 <= rank < world and 0 <= first <= end, got rank %zd,"
                     " first %zd, end %zd", rank, first, end);
        return NULL;
    }
    unsigned long long seed_value = 0;
    if (seed != Py_None) {
        if (!PyLong_Check(seed)) {
            PyErr_Format(PyExc_TypeError, "seed must be an int or None, got %.100s", Py_TYPE(seed)->tp_name);
            return NULL;
        }
        seed_value = PyLong_AsUnsignedLongLongMask(seed);  /* modulo 2**64, as the numpy twin */
        if (seed_value == (unsigned long long)-1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    WindowDealerObject *self = (WindowDealerObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->own = window / world;
    self->held = PyMem_Calloc((size_t)self->own, sizeof(PyObject *));
    self->slot = PyMem_Malloc((size_t)window * sizeof(Py_ssize_t));
    self->permutation = PyMem_Malloc((size_t)window * sizeof(Py_ssize_t));
    if (self->held == NULL || self->slot == NULL || self->permutation == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    if (get_index_buffer(sample_windows, &self->sample_windows, "sample_windows", 0) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(items);
    self->source = items;
    if (on_sample != Py_None) {
        Py_INCREF(on_sample);
        self->on_sample = on_sample;
    }
    self->seed = (uint64_t)seed_value;
    self->shuffled = seed != Py_None;
    if (!self->shuffled) {  /* this rank's positions are the same in every window */
        for (Py_ssize_t p = 0; p < window; p++) {
            self->slot[p] = p % world == rank ? p / world : -1;
        }
    }
    self->window = window;
    self->world = world;
    self->rank = rank;
    self->next_window = first;
    self->end = end;
    return (PyObject *)self;
}

static int
window_dealer_traverse(WindowDealerObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->source);
    Py_VISIT(self->on_sample);
    for (Py_ssize_t k = 0; self->held != NULL && k < self->own; k++) {
        Py_VISIT(self->held[k]);
    }
    return 0;
}

/* Break a reference cycle through the dealer (its source or a held item referring back to it): drop what it
 * holds and end it, so a later next() reads nothing. */
static int
window_dealer_clear(WindowDealerObject *self)
{
    if (self->held != NULL) {
        window_dealer_release(self);
    }
    Py_CLEAR(self->source);
    Py_CLEAR(self->on_sample);
    self->done = 1;
    return 0;
}

static void
window_dealer_dealloc(WindowDealerObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->held != NULL) {
        window_dealer_release(self);
        PyMem_Free(self->held);
    }
    PyMem_Free(self->slot);
    PyMem_Free(self->permutation);
    Py_XDECREF(self->source);
    Py_XDECREF(self->on_sample);
    if (self->sample_windows.obj != NULL) {
        PyBuffer_Release(&self->sample_windows);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Draw the next window's permutation (when shuffled) and read the window into held; 1 when complete, 0 when
 * the iterator ran out or no window is left (StopIteration), -1 on error. */
static int
window_dealer_read(WindowDealerObject *self)
{
    Py_ssize_t index = self->next_window;
    if (index >= self->end) {
        return 0;
    }
    Py_ssize_t window = self->window, *slot = self->slot;
    if (self->shuffled) {
        window_permutation(self->seed + (uint64_t)index * (uint64_t)window, window, self->permutation);
        for (Py_ssize_t p = 0; p < window; p++) {
            slot[p] = -1;
        }
        for (Py_ssize_t k = 0; k < self->own; k++) {
            slot[self->permutation[self->rank + k * self->world]] = k;
        }
    }
    const long long *sample_windows = self->sample_windows.buf;
    int sampled = self->on_sample != NULL && self->next_sample < self->sample_windows.len / 8
                  && sample_windows[self->next_sample] == index;
    for (Py_ssize_t p = 0; p < window; p++) {
        PyObject *item = PyIter_Next(self->source);
        if (item == NULL) {
            window_dealer_release(self);
            return PyErr_Occurred() ? -1 : 0;
        }
        self->position++;
        if (sampled && p == window - 1) {
            PyObject *done_with = PyObject_CallOneArg(self->on_sample, item);
            if (done_with == NULL) {
                Py_DECREF(item);
                window_dealer_release(self);
                return -1;
            }
            Py_DECREF(done_with);
            self->next_sample++;
        }
        Py_ssize_t k = slot[p];
        if (k >= 0) {
            self->held[k] = item;
        }
        else {
            Py_DECREF(item);
        }
    }
    self->next_window = index + 1;
    self->available = self->own;
    return 1;
}

static PyObject *
window_dealer_next(WindowDealerObject *self)
{
    if (self->reading) {
        PyErr_SetString(PyExc_RuntimeError, "WindowDealer is reading a window: next() from its source or on_sample"
                        " is not allowed");
        return NULL;
    }
    if (self->next_yield == self->available) {
        window_dealer_release(self);
        self->reading = 1;
        int read = self->done ? 0 : window_dealer_read(self);
        self->reading = 0;
        if (read <= 0) {
            self->done = 1; /* stays exhausted, also after an error */
            return NULL;
        }
    }
    /* Hand the reference over: the window's items are yielded once each. */
    PyObject *item = self->held[self->next_yield];
    self->held[self->next_yield++] = NULL;
    return item;
}

static PyMemberDef window_dealer_members[] = {
    {"read", T_PYSSIZET, offsetof(WindowDealerObject, position), READONLY, "positions read so far"},
    {NULL},
};

static PyTypeObject WindowDealerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lightning_ddp_ext._compact.WindowDealer",
    .tp_basicsize = sizeof(WindowDealerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("WindowDealer(items, seed, window, world, rank, first, end, sample_windows, on_sample):"
                        " this rank's items of each complete window, permuted by seed unless it is None."),
    .tp_new = window_dealer_new,
    .tp_dealloc = (destructor)window_dealer_dealloc,
    .tp_traverse = (traverseproc)window_dealer_traverse,
    .tp_clear = (inquiry)window_dealer_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)window_dealer_next,
    .tp_members = window_dealer_members,
};

/* window_permutations(seed, first, count, size, stride, out): write the permutations of windows first to
 * first + count - 1 (each of `size` positions, counters `stride` apart) into `out`, an int64 buffer of
 * count * size items, one row per window: _windows.window_permutations, without a Python step per swap. */
static PyObject *
compact_window_permutations(PyObject *module, PyObject *args)
{
    PyObject *seed, *out;
    Py_ssize_t first, count, size, stride;
    if (!PyArg_ParseTuple(args, "O!nnnnO:window_permutations", &PyLong_Type, &seed, &first, &count, &size, &stride,
                          &out)) {
        return NULL;
    }
    if (first < 0 || count < 0 || size < 0 || size > ((Py_ssize_t)1 << 31) || stride < size
        || (size > 0 && count > PY_SSIZE_T_MAX / 8 / size)) {
        PyErr_Format(PyExc_ValueError, "window_permutations needs first, count >= 0 and 0 <= size <= stride with"
                     " size <= 2**31, got first %zd, count %zd, size %zd, stride %zd", first, count, size, stride);
        return NULL;
    }
    uint64_t seed_value = (uint64_t)PyLong_AsUnsignedLongLongMask(seed);  /* modulo 2**64, as the numpy twin */
    if (seed_value == (uint64_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    if (get_index_buffer(out, &view, "out", PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    if (view.len / 8 != count * size) {
        PyErr_Format(PyExc_ValueError, "out holds %zd items, not count * size = %zd", view.len / 8, count * size);
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t *rows = view.buf;
    for (Py_ssize_t r = 0; r < count; r++) {
        window_permutation(seed_value + (uint64_t)(first + r) * (uint64_t)stride, size, rows + r * size);
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* exact_int_tuple(item): item's indices as a tuple of the same int objects when item is an exact list or tuple
 * of exact ints, else None: the key the sequence digest hashes (consistency.RunningDigest), without a Python
 * step per index. The caller's Python path handles everything else, with the same result or error. */
static PyObject *
compact_exact_int_tuple(PyObject *module, PyObject *item)
{
    Py_ssize_t size = 0;
    PyObject **items = sequence_items(item, &size);  /* NULL for an empty list too: () either way */
    if (items == NULL && !(PyList_CheckExact(item) || PyTuple_CheckExact(item))) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        if (!PyLong_CheckExact(items[i])) {
            Py_RETURN_NONE;
        }
    }
    if (PyTuple_CheckExact(item)) {
        Py_INCREF(item);
        return item;
    }
    return PyList_AsTuple(item);
}

static PyMethodDef compact_functions[] = {
    {"window_permutations", compact_window_permutations, METH_VARARGS,
     PyDoc_STR("window_permutations(seed, first, count, size, stride, out): the windows' permutations, into out")},
    {"exact_int_tuple", compact_exact_int_tuple, METH_O,
     PyDoc_STR("exact_int_tuple(item): tuple(item) if item is an exact list or tuple of exact ints, else None")},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef compact_module = {
    PyModuleDef_HEAD_INIT, "_compact", "Optional C helpers of the samplers (see _compact.c).", 0, compact_functions,
};

/* SHA-256 of this file (CRLF read as LF), defined by setup.py: _store.py sets a helper built from other sources
 * aside. A build that does not define it records an empty digest, which never matches. */
#ifndef SOURCE_DIGEST
#define SOURCE_DIGEST ""
#endif

PyMODINIT_FUNC
PyInit__compact(void)
{
    if (PyType_Ready(&StoreType) < 0 || PyType_Ready(&WindowDealerType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&compact_module);
    if (module != NULL
        && (PyModule_AddType(module, &StoreType) < 0
            || PyModule_AddType(module, &WindowDealerType) < 0
            || PyModule_AddStringConstant(module, "SOURCE_DIGEST", SOURCE_DIGEST) < 0)) {
        Py_CLEAR(module);
    }
    return module;
}
