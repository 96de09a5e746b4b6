"""Your own images as the two splits of a dataset: a folder tree or taming's file lists.

``config.data.name`` says where they are:

- ``folder:ROOT``, one of three layouts:

  - ``ROOT/<split>/<class>/...`` (torchvision's ``ImageFolder`` per split): a folder per split
    named as ``config.data.train_split`` and ``eval_split``, each holding the same class folders;
  - ``ROOT/<class>/...``: one tree, a fixed share of it held out for evaluation;
  - ``ROOT/*.jpg``: a flat folder of unlabelled images (label 0), a share held out likewise.

  A class folder's images may lie at any depth below it. Class names are the folder names,
  sorted: label ``i`` is the ``i``-th.
- ``filelist:LISTS``, ``LISTS`` a path with ``{split}`` in it (``filelist:data/{split}.txt``):
  one text file per split, one image path a line (relative paths start at the list's folder),
  optionally a tab and a class name after it; ``#`` starts a comment line.

The held-out share: a file is held out when a hash of ``(holdout_seed, its path below ROOT)`` falls
below ``holdout_fraction``, so the split of a file never changes when files are added, removed or
renamed elsewhere in the tree. Within a split, images are in the order of their file names (then
their paths), so a folder written with numbered files reads back in that order. Image files are
those with torchvision's extensions (``attnjax.data.decode.IMAGE_EXTENSIONS``); other files and
hidden folders are passed over. Nothing is ever written into ``ROOT``.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from attnjax.data.decode import IMAGE_EXTENSIONS, is_image_file
from attnjax.data.files import ImageList

KINDS = ("folder", "filelist")
# configs/common.py's data.train_split, eval_split, holdout_fraction and holdout_seed: what a run
# that left them alone held out.
SPLITS = ("train", "test")
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0


def held_out_share(name: str, seed: int) -> float:
    """A number in [0, 1) that depends only on ``seed`` and the file's path ``name``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def _image_names(directory: str) -> list[str]:
    """Image files below ``directory`` (any depth, links followed), as paths relative to it."""
    names = []
    for parent, folders, files in os.walk(directory, followlinks=True):
        folders[:] = [folder for folder in folders if not folder.startswith(".")]
        relative = os.path.relpath(parent, directory)
        for file in files:
            if is_image_file(file):
                names.append(file if relative == "." else f"{relative}/{file}".replace(os.sep, "/"))
    return names


def images_below(directory: str) -> list[str]:
    """The image files below ``directory`` (any depth, hidden folders passed over) as paths
    relative to it, sorted by path; a one-line ``ValueError`` when it is no folder or has none."""
    directory = os.path.expanduser(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r}: no such folder; expected a folder of images")
    names = sorted(_image_names(directory))
    if not names:
        raise ValueError(_no_images(directory))
    return names


def _in_name_order(names: list[str]) -> list[str]:
    return sorted(names, key=lambda name: (name.rsplit("/", 1)[-1], name))


def _no_images(directory: str) -> str:
    return f"{directory!r} holds no image files; expected *{', *'.join(IMAGE_EXTENSIONS)}"


def _labelled(directory: str) -> tuple[list[str], list[str], tuple[str, ...]]:
    """``(names relative to directory, class of each, classes)`` of a class tree or a flat
    folder (classes ``()``)."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r}: no such folder; expected a folder of images")
    entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    direct = [e.name for e in entries if not e.is_dir() and is_image_file(e.name)]
    folders = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    per_class = {folder: _image_names(os.path.join(directory, folder)) for folder in folders}
    classes = tuple(folder for folder in folders if per_class[folder])
    if direct and classes:
        raise ValueError(
            f"{directory!r} holds both image files ({direct[0]!r}, ...) and class folders "
            f"({classes[0]!r}, ...); expected one or the other"
        )
    if direct:
        return _in_name_order(direct), [""] * len(direct), ()
    if not classes:
        raise ValueError(_no_images(directory))
    names, labels = [], []
    for folder in classes:
        names += [f"{folder}/{name}" for name in per_class[folder]]
        labels += [folder] * len(per_class[folder])
    order = sorted(range(len(names)), key=lambda i: (names[i].rsplit("/", 1)[-1], names[i]))
    return [names[i] for i in order], [labels[i] for i in order], classes


def _image_list(root, names, class_of, classes) -> ImageList:
    index = {name: i for i, name in enumerate(classes)}
    return ImageList(
        paths=[os.path.join(root, name) for name in names],
        names=list(names),
        labels=np.asarray([index.get(c, 0) for c in class_of], np.int32),
        classes=tuple(classes),
    )


def _same_classes(lists: dict[str, tuple], where: dict[str, str]) -> None:
    first, second = lists
    for have, lack in ((first, second), (second, first)):
        missing = sorted(set(lists[have][2]) - set(lists[lack][2]))
        if missing:
            raise ValueError(
                f"{where[lack]!r} has no images of class {missing[0]!r}, which "
                f"{where[have]!r} has ({len(missing)} such class(es)); expected the same classes "
                "in both splits"
            )


def _folder(root: str, splits: tuple[str, str], fraction: float, seed: int):
    if not os.path.isdir(root):
        raise ValueError(f"config.data.name: {root!r} is no folder; expected folder:ROOT")
    split_dirs = {split: os.path.join(root, split) for split in splits}
    if any(os.path.isdir(path) for path in split_dirs.values()):
        for path in split_dirs.values():
            if not os.path.isdir(path):
                raise ValueError(
                    f"{path!r}: no such folder, but {root!r} holds other split folders; expected "
                    f"one folder per split ({', '.join(splits)})"
                )
        lists = {split: _labelled(path) for split, path in split_dirs.items()}
        for split, (names, _, _) in lists.items():
            if not names:
                raise ValueError(_no_images(split_dirs[split]))
        _same_classes(lists, split_dirs)
        return {
            split: _image_list(split_dirs[split], *lists[split][:2], lists[splits[0]][2])
            for split in splits
        }
    if not 0.0 < fraction < 1.0:
        raise ValueError(
            f"config.data.holdout_fraction={fraction!r}: {root!r} holds no split folders "
            f"({', '.join(splits)}), so a share in (0, 1) of it must be held out for evaluation"
        )
    names, class_of, classes = _labelled(root)
    held = np.asarray([held_out_share(name, seed) < fraction for name in names], bool)
    result = {}
    for split, keep in zip(splits, (~held, held)):
        chosen = np.flatnonzero(keep)
        if not len(chosen):
            raise ValueError(
                f"{root!r}: holdout_fraction={fraction} of its {len(names)} images leaves the "
                f"{split!r} split empty; expected images in both splits"
            )
        result[split] = _image_list(
            root, [names[i] for i in chosen], [class_of[i] for i in chosen], classes
        )
    return result


def _read_list(path: str, split: str) -> tuple[list[str], list[str]]:
    if not os.path.isfile(path):
        raise ValueError(f"{path!r}: no such file list for split {split!r}")
    names, class_of = [], []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            line = line.rstrip("\r\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, _, label = line.partition("\t")
            names.append(name.strip())
            class_of.append(label.strip())
            if bool(class_of[0]) != bool(class_of[-1]):
                raise ValueError(
                    f"{path!r} line {number}: {line!r} has no class but line 1 has one (or the "
                    "other way round); expected a class after a tab on every line or on none"
                )
    if not names:
        raise ValueError(f"{path!r} lists no images; expected one image path a line")
    return names, class_of


def _filelist(template: str, splits: tuple[str, str]):
    if "{split}" not in template:
        raise ValueError(
            f"config.data.name='filelist:{template}' lacks '{{split}}'; expected a path with "
            "{split} where the split's name goes, e.g. filelist:data/{split}.txt"
        )
    lists, where = {}, {}
    for split in splits:
        where[split] = template.replace("{split}", split)
        names, class_of = _read_list(where[split], split)
        lists[split] = (names, class_of, tuple(sorted(set(class_of) - {""})))
    _same_classes(lists, where)
    result = {}
    for split, (names, class_of, _) in lists.items():
        base = os.path.dirname(os.path.abspath(where[split]))
        images = _image_list(base, names, class_of, lists[splits[0]][2])
        result[split] = images._replace(paths=[os.path.join(base, name) for name in names])
    return result


def list_splits(kind: str, location: str, splits: tuple[str, str], *, fraction=0.0, seed=0):
    """``{split: ImageList}`` (unchecked) of ``kind`` (``"folder"``/``"filelist"``) at
    ``location`` for ``splits`` ``(train, eval)``; a one-line ``ValueError`` for a layout that
    is not one of the module docstring's."""
    if splits[0] == splits[1]:
        raise ValueError(
            f"config.data.train_split and eval_split are both {splits[0]!r}; expected two splits"
        )
    location = os.path.expanduser(location)
    if kind == "folder":
        return _folder(location, splits, fraction, seed)
    return _filelist(location, splits)


def list_split(
    kind: str,
    location: str,
    split: str,
    *,
    splits: tuple[str, str] = SPLITS,
    fraction: float = HOLDOUT_FRACTION,
    seed: int = HOLDOUT_SEED,
) -> ImageList:
    """The ``ImageList`` (unchecked) of the one split ``split`` of ``kind`` at ``location``, the
    files training reads as that split with ``(train_split, eval_split) = splits``: a split
    folder ``ROOT/<split>`` (the other split folder need not exist), ``splits[0]`` (the kept
    share) or ``splits[1]`` (the held-out share, ``fraction`` and ``seed``) of a class tree or a
    flat folder, or the file list of ``split``; a one-line ``ValueError`` for a split that is not
    there or is empty."""
    location = os.path.expanduser(location)
    if kind == "filelist":
        if "{split}" not in location:
            raise ValueError(
                f"filelist:{location}:{split}: the list path lacks '{{split}}'; expected a path "
                "with {split} where the split's name goes, e.g. filelist:data/{split}.txt:test"
            )
        names, class_of = _read_list(location.replace("{split}", split), split)
        path = os.path.abspath(location.replace("{split}", split))
        return _image_list(os.path.dirname(path), names, class_of, sorted(set(class_of) - {""}))
    if not os.path.isdir(location):
        raise ValueError(f"{location!r}: no such folder; expected folder:ROOT:SPLIT")
    present = [name for name in dict.fromkeys((*splits, split)) if _is_dir(location, name)]
    if present:
        directory = os.path.join(location, split)
        if split not in present:
            raise ValueError(
                f"{location!r} holds split folders ({', '.join(present)}) but no {split!r}; "
                f"expected the name of one of them"
            )
        names, class_of, classes = _labelled(directory)
        return _image_list(directory, names, class_of, classes)
    if split not in splits:
        raise ValueError(
            f"{location!r} holds no split folders, so its splits are {splits[0]!r} (the kept "
            f"share) and {splits[1]!r} (holdout_fraction={fraction} of its files, holdout_seed="
            f"{seed}); got split {split!r}"
        )
    return _folder(location, splits, fraction, seed)[split]


def _is_dir(root: str, name: str) -> bool:
    return bool(name) and os.path.isdir(os.path.join(root, name))
