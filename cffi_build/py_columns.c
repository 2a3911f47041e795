/* Reading 1-D GPU arrays' __cuda_array_interface__ for from_cuda_arrays, in one call for all columns.
 *
 * What a column needs (data pointer, length, numeric type, announced stream) is read from each
 * array's interface dict here, with the GIL held (a builtin function, installed like py_capsules.c's:
 * aib_py_install_columns), instead of a dozen dict look-ups per column in Python. This is the only
 * reader of the interface: at the first column it cannot take it stops and says why (a reason code
 * and the offending value), and the caller raises the documented error from that, or views a
 * DLPack-only producer through CuPy and calls again. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>
#include <string.h>


#include "internal.h"

/* The numeric types in the order of arrays/device.py's _NUMERIC_TYPES (the format codes of aib_columns_build). */
static const char *const typestrs[] = {"i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"};
static const int64_t itemsizes[] = {1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8};
#define N_TYPES (sizeof(typestrs) / sizeof(typestrs[0]))

/* Names and typestrs made once, at install: a lookup by an interned str hashes nothing and allocates
 * nothing, where one by a C string makes a str each time (many times per column). */
enum { K_SHAPE, K_TYPESTR, K_STRIDES, K_MASK, K_DATA, K_STREAM, K_CAI, K_NDIM, K_SIZE, K_DTYPE, K_STR, K_PTR,
       N_KEYS };
static const char *const key_names[N_KEYS] = {
    "shape", "typestr", "strides", "mask", "data", "stream", "__cuda_array_interface__", "ndim", "size",
    "dtype", "str", "ptr"};
static PyObject *keys[N_KEYS];
static PyObject *codes_by_typestr; /* "<f4", "|f4", "<i1", "|i1"... -> the column code */

/* Borrowed item of a dict; NULL when absent (no exception set either way). */
static PyObject *item(PyObject *dict, int key) { return PyDict_GetItem(dict, keys[key]); }

static int absent_or_none(PyObject *dict, int key) {
  PyObject *value = item(dict, key);
  return value == NULL || value == Py_None;
}

/* A typestr's column code (the index in typestrs), or N_TYPES for any other. */
static uint32_t code_of(PyObject *typestr) {
  PyObject *code = typestr != NULL && PyUnicode_Check(typestr) ? PyDict_GetItem(codes_by_typestr, typestr) : NULL;
  return code != NULL ? (uint32_t)PyLong_AsLong(code) : N_TYPES;
}

/* Why a column was not read (arrays/device.py raises from these; keep the two lists equal). */
enum {
  READ_OK = 0,
  READ_NO_INTERFACE = 1, /* no __cuda_array_interface__ */
  READ_SHAPE = 2,        /* not 1-D: detail is the shape */
  READ_TYPE = 3,         /* a typestr with no Arrow equivalent: detail is the typestr */
  READ_STRIDES = 4,      /* not contiguous */
  READ_MASK = 5,         /* masked */
  READ_LENGTH = 6,       /* a length other than the first column's: detail is that length */
  READ_MALFORMED = 7,    /* an interface that breaks the protocol (no data pointer, a negative length...) */
};

/* READ_OK and *out filled, or the reason (*detail borrowed, or NULL) with any Python exception
 * cleared. */
static int read_one(PyObject *cai, aib_cuda_column *out, PyObject **detail) {
  *detail = NULL;
  if (!PyDict_Check(cai)) return READ_MALFORMED;
  PyObject *shape = item(cai, K_SHAPE);
  if (shape == NULL || !PyTuple_Check(shape)) return READ_MALFORMED;
  if (PyTuple_Size(shape) != 1) {
    *detail = shape;
    return READ_SHAPE;
  }
  long long length = PyLong_AsLongLong(PyTuple_GetItem(shape, 0));
  if (length < 0) return READ_MALFORMED;
  PyObject *typestr = item(cai, K_TYPESTR);
  uint32_t code = code_of(typestr);
  if (code == N_TYPES) {
    *detail = typestr;
    return typestr != NULL && PyUnicode_Check(typestr) ? READ_TYPE : READ_MALFORMED;
  }
  PyObject *strides = item(cai, K_STRIDES);
  if (strides != NULL && strides != Py_None) {
    if (!PyTuple_Check(strides) || PyTuple_Size(strides) != 1) return READ_STRIDES;
    if (PyLong_AsLongLong(PyTuple_GetItem(strides, 0)) != itemsizes[code]) return READ_STRIDES;
  }
  if (!absent_or_none(cai, K_MASK)) return READ_MASK;
  PyObject *data = item(cai, K_DATA);
  if (data == NULL || !PyTuple_Check(data) || PyTuple_Size(data) < 1) return READ_MALFORMED;
  unsigned long long pointer = PyLong_AsUnsignedLongLong(PyTuple_GetItem(data, 0));
  if (PyErr_Occurred()) return READ_MALFORMED;
  PyObject *stream = item(cai, K_STREAM);
  long long stream_value = 0;
  if (stream != NULL && stream != Py_None) {
    stream_value = PyLong_AsLongLong(stream);
    if (PyErr_Occurred()) return READ_MALFORMED;
  }
  out->data = pointer;
  out->length = length;
  out->stream = stream_value;
  out->code = code;
  return READ_OK;
}

/* An attribute as a C integer; -1 (exception cleared) when absent or not an integer. */
static long long int_attr(PyObject *obj, int key) {
  PyObject *value = PyObject_GetAttr(obj, keys[key]);
  if (value == NULL) return -1;
  long long result = PyLong_Check(value) ? PyLong_AsLongLong(value) : -1;
  Py_DECREF(value);
  return result;
}

/* The column code of a CuPy array's dtype: the dtype last seen is kept (a reference: it cannot be
 * freed and another object made at its address) with its code, so a batch of columns of one dtype
 * reads dtype.str once, not a new string per column. A dtype object's type string never changes.
 * The GIL is held throughout. */
static PyObject *last_dtype;
static uint32_t last_code = N_TYPES;

static uint32_t code_of_dtype(PyObject *dtype) {
  if (dtype == last_dtype) return last_code;
  PyObject *typestr = PyObject_GetAttr(dtype, keys[K_STR]);
  uint32_t code = code_of(typestr);
  Py_XDECREF(typestr);
  if (code != N_TYPES) {
    PyObject *old = last_dtype;
    Py_INCREF(dtype);
    last_dtype = dtype;
    last_code = code;
    Py_XDECREF(old);
  }
  return code;
}

/* Whether a 1-D array of `length` items of `itemsize` bytes is contiguous, from its public
 * `strides` (a tuple of one byte stride): an array of at most one item always is. */
static int contiguous_1d(PyObject *obj, long long length, int64_t itemsize) {
  if (length <= 1) return 1;
  PyObject *strides = PyObject_GetAttr(obj, keys[K_STRIDES]);
  int contiguous = 0;
  if (strides != NULL && PyTuple_Check(strides) && PyTuple_GET_SIZE(strides) == 1) {
    PyObject *stride = PyTuple_GET_ITEM(strides, 0);
    contiguous = PyLong_Check(stride) && PyLong_AsLongLong(stride) == itemsize;
  }
  Py_XDECREF(strides);
  return contiguous;
}

/* A CuPy ndarray's column facts from its own public attributes, what its __cuda_array_interface__
 * is built from (ndim, size, dtype.str, strides, data.ptr; ptr 0 when empty) without building the
 * interface dict and its dtype description for every array. The stream is not a fact of the array:
 * CuPy's interface reports the current stream, which is the first column's (read through its
 * interface in the same call). 0, or -1 (exception cleared by the caller) to take the interface. */
static int read_cupy(PyObject *obj, int64_t stream, aib_cuda_column *out) {
  if (int_attr(obj, K_NDIM) != 1) return -1;
  long long length = int_attr(obj, K_SIZE);
  if (length < 0) return -1;
  PyObject *dtype = PyObject_GetAttr(obj, keys[K_DTYPE]);
  uint32_t code = dtype ? code_of_dtype(dtype) : N_TYPES;
  Py_XDECREF(dtype);
  if (code == N_TYPES || !contiguous_1d(obj, length, itemsizes[code])) return -1;
  unsigned long long pointer = 0;
  if (length > 0) {
    PyObject *data = PyObject_GetAttr(obj, keys[K_DATA]);
    PyObject *ptr = data ? PyObject_GetAttr(data, keys[K_PTR]) : NULL;
    pointer = ptr && PyLong_Check(ptr) ? PyLong_AsUnsignedLongLong(ptr) : 0;
    Py_XDECREF(ptr);
    Py_XDECREF(data);
    if (pointer == 0 || PyErr_Occurred()) return -1;
  }
  out->data = pointer;
  out->length = length;
  out->stream = stream;
  out->code = code;
  return 0;
}

/* read_cuda_columns(values, n, cupy_type) -> (done, facts, reason, detail): facts is a bytes object
 * holding an aib_cuda_column[n], zero-filled (its bytes are deterministic: they are the columns'
 * signature), whose first done entries were read from the columns (done == n: all of them, reason
 * READ_OK); otherwise reason says why column done was not read and detail is the offending value
 * (its shape or typestr) or None. values: a list of n arrays. cupy_type: CuPy's ndarray type when
 * the caller found the first value to be one (its later values of exactly that type are read by
 * read_cupy, from what their interface is built from), else None. An exception raised by an
 * array's interface other than AttributeError propagates. The bytes object is new and not shared
 * while it is filled. */
static PyObject *read_cuda_columns(PyObject *self, PyObject *args) {
  PyObject *values, *cupy_type;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "OnO", &values, &n, &cupy_type)) return NULL;
  if (!PyList_Check(values) || PyList_Size(values) != n || n < 1) {
    PyErr_SetString(PyExc_ValueError, "read_cuda_columns needs a list of n >= 1 values");
    return NULL;
  }
  if ((size_t)n > PY_SSIZE_T_MAX / sizeof(aib_cuda_column)) return PyErr_NoMemory();
  PyObject *facts = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(aib_cuda_column));
  if (facts == NULL) return NULL;
  aib_cuda_column *columns = (aib_cuda_column *)PyBytes_AsString(facts);
  memset(columns, 0, (size_t)n * sizeof(aib_cuda_column));
  Py_ssize_t i = 0;
  int reason = READ_OK;
  PyObject *detail = NULL; /* a new reference once set */
  for (; i < n; i++) {
    PyObject *value = PyList_GetItem(values, i);
    if (i > 0 && cupy_type != Py_None && (PyObject *)Py_TYPE(value) == cupy_type &&
        read_cupy(value, columns[0].stream, &columns[i]) == 0) {
      if (columns[i].length != columns[0].length) {
        reason = READ_LENGTH;
        detail = PyLong_FromLongLong(columns[i].length);
        break;
      }
      continue;
    }
    if (PyErr_Occurred()) PyErr_Clear(); /* read_cupy's: the interface says what the array is */
    PyObject *cai = PyObject_GetAttr(value, keys[K_CAI]);
    if (cai == NULL) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        Py_DECREF(facts);
        return NULL;
      }
      PyErr_Clear();
      reason = READ_NO_INTERFACE;
      break;
    }
    PyObject *borrowed = NULL;
    reason = read_one(cai, &columns[i], &borrowed);
    if (PyErr_Occurred()) PyErr_Clear();
    Py_XINCREF(borrowed);
    detail = borrowed;
    Py_DECREF(cai);
    if (reason == READ_OK && columns[i].length != columns[0].length) {
      reason = READ_LENGTH;
      detail = PyLong_FromLongLong(columns[i].length);
    }
    if (reason != READ_OK) break;
    Py_CLEAR(detail);
  }
  if (i < n) memset(&columns[i], 0, (size_t)(n - i) * sizeof(aib_cuda_column)); /* a column half read */
  return Py_BuildValue("(nNiN)", i, facts, reason, detail != NULL ? detail : Py_NewRef(Py_None));
}

static PyMethodDef read_function = {
    "read_cuda_columns", read_cuda_columns, METH_VARARGS,
    "read_cuda_columns(values, n, cupy_type) -> (how many leading columns were read, their facts, why the "
    "next was not, the offending value or None)"};

/* The interned names and the typestr table; 0, or -1 with a Python exception set. */
static int make_keys(void) {
  for (int k = 0; k < N_KEYS; k++)
    if (keys[k] == NULL && (keys[k] = PyUnicode_InternFromString(key_names[k])) == NULL) return -1;
  if (codes_by_typestr != NULL) return 0;
  PyObject *table = PyDict_New();
  if (table == NULL) return -1;
  for (uint32_t k = 0; k < N_TYPES; k++) {
    char text[4] = {'<', typestrs[k][0], typestrs[k][1], 0};
    PyObject *code = PyLong_FromLong((long)k);
    int rc = code == NULL ? -1 : PyDict_SetItemString(table, text, code);
    if (rc == 0) { /* '|' (no byte order): what NumPy writes for one-byte types */
      text[0] = '|';
      rc = PyDict_SetItemString(table, text, code);
    }
    Py_XDECREF(code);
    if (rc != 0) {
      Py_DECREF(table);
      return -1;
    }
  }
  codes_by_typestr = table;
  return 0;
}

int aib_py_install_columns(const char *module_name) {
  PyGILState_STATE gil = PyGILState_Ensure();
  int rc = -1;
  PyObject *module = make_keys() == 0 ? PyImport_ImportModule(module_name) : NULL;
  PyObject *f = module ? PyCFunction_NewEx(&read_function, NULL, NULL) : NULL;
  if (f != NULL) rc = PyObject_SetAttrString(module, "read_cuda_columns", f);
  if (rc < 0) PyErr_WriteUnraisable(NULL);
  Py_XDECREF(f);
  Py_XDECREF(module);
  PyGILState_Release(gil);
  return rc;
}
