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


class _DeferredModule(types.ModuleType):
    """Stands in for a module nobody has used yet; the first use of any of its names imports the real one.

    Names listed as ``callables`` are handed out as small forwarding functions, so that a
    ``from module import Name`` at import time does not itself pull the module in."""

    def __init__(self, name: str, group: tuple[str, ...], callables: tuple[str, ...]) -> None:
        super().__init__(name)
        self.__dict__["_deferred_group"] = group
        self.__dict__["_deferred_callables"] = callables

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in self.__dict__["_deferred_callables"]:
            module_name = self.__name__

            def forward(*args: Any, **kwargs: Any) -> Any:
                return getattr(_realize(module_name), attr)(*args, **kwargs)

            forward.__name__ = attr
            forward.__qualname__ = f"{module_name}.{attr}"
            return forward
        return getattr(_realize(self.__name__), attr)


def _realize(name: str) -> types.ModuleType:
    """Replace the stand-ins of ``name``'s group by the real modules and return the real ``name``."""
    with _lock:
        stub = sys.modules.get(name)
        if isinstance(stub, _DeferredModule):
            group = stub.__dict__["_deferred_group"]
            for member in group:
                if isinstance(sys.modules.get(member), _DeferredModule):
                    del sys.modules[member]
            for member in sorted(group):
                importlib.import_module(member)
        return importlib.import_module(name)


def defer_modules(modules: dict[str, tuple[str, ...]]) -> None:
    """Register stand-ins for ``modules`` (name → names to hand out as forwarding callables) that are not
    imported yet. For dependencies that a library imports at its top but uses only on a rare path (the
    kubernetes kubeconfig loader imports ``requests_oauthlib`` and ``oauthlib`` for OIDC token refresh):
    they are imported for real the first time one of their names is used, and never otherwise."""
    with _lock:
        group = tuple(name for name in modules if name not in sys.modules)
        for name in group:
            sys.modules[name] = _DeferredModule(name, group, modules[name])
