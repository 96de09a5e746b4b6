"""Every notebooks/*.ipynb runs top to bottom without error, so the walkthroughs cannot rot.

Each notebook executes in a temporary copy of ``notebooks/`` (outputs and figures land there, the
committed files stay untouched); the repository's other top-level entries are linked next to it
so relative paths like ``../configs`` still resolve. The kernel is this very interpreter.

A notebook that trains keeps its step count in a cell tagged ``parameters`` (papermill's
convention); the suite runs a cell after it that sets fewer steps, so every cell still runs and
the committed outputs show the full run.
"""

import json
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
KERNEL = "attnjax-tests"
# ipykernel_launcher's steps, after train.py's collector thresholds (attnjax/train/collector.py):
# the notebooks trace as much as a training run does.
KERNEL_MAIN = (
    "import sys\n"
    "if sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "from attnjax.train import collector\n"
    "collector.raise_thresholds()\n"
    "from ipykernel import kernelapp\n"
    "kernelapp.launch_new_instance()\n"
)
# Run after the notebook's ``parameters`` cell: enough steps to pass warm-up, fewer than shown.
SUITE_PARAMETERS = {"02_vit.ipynb": "STEPS = 40", "03_vqgan.ipynb": "STEPS = 24"}


@pytest.fixture
def kernel_of_this_interpreter(tmp_path_factory, monkeypatch):
    """A kernelspec that runs ``sys.executable``, found first on JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-c", KERNEL_MAIN, "-f", "{connection_file}"],
        "display_name": "attnjax tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(root))
    return KERNEL


def _workspace(tmp_path: pathlib.Path) -> pathlib.Path:
    for entry in REPO.iterdir():
        if entry.name != "notebooks" and not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    copy = tmp_path / "notebooks"
    copy.mkdir()
    for path in (REPO / "notebooks").iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    return copy


@pytest.mark.skipif(not NOTEBOOKS, reason="no notebooks yet")
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(notebook, tmp_path, kernel_of_this_interpreter):
    workdir = _workspace(tmp_path)
    nb = nbformat.read(workdir / notebook.name, as_version=4)
    if notebook.name in SUITE_PARAMETERS:
        tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{notebook.name}: expected one cell tagged 'parameters'"
        override = nbformat.v4.new_code_cell(SUITE_PARAMETERS[notebook.name])
        nb.cells.insert(tagged[0] + 1, override)
    client = NotebookClient(
        nb,
        kernel_name=kernel_of_this_interpreter,
        timeout=600,
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on the first failure
    errors = [
        output
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors, f"{notebook.name}: error outputs {errors}"
