/* Optional C helpers for the samplers: the compact store's packing and rebuilding (_store.py), and the
 * dealers of the unshuffled and the windowed paths (samplers.py).
 *
 * A whole-epoch shuffle stores this rank's share compactly and rebuilds each batch as a list when it is
 * yielded. In pure Python the cheapest conversions (array.fromlist, memoryview.tolist) cost more per index
 * than the user's sampler spends making it; here packing costs a few nanoseconds per index and rebuilding
 * is a plain int allocation. The pure-Python path in _store.py stays the reference: this module converts
 * only exact ints and exact lists or tuples of them, and hands anything else to the caller's Python
 * converter, so both paths store the same indices and raise the same errors. The dealers yield exactly
 * what their pure-Python counterparts in samplers.py yield, errors included.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* the layout of ints, which Python.h includes itself from 3.11 */
#endif
#include <stdint.h>
#include <string.h>

/* Accept a C-contiguous buffer of native signed integers of 8 bytes (array('q'), numpy int64) or, where
 * narrow_ok, of 4 bytes (array('i'), numpy int32). */
static int
get_index_buffer(PyObject *obj, Py_buffer *view, const char *name, int narrow_ok)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    const char *format = view->format == NULL ? "B" : view->format;
    if (format[0] == '@' || format[0] == '=') {
        format++;
    }
    int wide = view->itemsize == 8 && (strcmp(format, "q") == 0 || strcmp(format, "l") == 0);
    int narrow = narrow_ok && view->itemsize == 4 && (strcmp(format, "i") == 0 || strcmp(format, "l") == 0);
    if (!wide && !narrow) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous buffer of int64%s, got format '%s' of %zd bytes",
                     name, narrow_ok ? " or int32" : "", view->format == NULL ? "B" : view->format, view->itemsize);
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

/* Write items[0:size] to out and return 0 if all are exact ints in the int64 range; otherwise return -1
 * (no exception set). */
static int
pack_ints(PyObject **items, Py_ssize_t size, long long *out)
{
    for (Py_ssize_t i = 0; i < size; i++) {
        int overflow;
        if (!PyLong_CheckExact(items[i])) {
            return -1;
        }
        out[i] = exact_int_value(items[i], &overflow);
        if (overflow) {
            return -1;
        }
    }
    return 0;
}

/* A growable buffer of int64, freed by the caller. */
typedef struct {
    long long *data;
    Py_ssize_t size, capacity;
} Int64Buffer;

static int
reserve(Int64Buffer *buffer, Py_ssize_t extra)
{
    if (extra <= buffer->capacity - buffer->size) {
        return 0;
    }
    Py_ssize_t capacity = buffer->capacity < 1024 ? 1024 : buffer->capacity;
    while (capacity - buffer->size < extra) {
        if (capacity > PY_SSIZE_T_MAX / 16) {
            PyErr_NoMemory();
            return -1;
        }
        capacity *= 2;
    }
    long long *data = PyMem_Realloc(buffer->data, (size_t)capacity * sizeof(long long));
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buffer->data = data;
    buffer->capacity = capacity;
    return 0;
}

/* Append the indices of one item: exact ints (or lists and tuples of them) directly, anything else through
 * convert(item), the pure-Python path, which returns their int64 bytes or raises the error users see. */
static Py_ssize_t
store_item(Int64Buffer *buffer, PyObject *item, int batched, PyObject *convert)
{
    Py_ssize_t size = 1;
    PyObject **items = &item;
    if (batched) {
        items = sequence_items(item, &size);
    }
    if (items != NULL) {
        if (reserve(buffer, size) < 0) {
            return -1;
        }
        if (pack_ints(items, size, buffer->data + buffer->size) == 0) {
            buffer->size += size;
            return size;
        }
        /* a float, a bool, a numpy integer, or an int past int64: convert decides */
    }
    PyObject *converted = PyObject_CallOneArg(convert, item);
    if (converted == NULL) {
        return -1;
    }
    if (!PyBytes_Check(converted) || PyBytes_GET_SIZE(converted) % 8 != 0) {
        PyErr_SetString(PyExc_TypeError, "convert must return the item's indices as int64 bytes");
        Py_DECREF(converted);
        return -1;
    }
    size = PyBytes_GET_SIZE(converted) / 8;
    if (reserve(buffer, size) < 0) {
        Py_DECREF(converted);
        return -1;
    }
    memcpy(buffer->data + buffer->size, PyBytes_AS_STRING(converted), (size_t)size * 8);
    buffer->size += size;
    Py_DECREF(converted);
    return size;
}

/* The buffer's values as bytes: 4 per value where narrow and all of them fit in int32, else 8. */
static PyObject *
narrow_bytes(const Int64Buffer *buffer, int narrow)
{
    for (Py_ssize_t i = 0; narrow && i < buffer->size; i++) {
        narrow = buffer->data[i] >= INT32_MIN && buffer->data[i] <= INT32_MAX;
    }
    if (!narrow) {
        return PyBytes_FromStringAndSize((const char *)buffer->data, buffer->size * 8);
    }
    PyObject *packed = PyBytes_FromStringAndSize(NULL, buffer->size * 4);
    if (packed != NULL) {
        int32_t *out = (int32_t *)PyBytes_AS_STRING(packed);
        for (Py_ssize_t i = 0; i < buffer->size; i++) {
            out[i] = (int32_t)buffer->data[i];
        }
    }
    return packed;
}

PyDoc_STRVAR(read_doc,
"read(items, actions, batched, convert, narrow) -> (packed, itemsize, lengths, kept, count)\n\n"
"Take up to len(actions) items from the iterator items, and act on item i as actions[i] says: bit 1 packs\n"
"its indices (concatenated into packed, native integers of itemsize bytes, with one entry per packed item\n"
"in lengths when batched), bit 2 keeps the object (in kept). itemsize is 4 when narrow is true and every\n"
"packed index fits in int32, else 8. count is how many items were taken: fewer than len(actions) when the\n"
"iterator ran out. Every item is released as soon as it was handled, so the sampler's next item reuses its\n"
"memory while it is still in the caches.");

static PyObject *
compact_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "read(items, actions, batched, convert, narrow) takes 5 arguments");
        return NULL;
    }
    PyObject *iterator = args[0], *convert = args[3];
    if (!PyIter_Check(iterator)) {
        PyErr_SetString(PyExc_TypeError, "items must be an iterator");
        return NULL;
    }
    int batched = PyObject_IsTrue(args[2]), narrow = PyObject_IsTrue(args[4]);
    if (batched < 0 || narrow < 0) {
        return NULL;
    }
    Py_buffer actions;
    if (PyObject_GetBuffer(args[1], &actions, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *action = actions.buf;
    Int64Buffer buffer = {NULL, 0, 0};
    PyObject *lengths = PyList_New(0), *kept = PyList_New(0), *result = NULL;
    Py_ssize_t count = 0;
    if (lengths == NULL || kept == NULL) {
        goto done;
    }
    for (; count < actions.len; count++) {
        PyObject *item = PyIter_Next(iterator);
        if (item == NULL) {
            if (PyErr_Occurred()) {
                goto done;
            }
            break;
        }
        int failed = 0;
        if (action[count] & 1) {
            Py_ssize_t size = store_item(&buffer, item, batched, convert);
            failed = size < 0;
            if (!failed && batched) {
                PyObject *length = PyLong_FromSsize_t(size);
                failed = length == NULL || PyList_Append(lengths, length) < 0;
                Py_XDECREF(length);
            }
        }
        if (!failed && (action[count] & 2)) {
            failed = PyList_Append(kept, item) < 0;
        }
        Py_DECREF(item);
        if (failed) {
            goto done;
        }
    }
    PyObject *packed = narrow_bytes(&buffer, narrow);
    if (packed != NULL) {
        result = Py_BuildValue("(NnOOn)", packed, PyBytes_GET_SIZE(packed) == buffer.size * 4 ? 4 : 8, lengths,
                               kept, count);
    }
done:
    PyMem_Free(buffer.data);
    Py_XDECREF(lengths);
    Py_XDECREF(kept);
    PyBuffer_Release(&actions);
    return result;
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

PyDoc_STRVAR(lists_doc,
"lists(flat, offsets, slots) -> list\n\n"
"For each slot s, flat[offsets[s]:offsets[s + 1]] as a list of ints. flat is an int32 or int64 buffer,\n"
"offsets and slots are int64 buffers.");

static PyObject *
compact_lists(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "lists(flat, offsets, slots) takes 3 arguments");
        return NULL;
    }
    Py_buffer flat_view, offsets_view, slots_view;
    if (get_index_buffer(args[0], &flat_view, "flat", 1) < 0) {
        return NULL;
    }
    if (get_index_buffer(args[1], &offsets_view, "offsets", 0) < 0) {
        PyBuffer_Release(&flat_view);
        return NULL;
    }
    if (get_index_buffer(args[2], &slots_view, "slots", 0) < 0) {
        PyBuffer_Release(&flat_view);
        PyBuffer_Release(&offsets_view);
        return NULL;
    }
    const long long *offsets = offsets_view.buf, *slots = slots_view.buf;
    const int narrow = flat_view.itemsize == 4;
    Py_ssize_t flat_size = flat_view.len / flat_view.itemsize, slot_count = offsets_view.len / 8 - 1;
    Py_ssize_t count = slots_view.len / 8;
    /* Slots come in random order: ask for all their memory first, so the cache misses overlap. */
    for (Py_ssize_t i = 0; i < count; i++) {
        long long slot = slots[i];
        if (slot >= 0 && slot < slot_count && offsets[slot] >= 0 && offsets[slot + 1] <= flat_size) {
            const char *first = (const char *)flat_view.buf + offsets[slot] * flat_view.itemsize;
            const char *end = (const char *)flat_view.buf + offsets[slot + 1] * flat_view.itemsize;
            for (const char *line = first; line < end; line += 64) {
                __builtin_prefetch(line);
            }
        }
    }
    PyObject *result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        long long slot = slots[i];
        if (slot < 0 || slot >= slot_count || offsets[slot] < 0 || offsets[slot] > offsets[slot + 1]
            || offsets[slot + 1] > flat_size) {
            PyErr_Format(PyExc_IndexError, "slot %lld is out of range or has bad offsets", slot);
            Py_CLEAR(result);
            break;
        }
        Py_ssize_t start = (Py_ssize_t)offsets[slot], size = (Py_ssize_t)(offsets[slot + 1] - offsets[slot]);
        PyObject *batch = narrow ? int32_list((const int32_t *)flat_view.buf + start, size)
                                 : int64_list((const long long *)flat_view.buf + start, size);
        if (batch == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, batch);
    }
    PyBuffer_Release(&flat_view);
    PyBuffer_Release(&offsets_view);
    PyBuffer_Release(&slots_view);
    return result;
}

/* Dealer(items, world, rank): iterate items a round of world at a time and yield each complete round's item
 * at rank, releasing the others at once; a round the iterator does not finish yields nothing. What
 * map(itemgetter(rank), zip(*[iter(items)] * world)) does, without holding a tuple of the round. */
typedef struct {
    PyObject_HEAD
    PyObject *source;
    Py_ssize_t world, rank;
} DealerObject;

static PyObject *
dealer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *items;
    Py_ssize_t world, rank;
    static char *keywords[] = {"items", "world", "rank", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onn:Dealer", keywords, &items, &world, &rank)) {
        return NULL;
    }
    if (world < 1 || rank < 0 || rank >= world) {
        PyErr_Format(PyExc_ValueError, "Dealer needs world >= 1 and 0 <= rank < world, got world=%zd rank=%zd",
                     world, rank);
        return NULL;
    }
    PyObject *source = PyObject_GetIter(items);
    if (source == NULL) {
        return NULL;
    }
    DealerObject *self = (DealerObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(source);
        return NULL;
    }
    self->source = source;
    self->world = world;
    self->rank = rank;
    return (PyObject *)self;
}

static int
dealer_traverse(DealerObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->source);
    return 0;
}

static void
dealer_dealloc(DealerObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_XDECREF(self->source);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
dealer_next(DealerObject *self)
{
    PyObject *own = NULL;
    for (Py_ssize_t i = 0; i < self->world; i++) {
        PyObject *item = PyIter_Next(self->source);
        if (item == NULL) {  /* exhausted (or failed) inside the round: the round yields nothing */
            Py_XDECREF(own);
            return NULL;
        }
        if (i == self->rank) {
            own = item;
        }
        else {
            Py_DECREF(item);
        }
    }
    return own;
}

static PyTypeObject DealerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lightning_ddp_ext._compact.Dealer",
    .tp_basicsize = sizeof(DealerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("Dealer(items, world, rank): the item at rank of every complete round of world items."),
    .tp_new = dealer_new,
    .tp_dealloc = (destructor)dealer_dealloc,
    .tp_traverse = (traverseproc)dealer_traverse,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)dealer_next,
};

/* WindowDealer(items, actions, order, window): read items a window of `window` positions at a time, as
 * actions says per position (bit 1 holds the item for this rank, bit 2 appends it to .samples), and once a
 * window is complete yield its held items in the order given by `order` (per yield, the index of the item
 * among its window's held items, in reading order). A window the iterator does not finish yields nothing.
 * The windowed shuffle's blocks: a rank holds one window's items, not a block's, so they stay in the caches.
 * .read counts the positions read, .samples holds the bit-2 items. */
typedef struct {
    PyObject_HEAD
    PyObject *source, *samples;
    Py_buffer actions, order;
    PyObject **held;
    Py_ssize_t window, held_count, next_yield, yields_end, position;
    int done;
} WindowDealerObject;

static void
release_held(WindowDealerObject *self)
{
    Py_ssize_t count = self->held_count;
    self->held_count = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_DECREF(self->held[i]);
    }
}

static PyObject *
window_dealer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *items, *actions, *order;
    Py_ssize_t window;
    static char *keywords[] = {"items", "actions", "order", "window", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOn:WindowDealer", keywords, &items, &actions, &order,
                                     &window)) {
        return NULL;
    }
    if (!PyIter_Check(items)) {
        PyErr_SetString(PyExc_TypeError, "items must be an iterator");
        return NULL;
    }
    if (window < 1) {
        PyErr_Format(PyExc_ValueError, "WindowDealer needs window >= 1, got %zd", window);
        return NULL;
    }
    WindowDealerObject *self = (WindowDealerObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    if (PyObject_GetBuffer(actions, &self->actions, PyBUF_SIMPLE) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (get_index_buffer(order, &self->order, "order", 0) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (self->actions.len % window != 0) {
        PyErr_Format(PyExc_ValueError, "actions must cover whole windows of %zd, got %zd positions", window,
                     self->actions.len);
        Py_DECREF(self);
        return NULL;
    }
    self->held = PyMem_Calloc((size_t)window, sizeof(PyObject *));
    self->samples = PyList_New(0);
    if (self->held == NULL || self->samples == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_INCREF(items);
    self->source = items;
    self->window = window;
    return (PyObject *)self;
}

static int
window_dealer_traverse(WindowDealerObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->source);
    Py_VISIT(self->samples);
    for (Py_ssize_t i = 0; i < self->held_count; i++) {
        Py_VISIT(self->held[i]);
    }
    return 0;
}

static void
window_dealer_dealloc(WindowDealerObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->held != NULL) {
        release_held(self);
        PyMem_Free(self->held);
    }
    Py_XDECREF(self->source);
    Py_XDECREF(self->samples);
    if (self->actions.obj != NULL) {
        PyBuffer_Release(&self->actions);
    }
    if (self->order.obj != NULL) {
        PyBuffer_Release(&self->order);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Read the next window into held; 1 when complete, 0 when the iterator ran out or no positions are left
 * (StopIteration), -1 on error. */
static int
read_window(WindowDealerObject *self)
{
    const unsigned char *action = self->actions.buf;
    Py_ssize_t end = self->position + self->window;
    if (end > self->actions.len) {
        return 0;  /* every window was dealt */
    }
    while (self->position < end) {
        PyObject *item = PyIter_Next(self->source);
        if (item == NULL) {
            release_held(self);
            return PyErr_Occurred() ? -1 : 0;
        }
        unsigned char todo = action[self->position++];
        if ((todo & 2) && PyList_Append(self->samples, item) < 0) {
            Py_DECREF(item);
            release_held(self);
            return -1;
        }
        if (todo & 1) {
            self->held[self->held_count++] = item;
        }
        else {
            Py_DECREF(item);
        }
    }
    Py_ssize_t yields = self->order.len / 8;
    if (self->held_count > yields - self->yields_end) {
        PyErr_SetString(PyExc_ValueError, "order has fewer entries than the windows hold items");
        release_held(self);
        return -1;
    }
    self->next_yield = self->yields_end;
    self->yields_end += self->held_count;
    return 1;
}

static PyObject *
window_dealer_next(WindowDealerObject *self)
{
    while (self->next_yield == self->yields_end) {
        release_held(self);
        if (self->done || read_window(self) <= 0) {
            self->done = 1;  /* stays exhausted, also after an error */
            return NULL;
        }
    }
    long long index = ((const long long *)self->order.buf)[self->next_yield++];
    if (index < 0 || index >= self->held_count) {
        PyErr_Format(PyExc_IndexError, "order entry %lld is not one of the window's %zd held items", index,
                     self->held_count);
        return NULL;
    }
    PyObject *item = self->held[index];
    Py_INCREF(item);
    return item;
}

static PyMemberDef window_dealer_members[] = {
    {"read", T_PYSSIZET, offsetof(WindowDealerObject, position), READONLY, "positions read so far"},
    {"samples", T_OBJECT, offsetof(WindowDealerObject, samples), READONLY, "the items of bit-2 positions"},
    {NULL},
};

static PyTypeObject WindowDealerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lightning_ddp_ext._compact.WindowDealer",
    .tp_basicsize = sizeof(WindowDealerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("WindowDealer(items, actions, order, window): each complete window's held items, in order."),
    .tp_new = window_dealer_new,
    .tp_dealloc = (destructor)window_dealer_dealloc,
    .tp_traverse = (traverseproc)window_dealer_traverse,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)window_dealer_next,
    .tp_members = window_dealer_members,
};

static PyMethodDef compact_methods[] = {
    {"read", (PyCFunction)(void (*)(void))compact_read, METH_FASTCALL, read_doc},
    {"lists", (PyCFunction)(void (*)(void))compact_lists, METH_FASTCALL, lists_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef compact_module = {
    PyModuleDef_HEAD_INIT, "_compact", "Optional C helpers of the samplers (see _compact.c).", 0,
    compact_methods,
};

PyMODINIT_FUNC
PyInit__compact(void)
{
    if (PyType_Ready(&DealerType) < 0 || PyType_Ready(&WindowDealerType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&compact_module);
    if (module != NULL
        && (PyModule_AddType(module, &DealerType) < 0 || PyModule_AddType(module, &WindowDealerType) < 0)) {
        Py_CLEAR(module);
    }
    return module;
}
