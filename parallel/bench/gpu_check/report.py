"""The GPU check's targets (pass or miss, never failing the run) and its Markdown report; in the CLI process."""

from __future__ import annotations

from .harness import TARGETS


def _section(report: dict, name: str) -> dict | None:
    return next((entry for entry in report["measurements"] if entry["name"] == name and entry["status"] == "done"),
                None)


def evaluate_targets(report: dict, dry_run: bool) -> list[dict]:
    """Each target with the value the run measured: pass, miss, or not measured (never a failure)."""
    targets = []

    def add(name: str, target: str, value: float | None, ok: bool | None, note: str = "") -> None:
        result = "not measured" if value is None else ("n/a (dry run)" if dry_run else ("pass" if ok else "miss"))
        targets.append({"name": name, "target": target, "value": value, "result": result, "note": note})

    step = _section(report, "transformer_step")
    step_rows = step["rows"] if step else []
    by_key = {(r["model"], r["size"], r["variant"]): r for r in step_rows}
    for (model, size, variant), row in by_key.items():
        if variant != "WanMesh world 1":
            continue
        ratio = row["median_s"] / by_key[(model, size, "diffusers")]["median_s"]
        add(f"WanMesh world 1 / diffusers step, {model} {size}", f"<= {TARGETS['step_vs_diffusers']}", ratio,
            ratio <= TARGETS["step_vs_diffusers"])
        if row["memory_vs_predicted"] is not None or dry_run:
            value = row["memory_vs_predicted"]
            add(f"peak memory / cost model, {model} {size}", f"<= {TARGETS['memory_vs_predicted']}", value,
                value is not None and value <= TARGETS["memory_vs_predicted"])
    add("WanMesh world 1 / ComfyUI native step", f"<= {TARGETS['step_vs_comfyui']}", None, None,
        "ComfyUI is not carried to the GPU machine")
    slice_720 = [r for r in step_rows if "slice" in r["model"] and r["variant"] == "WanMesh world 1"]
    if slice_720:
        share = slice_720[-1]["bf16_peak_share"]
        add(f"share of bf16 peak, {slice_720[-1]['model']} {slice_720[-1]['size']}",
            f">= {TARGETS['bf16_peak_share']}", share, share is not None and share >= TARGETS["bf16_peak_share"],
            "" if share is not None or dry_run else "the device's bf16 peak is not in the table")
    quantized = _section(report, "quantized_step")
    fp8 = next((r["vs_bf16"] for r in quantized["rows"] if r["weights"] == "fp8 scaled"), None) if quantized else None
    add("kept fp8 / bf16 step", f"<= {TARGETS['fp8_vs_bf16']}", fp8, fp8 is not None and fp8 <= TARGETS["fp8_vs_bf16"])
    return targets


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def markdown(report: dict) -> str:
    device = report["device"]
    lines = [f"## GPU check ({report['mode']})", "",
             f"{report['date']}, commit {report['commit'] or '-'}, {device['name']}, torch {device['torch']}"
             f"{', CUDA ' + device['cuda'] if device['cuda'] else ''}; {report['elapsed_s']:.0f} s of a "
             f"{report['deadline_s']:.0f} s deadline", ""]
    if report["skipped_for_deadline"]:
        lines += [f"Skipped for the global deadline: {', '.join(report['skipped_for_deadline'])}", ""]
    lines += ["### Checks", "", "| check | status | largest error | tolerance | s |", "|---|---|---|---|---|"]
    for check in report["checks"]:
        rows = check.get("rows", [])
        worst = max(rows, key=lambda r: r["error"] / r["tolerance"]) if rows else None
        lines.append(f"| {check['name']} | {check['status']} | {_fmt(worst['error'] if worst else None, 3)} | "
                     f"{_fmt(worst['tolerance'] if worst else None, 3)} | {check['seconds']} |")
    for check in report["checks"]:
        note = check.get("error") or check.get("reason")
        if check["name"] == "two_ranks" and "backend" in check:
            note = (f"backend {check['backend']}"
                    + ("" if check["nccl_on_one_device"] else f" (NCCL refused two ranks on one device: "
                                                             f"{check['nccl_error']})" if check["nccl_error"] else ""))
        if check["name"] == "attention_backends" and "selected" in check:
            note = "selected " + ", ".join(f"{dtype}: {name}" for dtype, name in check["selected"].items()) + (
                "; not run: " + ", ".join(check["unavailable"]) if check["unavailable"] else "")
        if note:
            lines.append(f"- {check['name']}: {note}")
    step = _section(report, "transformer_step")
    if step:
        lines += ["", "### Transformer forward (one pass, bf16, random weights)", "",
                  "| model | size | tokens | variant | median s | min-max s | ms/layer | TFLOP/s | of bf16 peak | "
                  "attention share | peak GiB | predicted GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in step["rows"]:
            lines.append(f"| {r['model']} | {r['size']} | {r['tokens']} | {r['variant']} | {r['median_s']:.4f} | "
                         f"{r['min_s']:.4f}-{r['max_s']:.4f} | {r['per_layer_ms']:.2f} | {r['tflops']:.1f} | "
                         f"{_fmt(r['bf16_peak_share'], 3)} | {r['attention_share']:.2f} | {_gib(r['peak_bytes'])} | "
                         f"{_gib(r['predicted_bytes'])} |")
    quantized = _section(report, "quantized_step")
    if quantized:
        lines += ["", f"### Kept quantized weights ({quantized['model_layers']} layers, {quantized['size']})", "",
                  "| weights | median s | min-max s | vs bf16 | weight GiB |", "|---|---|---|---|---|"]
        lines += [f"| {r['weights']} | {r['median_s']:.4f} | {r['min_s']:.4f}-{r['max_s']:.4f} | {r['vs_bf16']:.3f} | "
                  f"{_gib(r['weight_bytes'])} |" for r in quantized["rows"]]
    loads = _section(report, "load_time")
    if loads:
        lines += ["", f"### Loading a diffusers folder ({loads['model']}, bf16) onto the device", "",
                  "| loader | median s | min-max s |", "|---|---|---|"]
        lines += [f"| {r['loader']} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} |" for r in loads["rows"]]
    compiled = _section(report, "torch_compile")
    if compiled:
        lines += ["", f"### torch.compile ({compiled['model']}, {compiled['size']}, {compiled['backend']}): compile "
                      f"{compiled['compile_s']:.1f} s, compiled / eager {compiled['compiled_vs_eager']:.3f}"]
    vae = _section(report, "vae_decode_time")
    if vae:
        lines += ["", f"### VAE decode: {vae['vae']} {vae['dtype']}, {vae['video']}: {vae['median_s']:.3f} s "
                      f"({vae['per_frame_s'] * 1000:.1f} ms per frame), peak {_gib(vae['peak_bytes'])} GiB"]
    lines += ["", "### Targets", "", "| target | bar | value | result |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['target']} | {_fmt(t['value'], 3)} | {t['result']}"
              f"{' (' + t['note'] + ')' if t['note'] else ''} |" for t in report["targets"]]
    errors = [e for e in report["checks"] + report["measurements"] if e["status"] == "error"]
    if errors:
        lines += ["", "### Errors", ""] + [f"- {e['name']}: {e['error']}" for e in errors]
    return "\n".join(lines) + "\n"
