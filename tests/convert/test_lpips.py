"""attnjax.convert.lpips: torchvision / lpips key layouts, and the command line that writes the
converted file, checked against the ``lpips`` package's own LPIPS."""

import contextlib
import io
import os
import pathlib
import subprocess
import sys
import types

import chex
import jax.numpy as jnp
import lpips as torch_lpips
import numpy as np
import pytest
import safetensors.torch
import torch
import torchvision
from helpers import assert_close, lpips_distance

from attnjax.convert import lpips as convert_lpips
from attnjax.convert.lpips import lpips_from_torch
from attnjax.models import lpips

REPO = pathlib.Path(__file__).resolve().parents[2]
SHIPPED_LINEAR = os.path.join(os.path.dirname(torch_lpips.__file__), "weights", "v0.1", "vgg.pth")


def _image_pair(seed, size=16):
    rng = np.random.default_rng(seed)
    return tuple(rng.uniform(-1, 1, (2, size, size, 3)).astype(np.float32) for _ in range(2))


def _torchvision_trunk(reference) -> dict:
    """The reference's VGG16 trunk under torchvision's ``features.N`` keys, as a download has
    them."""
    return {
        f"features.{name}": tensor
        for k in range(1, 6)
        for name, tensor in getattr(reference.net, f"slice{k}").state_dict().items()
    }


def test_converter_reads_torchvision_vgg16_and_shipped_linear_weights(lpips_reference):
    """The documented path: torchvision's vgg16 state dict + lpips/weights/v0.1/vgg.pth."""
    reference = lpips_reference
    with torch.device("meta"):  # key names only: the download's structure without its memory
        vgg = torchvision.models.vgg16()
    trunk = _torchvision_trunk(reference)
    assert set(trunk) == {k for k in vgg.state_dict() if k.startswith("features.")}
    classifier = {k: torch.zeros(1) for k in vgg.state_dict() if k.startswith("classifier.")}
    model, variables = lpips_from_torch({**trunk, **classifier}, SHIPPED_LINEAR)
    a, b = _image_pair(1)
    assert_close(
        model.apply(variables, jnp.asarray(a), jnp.asarray(b)),
        lpips_distance(reference, a, b),
        what="LPIPS via torchvision keys",
    )
    _, from_whole = lpips_from_torch(reference.state_dict())
    chex.assert_trees_all_close(variables, from_whole, rtol=0, atol=0)


def test_missing_parts_raise(lpips_reference):
    reference = lpips_reference
    with pytest.raises(KeyError, match="13 VGG16 convs"):
        lpips_from_torch({"features.0.weight": np.zeros((64, 3, 3, 3))})
    with pytest.raises(KeyError, match="no 'lin0.model.1.weight'"):
        lpips_from_torch(_torchvision_trunk(reference))
    with pytest.raises(ValueError, match=r"keys not converted .*'features.0.gamma'"):
        lpips_from_torch(
            {**_torchvision_trunk(reference), "features.0.gamma": torch.zeros(3)}, SHIPPED_LINEAR
        )


def _convert_in_a_subprocess(*args):
    """``python -m attnjax.convert.lpips ARGS``, the command as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "attnjax.convert.lpips", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _convert(*args):
    """The command's ``main`` in this process (no interpreter start-up): exit code and output."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        returncode = convert_lpips.main(list(map(str, args)))
    return types.SimpleNamespace(
        returncode=returncode, stdout=stdout.getvalue(), stderr=stderr.getvalue()
    )


def test_command_line_round_trip(tmp_path, lpips_reference):
    reference = lpips_reference
    vgg_path = tmp_path / "vgg16.safetensors"
    safetensors.torch.save_file(_torchvision_trunk(reference), str(vgg_path))
    out = tmp_path / "lpips_vgg.npz"
    result = _convert_in_a_subprocess(vgg_path, SHIPPED_LINEAR, out)
    assert result.returncode == 0, result.stderr
    variables = lpips.load_variables(out)
    a, b = _image_pair(2)
    assert_close(
        lpips.LPIPS().apply(variables, jnp.asarray(a), jnp.asarray(b)),
        lpips_distance(reference, a, b),
        rtol=1e-5,
        what="LPIPS from the converted file",
    )

    whole = tmp_path / "lpips_whole.pth"
    torch.save(reference.state_dict(), whole)
    result = _convert(whole, out)  # no linear file: the whole LPIPS state dict holds lin*
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"OUT {str(out)!r} exists; pass --force" in result.stderr
    assert _convert(whole, out, "--force").returncode == 0
    chex.assert_trees_all_close(lpips.load_variables(out), variables, rtol=0, atol=0)


def test_command_line_bad_inputs_leave_nothing_behind(tmp_path, lpips_reference):
    reference = lpips_reference
    out = tmp_path / "out.npz"
    missing = _convert(tmp_path / "missing.pth", SHIPPED_LINEAR, out)
    assert (
        missing.returncode == 2
        and "no weights file at" in missing.stderr
        and missing.stderr.count("\n") == 1
    )
    trunk_only = tmp_path / "trunk.pth"
    torch.save(_torchvision_trunk(reference), trunk_only)
    no_linear = _convert(trunk_only, out)
    assert no_linear.returncode == 2 and "no 'lin0.model.1.weight'" in no_linear.stderr
    wrong_suffix = _convert(trunk_only, SHIPPED_LINEAR, tmp_path / "out.bin")
    assert wrong_suffix.returncode == 2 and "OUT must end in .npz" in wrong_suffix.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trunk.pth"]
