"""One ml_collections config file per model and dataset, each with a ``get_config()``;
``load`` reads one by name (``configs.load("vit_digits")``) or by a file's path."""

import importlib
import importlib.util
import pathlib

import ml_collections


def load(name_or_path: str) -> ml_collections.ConfigDict:
    """``get_config()`` of ``configs/<name>.py``, or of the file at a path ending in ``.py``."""
    if not name_or_path.endswith(".py"):
        return importlib.import_module(f"{__name__}.{name_or_path}").get_config()
    path = pathlib.Path(name_or_path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()
