"""benchmarks/gpu/check.py's dry run (the GPU check's code at tiny sizes on the CPU), its JSON
checked against references made here: rates from the recorded steps and seconds, the ViT's and
attention's FLOPs counted by hand, attention's outputs against a float64 computation of the same
inputs, the persistent cache's hits in the second process; and benchmarks/gpu/table.py's rows
and loss comparison from that JSON."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu" / "check.py"
TABLE = ROOT / "benchmarks" / "gpu" / "table.py"
RATE = dict(rel=1e-9)  # quantities the JSON derives from others it records
HAS_TORCH = importlib.util.find_spec("torch") is not None
TORCH_PARTS = ("torch_vit", "torch_vqgan", "torch_sampling")

sys.path.insert(0, str(CHECK.parent))
import check  # noqa: E402
import measure_profile  # noqa: E402  (imports no framework)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    # Without the suite's shared cache the check uses its own, empty at its start (as on a lent
    # machine): its first process compiles, its second reads. From a clean clone the suite's
    # cache is as empty, so this costs CI nothing. Its steps are kept as compiled, as a user's
    # runs' are (the suite turns that off for its own processes).
    dropped = ("JAX_COMPILATION_CACHE_DIR", "ATTNJAX_EXECUTABLE_CACHE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    run = subprocess.run(
        [sys.executable, str(CHECK), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
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
    expected = dict.fromkeys(
        ("vit", "vqgan", "prior_sampling", "attention", *TORCH_PARTS, "first_steps",
         "vqgan_float32", "vit_predicted"), "ok"
    )  # fmt: skip
    if not HAS_TORCH:  # the newest-JAX environment: attnjax's side alone
        expected.update(dict.fromkeys(TORCH_PARTS, "skipped"))
    assert statuses == {**expected, "cuda_tests": "skipped"}, {
        name: part.get("error") for name, part in result["parts"].items()
    }
    assert all(part["seconds"] > 0 for part in result["parts"].values() if "seconds" in part)
    kinds = [start["kind"] for start in result["worker_starts"]]
    assert kinds == (["jax", "torch", "jax"] if HAS_TORCH else ["jax", "jax"])
    assert all(0 < start["seconds"] < 120 for start in result["worker_starts"])


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
    losses = measured["losses"]
    assert len(losses) == measured["warmup_steps"] + steps
    assert all(math.isfinite(loss) for loss in losses)
    assert (losses[0], losses[-1]) == (measured["loss_first"], measured["loss_last"])
    first = measured["first_step"]
    assert first["seconds"] == measured["first_step_seconds"]
    stages = first["tracing"] + first["lowering"] + first["compiling"] + first["loading"]
    assert first["running"] == pytest.approx(first["seconds"] - stages, abs=1e-9)
    assert 0 < stages < first["seconds"]


def test_vit_rate_and_mfu_follow_from_its_steps_and_the_hand_counted_flops(result):
    vit, predicted = result["parts"]["vit"], result["parts"]["vit_predicted"]
    measured = vit["measured"]
    check_training(measured)
    # The first process compiled the train step and kept it, past JAX's persistent cache (on a
    # CPU, whose executables read back from that cache cannot be kept).
    first = measured["first_step"]
    assert (first["cache_hits"], first["cache_misses"], first["kept_written"]) == (0, 0, 1)
    per_image = vit_train_flops(vit["model"])
    assert measured["flops_per_step"] == measured["batch_size"] * per_image
    # The compile command counts the same products; its peak is the CPU's matrix product timed
    # again, in another process.
    assert predicted["target"] == "cpu"
    assert predicted["flops_per_example"] == per_image
    at_peak = predicted["peak_flops_per_device"] / per_image
    assert predicted["examples_per_second_at_peak"] == pytest.approx(at_peak, **RATE)
    assert predicted["examples_per_second_at_40pct_mfu"] == pytest.approx(0.4 * at_peak, **RATE)
    assert predicted["command"].startswith(
        "python -m attnjax.compile --config configs/vit_imagenet.py --target cpu "
    )
    assert "--config.model.width=32" in predicted["command"]


def test_the_flags_worker_adds_the_trial_flags_to_the_users(monkeypatch):
    """``vit_xla_flags`` (left out of the default parts) runs in a worker whose XLA_FLAGS are the
    user's followed by the trial's; the other workers keep the user's."""

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    flags = check.worker_environment("jax_flags", dry_run=True, cache="/c")["XLA_FLAGS"]
    assert flags == f"--xla_force_host_platform_device_count=2 {check.XLA_FLAG_TRIALS}"
    plain = check.worker_environment("jax", dry_run=True, cache="/c")
    assert plain["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert plain["ATTNJAX_COMPILATION_CACHE"] == "/c" and plain["JAX_PLATFORMS"] == "cpu"
    assert "vit_xla_flags" in check.PARTS and "vit_xla_flags" not in check.DEFAULT_PARTS


def test_vqgan_bf16_and_float32_train_on_the_same_batches(result):
    bf16, f32 = result["parts"]["vqgan"], result["parts"]["vqgan_float32"]
    assert (bf16["compute_dtype"], f32["compute_dtype"]) == ("bfloat16", "float32")
    for part in (bf16, f32):
        check_training(part["measured"])
        assert part["measured"]["batches"] == 2 and part["image_size"] == 16
    # Same seeds, same batches: the first losses (before any update) agree to bf16's rounding.
    assert bf16["measured"]["loss_first"] == pytest.approx(f32["measured"]["loss_first"], rel=2e-2)
    assert bf16["measured"]["flops_per_step"] == f32["measured"]["flops_per_step"] > 0


def test_second_process_loads_the_first_steps_the_first_one_kept(result):
    part = result["parts"]["first_steps"]
    for name in ("vit", "vqgan"):
        first = part[name]["first_step"]
        # The train step loaded as compiled: neither JAX's cache nor the compiler was asked.
        assert (first["kept_loaded"], first["cache_hits"], first["cache_misses"]) == (1, 0, 0)
        cold = result["parts"][name]["measured"]["first_step"]
        assert first["compiling"] < cold["compiling"], name
        assert first["tracing"] < cold["tracing"], name
    # Another learning rate: a new program, compiled (its key, the config, changed).
    new = part["new_program"]["first_step"]
    assert (new["kept_loaded"], new["cache_hits"], new["kept_written"]) == (0, 0, 1)
    assert part["new_program"]["task"] == "classification"


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


def check_torch_training(row):
    steps, batch = row["steps"], row["batch_size"]
    assert row["images_per_second"] == pytest.approx(steps * batch / row["seconds"], **RATE)
    assert len(row["losses"]) == row["warmup_steps"] + steps
    assert all(math.isfinite(loss) for loss in row["losses"])
    assert 0 < row["first_step_seconds"]


def test_pytorch_rows_follow_from_their_steps(result):
    parts = result["parts"]
    if not HAS_TORCH:
        assert all(parts[name]["status"] == "skipped" for name in TORCH_PARTS)
        return
    vit = parts["torch_vit"]
    for name in ("eager", "compiled"):
        check_torch_training(vit[name])
        assert vit[name]["batch_size"] == result["parts"]["vit"]["measured"]["batch_size"]
    # torch.compile's eager backend on the CPU runs the same operations: the same first loss.
    assert vit["compiled"]["compiled"] == {"backend": "eager", "mode": "default"}
    assert vit["compiled"]["losses"][0] == pytest.approx(vit["eager"]["losses"][0], rel=1e-4)
    assert vit["device"]["device"] == "cpu"
    check_torch_training(parts["torch_vqgan"]["eager"])
    assert parts["torch_vqgan"]["eager"]["batch_size"] == parts["vqgan"]["measured"]["batch_size"]
    sampling = parts["torch_sampling"]
    eager = sampling["eager"]
    assert sampling["tokens_per_call"] == parts["prior_sampling"]["tokens_per_call"]
    assert sampling["rows"] == 2 * sampling["batch"]  # guidance: conditional and unconditional
    tokens = sampling["tokens_per_call"] / eager["seconds_per_call"]
    assert eager["tokens_per_second"] == pytest.approx(tokens, **RATE)
    assert 0 <= eager["codes_min"] <= eager["codes_max"] < parts["prior_sampling"]["n_embed"]
    assert sampling["cuda_graph"] == {"status": "not on this platform"}


def run_table(result, tmp_path, *extra):
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(result))
    return subprocess.run(
        [sys.executable, str(TABLE), str(path), *extra], capture_output=True, text=True
    )


def test_table_sets_attnjax_beside_pytorch_with_their_ratios(result, tmp_path):
    run = run_table(result, tmp_path, "--json", str(tmp_path / "rows.json"))
    assert run.returncode == 0, run.stderr
    assert "| row | unit | attnjax | PyTorch |" in run.stdout
    summary = json.loads((tmp_path / "rows.json").read_text())
    parts, rows = result["parts"], summary["rows"]
    vit = [row for row in rows if row["row"].startswith("ViT")]
    assert [row["attnjax"] for row in vit] == [parts["vit"]["measured"]["images_per_second"]] * 2
    attention = [row for row in rows if row["row"].startswith("attention")]
    # A row needs both sides: none where PyTorch is not installed (the newest-JAX environment).
    assert len(attention) == (2 * len(parts["attention"]["rows"]) if HAS_TORCH else 0)
    for row in rows:
        if row["pytorch"] is None:
            assert row["ratio"] is None
        elif row["unit"] == "ms":  # a time: PyTorch's over attnjax's
            assert row["ratio"] == pytest.approx(row["pytorch"] / row["attnjax"], **RATE)
        else:
            assert row["ratio"] == pytest.approx(row["attnjax"] / row["pytorch"], **RATE)
    if HAS_TORCH:
        assert [row["pytorch"] for row in vit] == [
            parts["torch_vit"][name]["images_per_second"] for name in ("eager", "compiled")
        ]
        assert (
            attention[0]["pytorch"] == parts["attention"]["rows"][0]["paths"]["torch"]["forward_ms"]
        )
    bf16 = np.asarray(parts["vqgan"]["measured"]["losses"])
    f32 = np.asarray(parts["vqgan_float32"]["measured"]["losses"])
    curves = summary["vqgan_loss_curves"]
    assert curves["steps"] == len(bf16)
    assert curves["mean_difference"] == pytest.approx(np.mean(bf16 - f32), rel=1e-9, abs=1e-12)
    worst = np.max(np.abs(bf16 - f32) / np.abs(f32))
    assert curves["max_relative_difference"] == pytest.approx(worst, rel=1e-9)
    assert 0 <= curves["ks_pvalue"] <= 1


def test_table_refuses_a_file_that_is_no_check_result(tmp_path):
    run = run_table({"rows": []}, tmp_path)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "gpu_check.json" in run.stderr and "parts" in run.stderr


def test_pytest_outcomes_are_read_from_its_verbose_output():

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


def test_profile_summary_sums_device_events_by_family_per_step():
    """measure_profile.summarize on a trace written here: two steps of a device lane holding a
    GEMM, a cuDNN convolution pass, a flash attention kernel and a copy, beside a host lane whose
    events are not the device's."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    kernels = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 300.0),
        ("sm90_xmma_dgrad_implicit_gemm_bf16", 100.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 50.0),
        ("copy_transpose_fusion", 25.0),
    ]
    events = [
        {"ph": "X", "pid": 1, "tid": 7, "name": name, "dur": dur, "ts": 0}
        for name, dur in kernels * 2
    ] + [{"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction", "dur": 9999.0, "ts": 0}]
    summary = measure_profile.summarize({"traceEvents": meta + events}, steps=2, step_seconds=1e-3)
    assert summary["lanes"] == ["/device:GPU:0"]
    assert summary["by_family_ms"] == {
        "matrix products": 0.3,
        "convolutions": 0.1,
        "attention": 0.05,
        "copies and transposes": 0.025,
    }
    assert summary["events_ms_per_step"] == pytest.approx(0.475)
    assert summary["busy_share"] == pytest.approx(0.475)
    assert summary["top_ms"][0] == {
        "name": "sm90_xmma_gemm_bf16bf16_bf16f32",
        "ms": 0.3,
        "family": "matrix products",
    }


def test_vit_step_was_profiled_on_the_hosts_lanes(result):
    profile = result["parts"]["vit"]["measured"]["profile"]
    assert profile["lanes"] == ["host (no device lane)"]
    assert profile["events_ms_per_step"] > 0 and profile["step_ms"] > 0
    assert sum(profile["by_family_ms"].values()) == pytest.approx(profile["events_ms_per_step"])
    # The ViT's products are in the trace under XLA's names for them.
    assert profile["by_family_ms"].get("matrix products", 0) > 0
    if HAS_TORCH:  # PyTorch's operators' own times, by the same families
        torch_profile = result["parts"]["torch_vit"]["compiled"]["profile"]
        assert torch_profile["lanes"] == ["CPU operators (own time)"]
        total = sum(torch_profile["by_family_ms"].values())
        assert total == pytest.approx(torch_profile["events_ms_per_step"])
        assert torch_profile["by_family_ms"]["matrix products"] > 0
        assert result["parts"]["torch_vit"]["eager"]["profile"] is None
