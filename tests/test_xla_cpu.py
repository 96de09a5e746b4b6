"""attnjax.xla_cpu: the flags reach XLA before its backend starts, in a fresh process as a user's
would start, and the user's own ``$XLA_FLAGS`` win."""

import json
import os
import subprocess
import sys

import pytest

from attnjax import compat, xla_cpu

# A fresh process that imports jax first (as a user's script does), then attnjax, then compiles a
# VQGAN-sized convolution: the compiled program says whether XLA sent it to YNNPACK.
PROBE = r"""
import json, os
import jax, jax.numpy as jnp
from jax import lax
import attnjax
conv = lambda x, w: lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
text = jax.jit(conv).lower(jnp.ones((2, 8, 8, 64)), jnp.ones((3, 3, 64, 64))).compile().as_text()
print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "ynn": "__ynn_fusion" in text}))
"""


def probe(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_cpu.SWITCH)}
    run = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**base, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_merged_keeps_the_users_value_of_a_flag():
    flags = ["--xla_cpu_experimental_ynn_fusion_type=reduce", "--xla_cpu_enable_fast_math=false"]
    user = "--xla_cpu_experimental_ynn_fusion_type= --xla_force_host_platform_device_count=2"
    assert xla_cpu.merged(user, flags).split() == [*user.split(), flags[1]]
    assert xla_cpu.merged("", flags).split() == flags


@pytest.mark.xdist_group("xla_cpu_probe")
def test_the_flags_reach_xla_and_the_users_own_win():
    speed = compat.xla_cpu_speed_flags()
    ours = probe()
    assert ours["xla_flags"].split() == speed
    # The measured rule on every supported jaxlib: convolutions stay on XLA's own threaded path.
    assert not ours["ynn"], "attnjax's flags left the convolution to YNNPACK"
    user = "--xla_cpu_experimental_ynn_fusion_type=individual_convolution"
    theirs = probe(XLA_FLAGS=user)
    # Their value of the flag they set, ours of the others.
    others = [f for f in speed if not f.startswith(user.split("=")[0] + "=")]
    assert theirs == {"xla_flags": " ".join([user, *others]), "ynn": True}
    off = probe(**{xla_cpu.SWITCH: "0"})
    assert off["xla_flags"] == ""
