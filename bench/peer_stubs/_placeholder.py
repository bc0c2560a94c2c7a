"""The placeholder packages of bench/peer_stubs (README there): a package and any of its
submodules import, and every name in them is a placeholder that fails when called."""

import importlib.abc
import importlib.machinery
import sys
import types


class Missing:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a placeholder in the GPU check (bench/peer_stubs)")

    def __getattr__(self, name: str):
        return Missing(f"{self._name}.{name}")

    def __getitem__(self, item):  # used in type annotations: X[Y], X | Y
        return self

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases):
        return (object,)


def fill(module: types.ModuleType) -> None:
    """Make every missing attribute of `module` a placeholder."""
    def getattr_(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module.__name__}.{name}")
    module.__getattr__ = getattr_


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots and "." in fullname:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        fill(module)


def install(root: str) -> None:
    for f in sys.meta_path:
        if isinstance(f, Finder):
            f.roots.add(root)
            return
    sys.meta_path.insert(0, Finder([root]))
