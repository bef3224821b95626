/*
 * A stand-in libnvidia-ml.so.1 backed by nodeagent's NVML simulator.
 *
 * Every NVML entry point (generated from nvml.h into entry.c by build.py) packs its arguments as 64-bit
 * integers and calls abi_call(), which runs nodeagent.simulator.abi.bridge.dispatch(name, args) in CPython.
 * The bridge fills the caller's output structs in place (ctypes from_address) and returns an
 * nvmlReturn_t; a name the bridge does not implement answers NVML_ERROR_NOT_SUPPORTED.
 *
 * CPython is reached without linking against it: in a process that already runs Python (pynvml over
 * ctypes) its symbols are found in the global scope and the call takes the GIL; in any other process
 * (Go, C) libpython is dlopen()ed and an interpreter is started once, without signal handlers.
 *
 * Environment:
 *   NODEAGENT_NVML_LIBPYTHON   libpython to load in a non-Python process (default: the one built against)
 *   NODEAGENT_NVML_PYTHONHOME  its prefix (default: that interpreter's base prefix)
 *   NODEAGENT_NVML_PYTHONPATH  ':'-separated directories put first on sys.path (default: the build's)
 * The machine and state come from NODEAGENT_SIM_MACHINE / NODEAGENT_SIM_STATE (read by the bridge).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

#ifndef NODEAGENT_DEFAULT_LIBPYTHON
#define NODEAGENT_DEFAULT_LIBPYTHON "libpython3.11.so.1.0"
#endif
#ifndef NODEAGENT_DEFAULT_PYTHONHOME
#define NODEAGENT_DEFAULT_PYTHONHOME ""
#endif
#ifndef NODEAGENT_DEFAULT_PYTHONPATH
#define NODEAGENT_DEFAULT_PYTHONPATH ""
#endif

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_LIBRARY_NOT_FOUND 12
#define NVML_ERROR_UNKNOWN 999

typedef struct _object PyObject;
typedef int PyGILState_STATE;

static struct {
    int (*IsInitialized)(void);
    void (*InitializeEx)(int);
    void (*SetPythonHome)(const wchar_t *);
    wchar_t *(*DecodeLocale)(const char *, size_t *);
    PyGILState_STATE (*GILEnsure)(void);
    void (*GILRelease)(PyGILState_STATE);
    void *(*SaveThread)(void);
    PyObject *(*ImportModule)(const char *);
    PyObject *(*GetAttrString)(PyObject *, const char *);
    PyObject *(*CallObject)(PyObject *, PyObject *);
    PyObject *(*TupleNew)(long);
    int (*TupleSetItem)(PyObject *, long, PyObject *);
    PyObject *(*LongFromULL)(unsigned long long);
    PyObject *(*UnicodeFromString)(const char *);
    long (*LongAsLong)(PyObject *);
    void (*DecRef)(PyObject *);
    void (*ErrPrint)(void);
    PyObject *(*ErrOccurred)(void);
    void (*ErrClear)(void);
    int (*RunSimpleString)(const char *);
} py;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int ready;             /* 1 when the bridge's dispatch is callable */
static PyObject *dispatch_fn; /* nodeagent.simulator.abi.bridge.dispatch */

static void *sym(void *lib, const char *name, int *missing) {
    void *p = dlsym(lib, name);
    if (p == NULL) {
        fprintf(stderr, "libnvidia-ml (nodeagent stand-in): python symbol %s not found\n", name);
        *missing = 1;
    }
    return p;
}

static int bind_python(void *lib) {
    int missing = 0;
    *(void **)&py.IsInitialized = sym(lib, "Py_IsInitialized", &missing);
    *(void **)&py.InitializeEx = sym(lib, "Py_InitializeEx", &missing);
    *(void **)&py.SetPythonHome = sym(lib, "Py_SetPythonHome", &missing);
    *(void **)&py.DecodeLocale = sym(lib, "Py_DecodeLocale", &missing);
    *(void **)&py.GILEnsure = sym(lib, "PyGILState_Ensure", &missing);
    *(void **)&py.GILRelease = sym(lib, "PyGILState_Release", &missing);
    *(void **)&py.SaveThread = sym(lib, "PyEval_SaveThread", &missing);
    *(void **)&py.ImportModule = sym(lib, "PyImport_ImportModule", &missing);
    *(void **)&py.GetAttrString = sym(lib, "PyObject_GetAttrString", &missing);
    *(void **)&py.CallObject = sym(lib, "PyObject_CallObject", &missing);
    *(void **)&py.TupleNew = sym(lib, "PyTuple_New", &missing);
    *(void **)&py.TupleSetItem = sym(lib, "PyTuple_SetItem", &missing);
    *(void **)&py.LongFromULL = sym(lib, "PyLong_FromUnsignedLongLong", &missing);
    *(void **)&py.UnicodeFromString = sym(lib, "PyUnicode_FromString", &missing);
    *(void **)&py.LongAsLong = sym(lib, "PyLong_AsLong", &missing);
    *(void **)&py.DecRef = sym(lib, "Py_DecRef", &missing);
    *(void **)&py.ErrPrint = sym(lib, "PyErr_Print", &missing);
    *(void **)&py.ErrOccurred = sym(lib, "PyErr_Occurred", &missing);
    *(void **)&py.ErrClear = sym(lib, "PyErr_Clear", &missing);
    *(void **)&py.RunSimpleString = sym(lib, "PyRun_SimpleString", &missing);
    return missing ? -1 : 0;
}

/* sys.path[0:0] = [dirs of NODEAGENT_NVML_PYTHONPATH]; the value is passed through an env-free literal. */
static void extend_sys_path(const char *paths) {
    if (paths == NULL || *paths == '\0')
        return;
    size_t n = strlen(paths);
    char *code = malloc(n * 2 + 128);
    if (code == NULL)
        return;
    char *q = code + sprintf(code, "import sys\nsys.path[0:0] = [p for p in '");
    for (const char *p = paths; *p; p++) {
        if (*p == '\'' || *p == '\\')
            *q++ = '\\';
        *q++ = *p;
    }
    strcpy(q, "'.split(':') if p]\n");
    py.RunSimpleString(code);
    free(code);
}

static void start(void) {
    void *self = dlopen(NULL, RTLD_NOW);
    int embedded = 0;
    if (self != NULL && dlsym(RTLD_DEFAULT, "Py_IsInitialized") != NULL && bind_python(RTLD_DEFAULT) == 0 &&
        py.IsInitialized()) {
        embedded = 0; /* loaded into a running Python (pynvml over ctypes) */
    } else {
        const char *libpath = getenv("NODEAGENT_NVML_LIBPYTHON");
        int default_lib = libpath == NULL || *libpath == '\0';
        if (default_lib)
            libpath = NODEAGENT_DEFAULT_LIBPYTHON;
        void *lib = dlopen(libpath, RTLD_NOW | RTLD_GLOBAL);
        if (lib == NULL) {
            fprintf(stderr, "libnvidia-ml (nodeagent stand-in): cannot load %s: %s\n", libpath, dlerror());
            return;
        }
        if (bind_python(lib) != 0)
            return;
        if (!py.IsInitialized()) {
            const char *home = getenv("NODEAGENT_NVML_PYTHONHOME");
            if ((home == NULL || *home == '\0') && default_lib)
                home = NODEAGENT_DEFAULT_PYTHONHOME;
            if (home != NULL && *home != '\0') {
                /* Py_SetPythonHome keeps the pointer: the string is never freed */
                wchar_t *whome = py.DecodeLocale(home, NULL);
                if (whome != NULL)
                    py.SetPythonHome(whome);
            }
            py.InitializeEx(0); /* 0: leave the host process's signal handlers alone */
            embedded = 1;
        }
    }
    PyGILState_STATE g = py.GILEnsure();
    if (embedded) {
        const char *paths = getenv("NODEAGENT_NVML_PYTHONPATH");
        extend_sys_path(paths != NULL && *paths != '\0' ? paths : NODEAGENT_DEFAULT_PYTHONPATH);
    }
    PyObject *mod = py.ImportModule("nodeagent.simulator.abi.bridge");
    if (mod != NULL) {
        dispatch_fn = py.GetAttrString(mod, "dispatch");
        py.DecRef(mod);
    }
    if (dispatch_fn == NULL) {
        fprintf(stderr, "libnvidia-ml (nodeagent stand-in): cannot import nodeagent.simulator.abi.bridge "
                        "(set NODEAGENT_NVML_PYTHONPATH)\n");
        if (py.ErrOccurred())
            py.ErrPrint();
    } else {
        ready = 1;
    }
    py.GILRelease(g);
    if (embedded)
        py.SaveThread(); /* the interpreter was started on this thread: let every thread take the GIL */
}

/* Called by every generated entry point. cache: per-function flag, 0 unknown, 1 served, 2 unsupported. */
int nodeagent_abi_call(const char *name, int *cache, int nargs, const unsigned long long *args) {
    if (*cache == 2)
        return NVML_ERROR_NOT_SUPPORTED;
    pthread_once(&once, start);
    if (!ready)
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    PyGILState_STATE g = py.GILEnsure();
    int rc = NVML_ERROR_UNKNOWN;
    PyObject *tuple = py.TupleNew(nargs);
    PyObject *call = py.TupleNew(2);
    if (tuple != NULL && call != NULL) {
        int ok = 1;
        for (int i = 0; i < nargs && ok; i++) {
            PyObject *v = py.LongFromULL(args[i]);
            ok = v != NULL && py.TupleSetItem(tuple, i, v) == 0;
        }
        PyObject *pname = ok ? py.UnicodeFromString(name) : NULL;
        if (pname != NULL) {
            py.TupleSetItem(call, 0, pname);
            py.TupleSetItem(call, 1, tuple);
            tuple = NULL; /* now owned by call */
            PyObject *res = py.CallObject(dispatch_fn, call);
            if (res != NULL) {
                rc = (int)py.LongAsLong(res);
                py.DecRef(res);
            }
        }
    }
    if (py.ErrOccurred()) {
        py.ErrPrint();
        rc = NVML_ERROR_UNKNOWN;
    }
    if (tuple != NULL)
        py.DecRef(tuple);
    if (call != NULL)
        py.DecRef(call);
    py.GILRelease(g);
    if (rc == -1) { /* the bridge has no such function */
        *cache = 2;
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else {
        *cache = 1;
    }
    return rc;
}

const char *nvmlErrorString(int result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt received by IRQ";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "Operating System Error";
    case 18: return "RM has detected an NVML/RM version mismatch";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Insufficient resources for request";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not Ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 30: return "Reset type not supported";
    default: return "Unknown Error";
    }
}
