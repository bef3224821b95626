"""Import a submodule of a third-party package without running the package's own ``__init__``.

Some dependencies import everything they offer from their top-level ``__init__`` (pyroute2 loads every
netlink family, ``kubernetes`` loads its dynamic client, informers, leader election and a websocket
client), which a long-running agent then keeps resident although it uses one corner of the package.

``package_on_demand(name)`` registers the package in ``sys.modules`` from its import spec *without*
executing its ``__init__``, so ``import name.sub`` loads just ``sub`` and what ``sub`` imports itself.
The package is not crippled: asking it for any name that is not a submodule (a class the ``__init__``
re-exports, ``__version__``) first runs the real ``__init__`` in place (a PEP 562 module ``__getattr__``),
leaving the package exactly as a normal import would. If the package is already imported this does
nothing. Callers fall back to the normal import when the submodule layout differs (``ImportError``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

_lock = threading.RLock()


def package_on_demand(name: str) -> types.ModuleType:
    """The package ``name`` registered without running its ``__init__`` (or as already imported)."""
    with _lock:
        existing = sys.modules.get(name)
        if existing is not None:
            return existing
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not an importable package", name=name)
        loader = spec.loader
        module = importlib.util.module_from_spec(spec)

        def __getattr__(attr: str) -> Any:
            if attr.startswith("__") and attr not in ("__version__", "__all__"):
                raise AttributeError(attr)
            if importlib.util.find_spec(f"{name}.{attr}") is not None:
                return importlib.import_module(f"{name}.{attr}")
            with _lock:  # complete the package once: run its real __init__ in this module object
                if module.__dict__.pop("__getattr__", None) is not None:
                    loader.exec_module(module)
            return getattr(module, attr)

        module.__dict__["__getattr__"] = __getattr__
        sys.modules[name] = module
        return module


def lean_import(package: str, submodule: str) -> types.ModuleType:
    """``package.submodule`` imported with ``package_on_demand``; on a layout this does not fit, the stub is
    withdrawn (with whatever it pulled in) and the ordinary import runs instead."""
    with _lock:
        before = set(sys.modules)
        try:
            package_on_demand(package)
            return importlib.import_module(f"{package}.{submodule}")
        except ImportError:
            if package in before:
                raise
            for mod in set(sys.modules) - before:
                if mod == package or mod.startswith(package + "."):
                    del sys.modules[mod]
    return importlib.import_module(f"{package}.{submodule}")
