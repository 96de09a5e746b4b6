"""The GPU check side by side: attnjax's rate, PyTorch's, their ratio and both first steps, per
row, from one ``gpu_check.json`` (benchmarks/gpu/check.py).

    python benchmarks/gpu/table.py benchmarks/results/gpu_check_h200.json [--json OUT]

Ratio above 1: attnjax is faster (rates: attnjax's over PyTorch's; attention's times per call on
the device, in ms: PyTorch's over attnjax's). "first step": a training row's first step (compile,
autotuning and run; the initialisation apart), a sampler's first call, attnjax's also from a
second process over the first one's persistent compilation cache ("warm"). Below the table: the
bf16 VQGAN's loss curve against float32's (same seeds, same batches).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import numpy as np
from scipy import stats

ATTENTION_PEERS = {"forward": "forward", "forward_backward": "forward + backward"}


def _row(name, unit, ours, theirs, peer, first_ours=None, first_theirs=None, warm=None):
    """A row; ``unit`` "ms" is a time (lower is better: the ratio is PyTorch's over ours),
    anything else a rate (ours over PyTorch's)."""
    ratio = None
    if ours and theirs:
        ratio = theirs / ours if unit == "ms" else ours / theirs
    return {
        "row": name,
        "unit": unit,
        "attnjax": ours,
        "pytorch": theirs,
        "pytorch_side": peer,
        "ratio": ratio,
        "attnjax_first_step_seconds": first_ours,
        "attnjax_warm_first_step_seconds": warm,
        "pytorch_first_step_seconds": first_theirs,
    }


def _ok(parts: dict, name: str) -> dict:
    """The part's result where it ran (partial results of a failed part count: each row says
    what it has)."""
    return parts.get(name) or {}


def _warm(parts: dict, name: str):
    warm = _ok(parts, "first_steps").get(name) or {}
    return (warm.get("first_step") or {}).get("seconds")


def training_rows(parts: dict, vit_name: str) -> list[dict]:
    rows = []
    vit = _ok(parts, "vit").get("measured")
    torch_vit = _ok(parts, "torch_vit")
    if vit:
        batch = vit["batch_size"]
        for peer, label in (("eager", "timm, eager"), ("compiled", "timm, torch.compile")):
            theirs = torch_vit.get(peer) or {}
            rows.append(_row(
                f"{vit_name} train step, bf16, batch {batch}", "images/s",
                vit["images_per_second"], theirs.get("images_per_second"),
                f"{label}, bf16 autocast", vit["first_step_seconds"],
                theirs.get("first_step_seconds"), _warm(parts, "vit"),
            ))  # fmt: skip
    vqgan = _ok(parts, "vqgan").get("measured")
    if vqgan:
        theirs = _ok(parts, "torch_vqgan").get("eager") or {}
        rows.append(_row(
            f"VQGAN f16 train step (autoencoder, discriminator, LPIPS), bf16, batch "
            f"{vqgan['batch_size']}", "images/s", vqgan["images_per_second"],
            theirs.get("images_per_second"), "taming modules, eager, bf16 autocast",
            vqgan["first_step_seconds"], theirs.get("first_step_seconds"), _warm(parts, "vqgan"),
        ))  # fmt: skip
    return rows


def sampling_rows(parts: dict) -> list[dict]:
    prior = _ok(parts, "prior_sampling")
    if not prior.get("tokens_per_second"):
        return []
    theirs_part = _ok(parts, "torch_sampling")
    rows = []
    for peer, label in (("eager", "taming GPT, static KV cache, eager"),
                        ("cuda_graph", "taming GPT, static KV cache, CUDA graph")):  # fmt: skip
        theirs = theirs_part.get(peer) or {}
        rows.append(_row(
            f"prior sampling, {prior['model']['n_layer']} x {prior['model']['n_embd']} GPT, "
            f"{prior['batch']} x {prior['tokens_per_call'] // prior['batch']} codes, guidance",
            "tokens/s", prior["tokens_per_second"], theirs.get("tokens_per_second"), label,
            prior["first_call_seconds"], theirs.get("first_call_seconds"),
        ))  # fmt: skip
    return rows


def attention_rows(parts: dict) -> list[dict]:
    rows = []
    for row in _ok(parts, "attention").get("rows", []):
        paths = row.get("paths", {})
        # cuDNN where the device has it (what dot_product_attention picks on a GPU), else XLA's.
        path = "cudnn" if "forward_ms" in paths.get("cudnn", {}) else "xla"
        ours, theirs = paths.get(path, {}), paths.get("torch", {})
        if "forward_ms" not in ours or "forward_ms" not in theirs:
            continue
        for kind, label in ATTENTION_PEERS.items():
            rows.append(_row(
                f"attention {label} ({path}), {row['tokens']} tokens, "
                f"{'causal' if row['causal'] else 'full'}, batch {row['batch']}, {row['heads']} "
                f"heads of {row['head_dim']}, bf16",
                "ms", ours[f"{kind}_ms"], theirs[f"{kind}_ms"],
                f"SDPA ({theirs.get('backend', '?')}, PyTorch's choice)",
            ))  # fmt: skip
    return rows


def rows(data: dict) -> list[dict]:
    parts = data["parts"]
    return training_rows(parts, _vit_name(data)) + sampling_rows(parts) + attention_rows(parts)


def _vit_name(data: dict) -> str:
    """ViT-B/16 at 224 px on a GPU; the dry run's ViT is a tiny one."""
    return "ViT-B/16 (224 px)" if data.get("mode") == "gpu" else "ViT (dry-run sizes)"


def loss_curves(data: dict) -> dict | None:
    """The bf16 VQGAN's losses against float32's, step for step (same seeds and batches): the
    paired differences' mean, spread and t statistic, the largest relative difference, and a
    two-sample Kolmogorov-Smirnov test of the two sets of losses (asymptotic p: the exact one
    fails on tied losses)."""
    parts = data["parts"]
    bf16 = (_ok(parts, "vqgan").get("measured") or {}).get("losses")
    f32 = (_ok(parts, "vqgan_float32").get("measured") or {}).get("losses")
    if not bf16 or not f32 or len(bf16) != len(f32):
        return None
    a, b = np.asarray(bf16, np.float64), np.asarray(f32, np.float64)
    difference = a - b
    spread = float(np.std(difference, ddof=1)) if len(a) > 1 else 0.0
    t = float(np.mean(difference) / (spread / math.sqrt(len(a)))) if spread > 0 else 0.0
    return {
        "steps": len(a),
        "bf16_mean": float(a.mean()),
        "float32_mean": float(b.mean()),
        "mean_difference": float(difference.mean()),
        "difference_std": spread,
        "paired_t": t,
        "max_relative_difference": float(np.max(np.abs(difference) / np.abs(b))),
        "ks_pvalue": float(stats.ks_2samp(a, b, method="asymp").pvalue),
        "bf16_images_per_second": parts["vqgan"]["measured"]["images_per_second"],
        "float32_images_per_second": parts["vqgan_float32"]["measured"]["images_per_second"],
    }


def _number(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def markdown(data: dict) -> str:
    device = data.get("device", {})
    lines = [
        f"{device.get('nvidia_smi') or device.get('kind', 'CPU (dry run)')}; "
        + ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items()),
        "",
        "| row | unit | attnjax | PyTorch | PyTorch side | ratio | attnjax first step s "
        "(warm) | PyTorch first step s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows(data):
        digits = 3 if row["unit"] == "ms" else 0
        first = _number(row["attnjax_first_step_seconds"], 1)
        if row["attnjax_warm_first_step_seconds"] is not None:
            first += f" ({row['attnjax_warm_first_step_seconds']:.1f})"
        lines.append(
            f"| {row['row']} | {row['unit']} | {_number(row['attnjax'], digits)} | "
            f"{_number(row['pytorch'], digits)} | {row['pytorch_side']} | "
            f"{_number(row['ratio'], 2)} | {first} | "
            f"{_number(row['pytorch_first_step_seconds'], 1)} |"
        )
    curves = loss_curves(data)
    if curves:
        lines += [
            "",
            f"VQGAN loss, bf16 against float32 over {curves['steps']} steps: means "
            f"{curves['bf16_mean']:.4f} and {curves['float32_mean']:.4f}, paired difference "
            f"{curves['mean_difference']:+.4f} +- {curves['difference_std']:.4f} (t "
            f"{curves['paired_t']:+.2f}), largest relative difference "
            f"{curves['max_relative_difference']:.3f}, Kolmogorov-Smirnov p "
            f"{curves['ks_pvalue']:.2f}; bf16 {curves['bf16_images_per_second']:,.1f} images/s, "
            f"float32 {curves['float32_images_per_second']:,.1f}.",
        ]
    vit = _ok(data["parts"], "vit").get("measured")
    if vit and vit.get("mfu") is not None:
        lines += ["", f"{_vit_name(data)} MFU {vit['mfu']:.3f} ({vit['peak_source']})."]
    compiled = _ok(data["parts"], "torch_vit").get("compiled") or {}
    for who, profile in (
        ("attnjax", (vit or {}).get("profile")),
        ("timm, torch.compile", compiled.get("profile")),
    ):
        if not profile or "error" in profile:
            continue
        families = ", ".join(f"{k} {v:.2f}" for k, v in profile["by_family_ms"].items())
        lines += [
            "",
            f"{_vit_name(data)} step under the profiler, {who}: {profile['step_ms']:.2f} ms, "
            f"events {profile['events_ms_per_step']:.2f} ms ({profile['busy_share']:.2f} of it) "
            f"on {', '.join(profile['lanes'])}; by family (ms): {families}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check_json", help="a gpu_check.json")
    parser.add_argument("--json", help="also write the rows and the loss comparison here")
    args = parser.parse_args(argv)
    path = pathlib.Path(args.check_json)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"table.py: cannot read {path}: {error}", file=sys.stderr)
        return 2
    if "parts" not in data:
        print(f"table.py: {path} has no 'parts': not a gpu_check.json", file=sys.stderr)
        return 2
    print(markdown(data), end="")
    if args.json:
        summary = {"source": str(path), "rows": rows(data), "vqgan_loss_curves": loss_curves(data)}
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
