"""Loading checkpoint files without running arbitrary pickled code.

`torch.load(weights_only=True)` refuses every class it does not know. Megatron-LM pickles its `args`
(an argparse Namespace of plain values, dtypes and framework enums) and numpy RNG states; DeepSpeed pickles
its loss scaler and enums. Exactly those are allowed here (SAFE_CLASSES, numpy's array and dtype types, and
Enum classes of the frameworks in FRAMEWORK_ENUM_MODULES, which can only be looked up by value); any other
class is refused with an error naming the file and the class.
"""
from __future__ import annotations

import enum
import importlib
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from trainmon.read.errors import InputError

SAFE_CLASSES = ("argparse.Namespace", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                "deepspeed.utils.tensor_fragment.fragment_address")
FRAMEWORK_ENUM_MODULES = ("megatron.", "deepspeed.", "transformer_engine.")
_NUMPY_NAMES = ("dtype", "ndarray", "_reconstruct", "scalar")
_torch_load = torch.load  # the real one, also while a framework's reader runs with `torch.load` replaced


def _resolve(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _allowed(qualified: str) -> bool:
    module, _, name = qualified.rpartition(".")
    if qualified in SAFE_CLASSES:
        return True
    if module.split(".")[0] == "numpy" and (name in _NUMPY_NAMES or module == "numpy.dtypes"):
        return True
    if module.startswith(FRAMEWORK_ENUM_MODULES):
        try:
            obj = _resolve(qualified)
        except (ImportError, AttributeError):
            return False
        return isinstance(obj, type) and issubclass(obj, enum.Enum)
    return False


def load(path: Path) -> Any:
    """The object of a `torch.save` file, tensors memory-mapped where the file format allows (zip files)."""
    path = Path(path)
    try:
        is_zip = zipfile.is_zipfile(path)
        wanted = torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) if is_zip else []
    except OSError as err:
        raise InputError.at(path, f"cannot read the file ({err.strerror or err})") from None
    except Exception as err:  # a cut-off or foreign zip
        raise InputError.at(path, f"not a readable torch checkpoint ({type(err).__name__}: {err})") from None
    refused = [name for name in wanted if not _allowed(name)]
    if refused:
        raise InputError.at(path, f"the file pickles classes that are not loaded for safety: {', '.join(refused)}")
    allowed = [_resolve(name) for name in wanted]
    if any(name.startswith("numpy") for name in wanted):  # dtype classes are built, not listed as globals
        import numpy
        allowed += [cls for cls in vars(numpy.dtypes).values() if isinstance(cls, type)]
    try:
        with torch.serialization.safe_globals(allowed):
            return _torch_load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, ImportError, AttributeError) as err:
        text = str(err).split("WeightsUnpickler error:")[-1].strip()  # torch's advice to unpickle is not ours
        reason = text.splitlines()[0] if text else type(err).__name__
        raise InputError.at(path, f"not a readable torch checkpoint ({reason})") from None


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only classes under the given module prefixes (and torch's sizes and dtypes)."""

    def __init__(self, data: io.BufferedIOBase, prefixes: tuple[str, ...]):
        super().__init__(data)
        self.prefixes = prefixes

    _PLAIN = (("torch", "Size"), ("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"))

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(self.prefixes) or (module, name) in self._PLAIN or (
                module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"class {module}.{name} is not loaded for safety")
