"""What the compile command prints and writes: per program, memory per device against the chip's,
FLOPs, collectives, compile time and the throughput the FLOPs predict.

Predictions are ``examples x peak / FLOPs``: every device at its bf16 peak, and at 40% of it (a
well tuned transformer's MFU); on a CPU target the peak is a float32 matrix product timed here.
"""

from __future__ import annotations

from attnjax.compile.programs import DoesNotFit, Program
from attnjax.compile.targets import Target
from attnjax.train import accelerators

GIB = float(1 << 30)
GOOD_MFU = 0.4


def peak_per_device(target: Target) -> tuple[float, str]:
    if target.chip is not None:
        return target.peak_per_device, f"{target.chip.name} bf16 peak"
    return accelerators.measured_matmul_flops(), "measured float32 1024^3 matmul"


def program_summary(program: Program, target: Target, mesh: dict) -> dict:
    """One program's JSON record (bytes per device; FLOPs per call over all devices)."""
    devices = len(target.devices)
    memory = target.memory_per_device
    peak, _ = peak_per_device(target)
    record = {
        "examples_per_step": program.examples,
        "argument_bytes": program.argument_bytes,
        "output_bytes": program.output_bytes,
        "alias_bytes": program.alias_bytes,
        "temp_bytes": program.temp_bytes,
        "bytes_per_device": program.bytes_per_device,
        # XLA:TPU refuses temporaries over its HBM (``DoesNotFit``) but compiled 24 GiB of
        # arguments for a 16 GiB v5e, and XLA:GPU refuses nothing: the sum of the sizes decides.
        "fits": memory is None or program.bytes_per_device <= memory,
        "flops_per_step": program.flops,
        "flops_per_example": program.flops / program.examples if program.flops else None,
        "xla_flops_per_step": program.xla_flops,
        "compiled_flops_per_device": program.compiled_flops_per_device,
        "flops_loops_counted_once": program.has_loops,
        "kernel_calls": program.kernel_calls,
        "collectives": program.collectives,
        "collective_bytes_per_device": program.collective_bytes,
        "compile_seconds": round(program.compile_seconds, 2),
        "examples_per_second_at_peak": None,
        "examples_per_second_at_40pct_mfu": None,
    }
    if program.flops and not program.has_loops:
        _predict(record, program.flops / program.examples, peak * devices)
    return record


def _predict(record: dict, flops_per_example: float, peak: float) -> None:
    record["examples_per_second_at_peak"] = peak / flops_per_example
    record["examples_per_second_at_40pct_mfu"] = GOOD_MFU * peak / flops_per_example


def _estimate_train_from_eval(records: dict, peak: float) -> None:
    """A train step whose count misses loop trips (a kernel's loops of traced length) is
    predicted from the eval step's forward instead: training does three times a forward's
    products (the forward, and each product's two gradients), the rule behind 6 x parameters
    x tokens."""
    train, evaluation = records.get("train"), records.get("eval")
    if not (train and evaluation and train["flops_loops_counted_once"]):
        return
    if evaluation["flops_loops_counted_once"] or not evaluation["flops_per_example"]:
        return
    train["flops_per_example_estimate"] = 3 * evaluation["flops_per_example"]
    _predict(train, train["flops_per_example_estimate"], peak)


def summary(config_name: str, target: Target, mesh: dict, programs: list[Program]) -> dict:
    """The command's JSON: the target, the mesh and a record per program."""
    peak, peak_source = peak_per_device(target)
    records = {p.name: program_summary(p, target, mesh) for p in programs}
    _estimate_train_from_eval(records, peak * len(target.devices))
    return {
        "config": config_name,
        "target": target.name,
        "devices": len(target.devices),
        "device_kind": getattr(target.devices[0], "device_kind", ""),
        "device_memory_bytes": target.memory_per_device,
        "peak_flops_per_device": peak,
        "peak_source": peak_source,
        "mesh": mesh,
        "fits": all(r["fits"] for r in records.values()),
        "programs": records,
    }


def _gib(value) -> str:
    return f"{value / GIB:.2f}" if value >= GIB / 100 or not value else f"{value / GIB:.2g}"


def _flop(value: float) -> str:
    """``value`` FLOP with a prefix that leaves 1 to 999 in front."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}FLOP"
    return f"{value:.3g} FLOP"


def _rate(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_text(result: dict) -> str:
    """The printed report: a header line and three lines per program."""
    memory = result["device_memory_bytes"]
    mesh = " ".join(f"{k}={v}" for k, v in result["mesh"].items())
    lines = [
        f"{result['config']} on {result['target']}: {result['devices']} x "
        f"{result['device_kind'] or 'cpu'}"
        + (f", {_gib(memory)} GiB each" if memory else "")
        + f", peak {_flop(result['peak_flops_per_device'])}/s each "
        f"({result['peak_source']}); mesh {mesh}"
    ]
    for name, r in result["programs"].items():
        of = f" of {_gib(memory)} ({r['bytes_per_device'] / memory:.0%})" if memory else ""
        lines.append(
            f"  {name:<6} batch {r['examples_per_step']}: {_gib(r['argument_bytes'])} arguments + "
            f"{_gib(r['output_bytes'])} outputs - {_gib(r['alias_bytes'])} donated + "
            f"{_gib(r['temp_bytes'])} temporaries = {_gib(r['bytes_per_device'])} GiB per "
            f"device{of}: {'fits' if r['fits'] else 'DOES NOT FIT'}"
        )
        flops = r["flops_per_step"]
        loops = " (a loop's body counted once)" if r["flops_loops_counted_once"] else ""
        compiled = r["compiled_flops_per_device"]
        xla = r["xla_flops_per_step"]
        kernels = f", {r['kernel_calls']} kernel calls" if r["kernel_calls"] else ""
        moved = r.get("collective_bytes_per_device") or {}
        collectives = (
            ", ".join(
                f"{k} {v}" + (f" ({_gib(moved[k])} GiB)" if moved.get(k) else "")
                for k, v in r["collectives"].items()
            )
            or "none"
        )
        lines.append(
            f"         {_flop(flops / r['examples_per_step'])}/example, "
            f"{_flop(flops)}/step in products{loops}"
            + (f" (XLA: {_flop(xla)}/step" if xla else " (")
            + (f", compiled {_flop(compiled)}/device)" if compiled else ")")
            + f"; collectives: {collectives}{kernels}"
            if flops
            else f"         FLOPs unknown; collectives: {collectives}{kernels}"
        )
        estimate = r.get("flops_per_example_estimate")
        if estimate:
            lines.append(
                f"         estimated {_flop(estimate)}/example: 3 x the eval step's forward"
            )
        lines.append(
            f"         compiled in {r['compile_seconds']:.1f} s; predicted "
            f"{_rate(r['examples_per_second_at_peak'])} examples/s at peak, "
            f"{_rate(r['examples_per_second_at_40pct_mfu'])} at 40% MFU"
        )
    return "\n".join(lines)


def _advice(config) -> str:
    levers = ["lower config.batch_size (raise config.grad_accum_steps to keep the update's batch)"]
    if dict(config.get("mesh") or {}).get("fsdp", 1) in (1, "1"):
        levers.append("set config.mesh.fsdp > 1 (split parameters and optimiser state)")
    if config.get("model", {}).get("remat") is False:
        levers.append("set config.model.remat=True")
    return "; ".join(levers)


def refusal(config, target: Target, program: str, needed, available) -> str:
    """One line: what ``program`` needs per device, what the chip has, what to change."""
    available = available or target.memory_per_device
    need = f"needs {_gib(needed)} GiB per device" if needed else "does not fit"
    has = f", {target.name} has {_gib(available)} GiB" if available else ""
    field = "batch_size" if program == "train" else "eval_batch_size"
    size = config.get(field) or config.batch_size
    advice = _advice(config).replace("config.batch_size", f"config.{field}")
    return f"attnjax.compile: the {program} step at config.{field}={size} {need}{has}; {advice}."


def refusal_for(config, target: Target, refused: DoesNotFit) -> str:
    return refusal(config, target, refused.program, refused.needed, refused.available)
