/* Reading 1-D GPU arrays' __cuda_array_interface__ for from_cuda_arrays, in one call for all columns.
 *
 * What a column needs (data pointer, length, numeric type, announced stream) is read from each
 * array's interface dict here, with the GIL held (a builtin function, installed like py_capsules.c's:
 * aib_py_install_columns), instead of a dozen dict look-ups per column in Python. A column this
 * reader cannot take — no interface (a DLPack-only producer), a shape, type, stride or mask a plain
 * Arrow column cannot show, a length different from the first column's — stops it: the caller's
 * Python path handles that column and every later one, and raises the documented errors. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include <string.h>

#include "internal.h"

/* The numeric types in the order of device.py's _NUMERIC_TYPES (the format codes of aib_columns_build). */
static const char *const typestrs[] = {"i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"};
static const int64_t itemsizes[] = {1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8};
#define N_TYPES (sizeof(typestrs) / sizeof(typestrs[0]))

/* Borrowed item of a dict; NULL when absent (no exception set either way). */
static PyObject *item(PyObject *dict, const char *key) {
  PyObject *value = PyDict_GetItemString(dict, key);
  return value;
}

static int absent_or_none(PyObject *dict, const char *key) {
  PyObject *value = item(dict, key);
  return value == NULL || value == Py_None;
}

/* A typestr's column code (the index in typestrs), or N_TYPES for any other. */
static uint32_t code_of(PyObject *typestr) {
  if (typestr == NULL || !PyUnicode_Check(typestr)) return N_TYPES;
  PyObject *encoded = PyUnicode_AsUTF8String(typestr);
  if (encoded == NULL) return N_TYPES;
  const char *text = PyBytes_AsString(encoded);
  uint32_t code = N_TYPES;
  if (text != NULL && strlen(text) == 3 && (text[0] == '<' || text[0] == '|'))
    for (uint32_t k = 0; k < N_TYPES; k++)
      if (strcmp(text + 1, typestrs[k]) == 0) code = k;
  Py_DECREF(encoded);
  return code;
}

/* 0 and *out filled, or -1 (with any Python exception cleared) when the dict is not a plain column. */
static int read_one(PyObject *cai, aib_cuda_column *out) {
  if (!PyDict_Check(cai)) return -1;
  PyObject *shape = item(cai, "shape");
  if (shape == NULL || !PyTuple_Check(shape) || PyTuple_Size(shape) != 1) return -1;
  long long length = PyLong_AsLongLong(PyTuple_GetItem(shape, 0));
  if (length < 0) return -1;
  uint32_t code = code_of(item(cai, "typestr"));
  if (code == N_TYPES) return -1;
  PyObject *strides = item(cai, "strides");
  if (strides != NULL && strides != Py_None) {
    if (!PyTuple_Check(strides) || PyTuple_Size(strides) != 1) return -1;
    if (PyLong_AsLongLong(PyTuple_GetItem(strides, 0)) != itemsizes[code]) return -1;
  }
  if (!absent_or_none(cai, "mask")) return -1;
  PyObject *data = item(cai, "data");
  if (data == NULL || !PyTuple_Check(data) || PyTuple_Size(data) < 1) return -1;
  unsigned long long pointer = PyLong_AsUnsignedLongLong(PyTuple_GetItem(data, 0));
  if (PyErr_Occurred()) return -1;
  PyObject *stream = item(cai, "stream");
  long long stream_value = 0;
  if (stream != NULL && stream != Py_None) {
    stream_value = PyLong_AsLongLong(stream);
    if (PyErr_Occurred()) return -1;
  }
  out->data = pointer;
  out->length = length;
  out->stream = stream_value;
  out->code = code;
  return 0;
}

/* An attribute as a C integer; -1 (exception cleared) when absent or not an integer. */
static long long int_attr(PyObject *obj, const char *name) {
  PyObject *value = PyObject_GetAttrString(obj, name);
  if (value == NULL) return -1;
  long long result = PyLong_Check(value) ? PyLong_AsLongLong(value) : -1;
  Py_DECREF(value);
  return result;
}

/* A CuPy ndarray's column facts from its own attributes, what its __cuda_array_interface__ is
 * built from (ndim, size, _c_contiguous, dtype.str, data.ptr; ptr 0 when empty) without building
 * the interface dict and its dtype description (about 2.5 us per array). The stream is not a fact
 * of the array: CuPy's interface reports the current stream, which is the first column's (read
 * through its interface in the same call). 0, or -1 (exception cleared) to take the interface. */
static int read_cupy(PyObject *obj, int64_t stream, aib_cuda_column *out) {
  if (int_attr(obj, "ndim") != 1) return -1;
  long long length = int_attr(obj, "size");
  if (length < 0) return -1;
  PyObject *contiguous = PyObject_GetAttrString(obj, "_c_contiguous");
  int is_contiguous = contiguous == Py_True;
  Py_XDECREF(contiguous);
  if (!is_contiguous) return -1;
  PyObject *dtype = PyObject_GetAttrString(obj, "dtype");
  PyObject *typestr = dtype ? PyObject_GetAttrString(dtype, "str") : NULL;
  uint32_t code = code_of(typestr);
  Py_XDECREF(typestr);
  Py_XDECREF(dtype);
  if (code == N_TYPES) return -1;
  unsigned long long pointer = 0;
  if (length > 0) {
    PyObject *data = PyObject_GetAttrString(obj, "data");
    PyObject *ptr = data ? PyObject_GetAttrString(data, "ptr") : NULL;
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

/* read_cuda_columns(values, address, n, cupy_type) -> how many leading columns were read into the
 * aib_cuda_column[n] at address (n: all of them). values: a list of n arrays. cupy_type: CuPy's
 * ndarray type when the caller found the first value to be one (its later values of exactly that
 * type are read by read_cupy), else None. */
static PyObject *read_cuda_columns(PyObject *self, PyObject *args) {
  PyObject *values, *cupy_type;
  unsigned long long address;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "OKnO", &values, &address, &n, &cupy_type)) return NULL;
  if (!PyList_Check(values) || PyList_Size(values) != n || address == 0) {
    PyErr_SetString(PyExc_ValueError, "read_cuda_columns needs a list of n values and an address");
    return NULL;
  }
  aib_cuda_column *columns = (aib_cuda_column *)(uintptr_t)address;
  Py_ssize_t i = 0;
  for (; i < n; i++) {
    PyObject *value = PyList_GetItem(values, i);
    if (i > 0 && cupy_type != Py_None && (PyObject *)Py_TYPE(value) == cupy_type &&
        read_cupy(value, columns[0].stream, &columns[i]) == 0) {
      if (columns[i].length != columns[0].length) break;
      continue;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    PyObject *cai = PyObject_GetAttrString(value, "__cuda_array_interface__");
    if (cai == NULL) break;
    int rc = read_one(cai, &columns[i]);
    Py_DECREF(cai);
    if (rc != 0 || columns[i].length != columns[0].length) break;
  }
  if (PyErr_Occurred()) PyErr_Clear(); /* the Python path meets the same problem and says what it is */
  return PyLong_FromSsize_t(i);
}

static PyMethodDef read_function = {
    "read_cuda_columns", read_cuda_columns, METH_VARARGS,
    "read_cuda_columns(values, address, n, cupy_type) -> how many leading columns were read"};

int aib_py_install_columns(const char *module_name) {
  PyGILState_STATE gil = PyGILState_Ensure();
  int rc = -1;
  PyObject *module = PyImport_ImportModule(module_name);
  PyObject *f = module ? PyCFunction_NewEx(&read_function, NULL, NULL) : NULL;
  if (f != NULL) rc = PyObject_SetAttrString(module, "read_cuda_columns", f);
  if (rc < 0) PyErr_WriteUnraisable(NULL);
  Py_XDECREF(f);
  Py_XDECREF(module);
  PyGILState_Release(gil);
  return rc;
}
