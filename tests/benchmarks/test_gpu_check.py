"""benchmarks/gpu/check.py's dry run (the GPU check's code at tiny sizes on the CPU), its JSON
checked against references made here: rates from the recorded steps and seconds, the ViT's and
attention's FLOPs counted by hand, attention's outputs against a float64 computation of the same
inputs."""

import json
import math
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu" / "check.py"
RATE = dict(rel=1e-9)  # quantities the JSON derives from others it records


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    run = subprocess.run(
        [sys.executable, str(CHECK), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert run.returncode == 0, f"{run.stdout}{run.stderr}\n{log[-3000:]}"
    return json.loads((out / "gpu_check.json").read_text())


def test_every_part_ran_on_the_cpu(result):
    assert result["mode"] == "dry-run"
    assert result["device"]["platform"] == "cpu"
    assert {"python", "jax", "jaxlib", "flax", "numpy"} <= set(result["versions"])
    statuses = {name: part["status"] for name, part in result["parts"].items()}
    assert statuses == {
        "vit": "ok",
        "vqgan": "ok",
        "prior_sampling": "ok",
        "attention": "ok",
        "cuda_tests": "skipped",
    }, {name: part.get("error") for name, part in result["parts"].items()}
    assert all(part["seconds"] > 0 for part in result["parts"].values() if "seconds" in part)


def vit_train_flops(model) -> float:
    """2 x the multiply-adds of one image's training step: the forward (patch embedding, per
    block the q/k/v and output projections, the two attention products and the MLP, the head)
    three times (forward, input and weight gradients), less the patch embedding's input gradient
    (images are not differentiated)."""
    width, patch, image = model["width"], model["patch_size"], model["image_size"]
    patches = (image // patch) ** 2
    tokens = patches + 1  # the class token
    embed = patches * patch * patch * 3 * width
    block = tokens * (4 * width * width + 2 * width * model["mlp_dim"])
    block += 2 * tokens * tokens * width
    forward = embed + model["depth"] * block + width * model["num_classes"]
    return 2.0 * (3 * forward - embed)


def check_training(measured):
    steps, batch, seconds = measured["steps"], measured["batch_size"], measured["seconds"]
    assert measured["images_per_second"] == pytest.approx(steps * batch / seconds, **RATE)
    flops_per_second = measured["flops_per_step"] * steps / seconds
    assert measured["mfu"] == pytest.approx(flops_per_second / measured["peak_flops"], **RATE)
    assert measured["tflops_per_device"] == pytest.approx(flops_per_second / 1e12, **RATE)
    assert measured["peak_source"].startswith("measured")  # a CPU: its matrix product, timed
    assert math.isfinite(measured["loss_first"]) and math.isfinite(measured["loss_last"])


def test_vit_rate_and_mfu_follow_from_its_steps_and_the_hand_counted_flops(result):
    vit = result["parts"]["vit"]
    measured, predicted = vit["measured"], vit["predicted"]
    check_training(measured)
    per_image = vit_train_flops(vit["model"])
    assert measured["flops_per_step"] == measured["batch_size"] * per_image
    # The compile command counts the same products and divides the same (cached) CPU peak.
    assert predicted["target"] == "cpu"
    assert predicted["flops_per_example"] == per_image
    assert predicted["peak_flops_per_device"] == measured["peak_flops"]
    at_peak = predicted["peak_flops_per_device"] / per_image
    assert predicted["examples_per_second_at_peak"] == pytest.approx(at_peak, **RATE)
    assert predicted["examples_per_second_at_40pct_mfu"] == pytest.approx(0.4 * at_peak, **RATE)
    ratio = measured["images_per_second"] / at_peak
    assert vit["measured_over_predicted_at_peak"] == pytest.approx(ratio, **RATE)
    assert vit["measured_over_predicted_at_peak"] == pytest.approx(measured["mfu"], **RATE)
    assert predicted["command"].startswith(
        "python -m attnjax.compile --config configs/vit_imagenet.py --target cpu "
    )
    assert "--config.model.width=32" in predicted["command"]


def test_vqgan_rate_and_mfu_follow_from_its_steps(result):
    vqgan = result["parts"]["vqgan"]
    check_training(vqgan["measured"])
    assert vqgan["measured"]["flops_per_step"] > 0
    assert vqgan["image_size"] == 16


def test_prior_sampling_rate_follows_from_the_tokens_of_a_call(result):
    prior = result["parts"]["prior_sampling"]
    tokens = prior["batch"] * prior["grid"][0] * prior["grid"][1]
    assert prior["tokens_per_call"] == tokens
    assert prior["tokens_per_second"] == pytest.approx(tokens / prior["seconds_per_call"], **RATE)
    # The codes of the dry run's VQGAN (16 x 16 images, no downsampling) and prior_cifar10's
    # classes, with the null class of its class dropout.
    assert prior["grid"] == [16, 16] and prior["n_embed"] == 16
    assert prior["vocab_size"] == 16 + 10 + 1
    assert 0 <= prior["codes_min"] <= prior["codes_max"] < prior["n_embed"]


def reference_attention(seed, batch, tokens, heads, head_dim, causal):
    """The recipe the JSON states, rounded to bfloat16, attended in float64."""
    draws = np.random.default_rng(seed).standard_normal(
        (3, batch, tokens, heads, head_dim), dtype=np.float32
    )
    q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in draws)
    scores = np.einsum("blhd,bshd->bhls", q, k) / math.sqrt(head_dim)
    if causal:
        scores = np.where(np.tril(np.ones((tokens, tokens), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhls,bshd->blhd", weights, v)


def test_attention_paths_agree_with_each_other_and_a_float64_reference(result):
    part = result["parts"]["attention"]
    assert "default_rng(seed).standard_normal" in part["inputs"]
    rows = part["rows"]
    assert [(r["tokens"], r["causal"]) for r in rows] == [
        (64, False),
        (64, True),
        (128, False),
        (128, True),
    ]
    for row in rows:
        shape = (row["batch"], row["tokens"], row["heads"], row["head_dim"])
        # Two products (scores, weighted values) forward; four more backward.
        product = 2.0 * row["batch"] * row["heads"] * row["tokens"] ** 2 * row["head_dim"]
        assert row["flops"] == {"forward": 2 * product, "forward_backward": 6 * product}
        expected = reference_attention(row["seed"], *shape, row["causal"])
        probe_rows = np.linspace(0, row["tokens"] - 1, 3).astype(int)
        assert row["paths"]["cudnn"] == {"status": "not on this platform"}
        assert row["agree"]
        # PyTorch's CPU attention where it is installed (everywhere but the newest-JAX setup).
        compared = ("xla", "torch") if part["torch"] else ("xla",)
        if not part["torch"]:
            assert row["paths"]["torch"] == {"status": "not installed"}
        for name in compared:
            path = row["paths"][name]
            what = f"{name} at {row['tokens']} tokens, causal={row['causal']}"
            assert path["max_abs_diff_vs_xla"] <= part["agreement_atol"], what
            np.testing.assert_allclose(
                path["probe"], expected[0, probe_rows, 0, :8], atol=2e-2, err_msg=what
            )
            assert path["abs_mean"] == pytest.approx(np.mean(np.abs(expected)), rel=1e-2), what
            for kind in ("forward", "forward_backward"):
                rate = row["flops"][kind] / (path[f"{kind}_ms"] / 1e3) / 1e12
                assert path[f"{kind}_tflops"] == pytest.approx(rate, **RATE), what


def test_pytest_outcomes_are_read_from_its_verbose_output():
    sys.path.insert(0, str(CHECK.parent))
    import check

    text = "\n".join(
        [
            "tests/ops/test_kernel_choice_cuda.py::test_models[vit forward] PASSED     [ 10%]",
            "tests/ops/test_kernel_choice_cuda.py::test_cudnn[197-12-64] FAILED       [ 20%]",
            "tests/compile/test_compile.py::test_gpu_train_step SKIPPED (no GPU)     [ 30%]",
            "FAILED tests/ops/test_kernel_choice_cuda.py::test_cudnn[197-12-64] - assert 0 == 2",
        ]
    )
    parsed = check.parse_pytest(text)
    assert parsed["outcomes"] == {
        "tests/ops/test_kernel_choice_cuda.py::test_models[vit forward]": "passed",
        "tests/ops/test_kernel_choice_cuda.py::test_cudnn[197-12-64]": "failed",
        "tests/compile/test_compile.py::test_gpu_train_step": "skipped",
    }
    assert parsed["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
