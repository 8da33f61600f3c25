"""The pictures written beside a checkpoint: ``loss.png`` and ``schedule.png``.

matplotlib is optional (the ``examples`` extra); without it, ``write_plots`` returns a one-line
note instead. The figures are drawn through matplotlib's object API (no pyplot global state).
"""
from __future__ import annotations

from pathlib import Path

NO_MATPLOTLIB = "matplotlib is not installed, so no loss.png or schedule.png (pip install matplotlib)"
NO_TRACE = ("the engine gave no trace (cm.last_trace), so schedule.png shows the plan's stages "
            "instead of a measured schedule")

_STAGE_VALUE_KEYS = ("est_time_s", "estimated_time_s", "time_s", "est_time", "estimated_time",
                     "cost_s", "cost", "flops", "fwd_flops")
_AXIS_LABELS = {"est_time_s": "estimated time of the stage job (s)", "time_s": "time of the stage job (s)",
                "flops": "FLOPs", "fwd_flops": "forward FLOPs"}
_KIND_COLORS = (("backward", "tab:orange"), ("bwd", "tab:orange"), ("forward", "tab:blue"),
                ("fwd", "tab:blue"), ("upload", "tab:green"), ("prefetch", "tab:green"),
                ("h2d", "tab:green"), ("download", "tab:purple"), ("offload", "tab:purple"),
                ("d2h", "tab:purple"), ("optim", "tab:red"))


def write_plots(directory, losses: list[float], cm) -> list[str]:
    """Write both pictures into ``directory``; return notes for the user (may be empty)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return [NO_MATPLOTLIB]
    directory = Path(directory)

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, lw=1, alpha=0.5 if len(losses) > 20 else 1.0, label="loss per step")
    if len(losses) > 20:
        window = max(5, len(losses) // 20)
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
                  for i in range(len(losses))]
        ax.plot(steps, smooth, lw=2, label=f"mean of the last {window} steps")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("rpcompile-finetune: loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(directory / "loss.png")

    trace = getattr(cm, "last_trace", None)
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    notes = []
    if trace:
        _draw_trace(fig, trace)
    else:
        _draw_plan(fig, getattr(cm, "plan", None))
        notes.append(NO_TRACE)
    fig.tight_layout()
    fig.savefig(directory / "schedule.png")
    return notes


def _color(name: str) -> str:
    name = name.lower()
    return next((c for key, c in _KIND_COLORS if key in name), "tab:gray")


def _device_label(e) -> str:
    # Several CPU "devices" share the name "cpu": the worker index tells them apart.
    return f"{e['device']} #{e['worker']}" if "worker" in e else str(e["device"])


def _draw_trace(fig, trace) -> None:
    rows = sorted({(_device_label(e), str(e.get("stream", ""))) for e in trace})
    t0 = min(float(e["start_s"]) for e in trace)
    ax = fig.add_subplot()
    for e in trace:
        y = rows.index((_device_label(e), str(e.get("stream", ""))))
        start, end = float(e["start_s"]) - t0, float(e["end_s"]) - t0
        ax.barh(y, max(end - start, 1e-9), left=start, color=_color(str(e["name"])), edgecolor="black", lw=0.3)
        if len(trace) <= 40:
            ax.text(start + (end - start) / 2, y, str(e["name"]), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)), [f"{d} {s}".strip() for d, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step began")
    ax.set_title("schedule of the last step, per device and stream (cm.last_trace)")


def _stage_value(stage):
    for key in _STAGE_VALUE_KEYS:
        value = stage.get(key) if isinstance(stage, dict) else getattr(stage, key, None)
        try:
            return key, float(value)
        except (TypeError, ValueError):
            continue
    return None, None


def _stage_label(stage, i: int) -> str:
    get = stage.get if isinstance(stage, dict) else (lambda k: getattr(stage, k, None))
    for key in ("name", "label"):
        if get(key):
            return str(get(key))
    kind = get("kind") or get("direction")
    index = get("stage") if get("stage") is not None else i
    return f"{kind} {index}" if kind else f"stage {index}"


def _draw_plan(fig, plan) -> None:
    rows = getattr(plan, "stage_rows", None)  # rpcompile's Plan: one dict per stage job
    stages = list(rows() if callable(rows) else getattr(plan, "stages", None) or [])
    values = [_stage_value(s) for s in stages]
    keys = {k for k, _ in values}
    if stages and None not in keys and len(keys) == 1:
        ax = fig.add_subplot()
        ax.bar(range(len(stages)), [v for _, v in values], color="tab:blue")
        ax.set_xticks(range(len(stages)), [_stage_label(s, i) for i, s in enumerate(stages)],
                      rotation=45, ha="right", fontsize=7)
        key = keys.pop()
        ax.set_ylabel(_AXIS_LABELS.get(key, key))
        ax.set_title("plan: stages (no measured trace from the engine)")
        return
    ax = fig.add_subplot()  # nothing numeric to draw: show the plan's own table
    ax.axis("off")
    ax.set_title("plan (no measured trace from the engine)")
    ax.text(0, 1, str(plan), family="monospace", fontsize=6, va="top", ha="left", transform=ax.transAxes)
