"""The pictures written beside a checkpoint: ``loss.png`` and ``schedule.png``.

matplotlib is optional (the ``examples`` extra); without it, ``write_plots`` returns a one-line
note instead. The figures are drawn through matplotlib's object API (no pyplot global state).
"""
from __future__ import annotations

import re
from pathlib import Path

from .report import plural

NO_MATPLOTLIB = "matplotlib is not installed, so no loss.png or schedule.png (pip install matplotlib)"
NO_TRACE = ("the engine gave no trace (cm.last_trace), so schedule.png shows the plan's stages "
            "instead of a measured schedule")

_STAGE_VALUE_KEYS = ("est_time_s", "estimated_time_s", "time_s", "est_time", "estimated_time",
                     "cost_s", "cost", "flops", "fwd_flops")
_AXIS_LABELS = {"est_time_s": "estimated time of the stage job (s)", "time_s": "time of the stage job (s)",
                "flops": "FLOPs", "fwd_flops": "forward FLOPs"}


def write_plots(directory, losses: list[float], cm) -> list[str]:
    """Write both pictures into ``directory``; return notes for the user (may be empty)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
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
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole numbers
    ax.set_ylabel("training loss")
    ax.set_title("rpcompile-finetune: loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(directory / "loss.png")

    trace = getattr(cm, "last_trace", None)
    devices = len({_device_label(e) for e in trace}) if trace else 1
    fig = Figure(figsize=(12, 2.2 + 1.3 * devices), dpi=100)
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


def _device_label(e) -> str:
    # Several CPU "devices" share the name "cpu": the worker index tells them apart (cpu:0, cpu:1).
    return f"{e['device']}:{e['worker']}" if "worker" in e and ":" not in str(e["device"]) else str(e["device"])


# What the schedule picture draws: compute bars coloured by the job's role, and below each
# device's compute lane, a thin lane of its transfers and a thin lane of its host-side waits.
_ROLES = {"fwd": ("tab:blue", "forward (fwd stage job)"),
          "fused": ("tab:green", "forward + loss + backward (fused last stage)"),
          "bwd": ("tab:orange", "recompute + backward (bwd stage job)")}
_TRANSFERS = {"weights_in": ("tab:purple", "weights up (host -> device)"),
              "acts_in": ("tab:cyan", "activations up (host -> device)"),
              "out": ("tab:brown", "activations and gradients down (device -> host)")}
_HOST = ("0.6", "host: waiting for inputs or weights")


def _role(e) -> str:
    role = e.get("role")
    if role in _ROLES:
        return role
    name = str(e.get("name", "")).lower()   # an engine that names its spans only
    return "bwd" if "backward" in name and "forward" not in name else "fwd"


def _draw_trace(fig, trace) -> None:
    from matplotlib.patches import Patch

    devices = sorted({_device_label(e) for e in trace},
                     key=lambda d: (d.split(":")[0], int(d.split(":")[1]) if d.split(":")[-1].isdigit() else 0))
    t0 = min(float(e["start_s"]) for e in trace)
    t_end = max(float(e["end_s"]) for e in trace) - t0
    ax = fig.add_subplot()
    # y positions: per device a compute lane (height 0.8), a transfer lane and a host lane (0.3 each)
    lanes, ticks, y = {}, [], 0.0
    for d in devices:
        lanes[(d, "compute")] = (y, 0.8)
        lanes[(d, "transfer")] = (y + 0.75, 0.3)
        lanes[(d, "host")] = (y + 1.1, 0.3)
        ticks += [(y, f"{d} compute"), (y + 0.75, f"{d} transfers"), (y + 1.1, f"{d} host")]
        y += 1.8
    axis_px = fig.get_figwidth() * fig.dpi * 0.8
    computes = [e for e in trace if e.get("stream") == "compute"]
    jobs = {}
    for e in trace:
        start, end = float(e["start_s"]) - t0, float(e["end_s"]) - t0
        width = max(end - start, t_end * 1e-4)
        d, stream = _device_label(e), str(e.get("stream", ""))
        if stream == "compute":
            role = _role(e)
            yc, h = lanes[(d, "compute")]
            ax.barh(yc, width, left=start, height=h, color=_ROLES[role][0], edgecolor="black", lw=0.4)
            stage, mb = e.get("stage"), e.get("microbatch")
            if mb is None:   # an engine that names its spans only: "forward mb0"
                m = re.search(r"mb\s*(\d+)", str(e.get("name", "")))
                mb = int(m.group(1)) if m else None
            label = f"s{stage} {role}" if stage is not None else role
            if mb is not None:
                label += f"\nmb{mb}"
            if width / t_end * axis_px >= 26:
                ax.text(start + width / 2, yc, label, ha="center", va="center", fontsize=6)
            job = e.get("job")
            if job is not None and (job not in jobs or start < jobs[job][0]):
                jobs[job] = (start, yc - h / 2, stage, role)
        elif stream in _TRANSFERS:
            yc, h = lanes[(d, "transfer")]
            ax.barh(yc, width, left=start, height=h, color=_TRANSFERS[stream][0], lw=0)
        else:
            yc, h = lanes[(d, "host")]
            ax.barh(yc, width, left=start, height=h, color=_HOST[0], lw=0)
    if len(jobs) <= 24:   # each stage job's start, above its first microbatch
        for job, (start, top, stage, role) in jobs.items():
            ax.text(start, top - 0.05, f"job {job}", ha="left", va="bottom", fontsize=6, color="0.2")
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=7)
    ax.set_ylim(y - 0.5, -0.8)
    ax.set_xlim(0, t_end * 1.01)
    ax.set_xlabel("seconds since the step began")
    n_mb = len({e.get("microbatch") for e in computes if e.get("microbatch") is not None})
    what = plural(len(jobs), "stage job") if jobs else plural(len(computes), "compute span")
    if n_mb:
        what += " x " + plural(n_mb, "microbatch", "microbatches")
    ax.set_title(f"the last step: {what} on "
                 f"{plural(len(devices), 'device')} (cm.last_trace); bars: s<stage> <role>, mb<microbatch>",
                 fontsize=9)
    roles = sorted({_role(e) for e in computes}, key=list(_ROLES).index)
    streams = [k for k in _TRANSFERS if any(e.get("stream") == k for e in trace)]
    handles = ([Patch(color=_ROLES[r][0], label=_ROLES[r][1]) for r in roles]
               + [Patch(color=_TRANSFERS[k][0], label=_TRANSFERS[k][1]) for k in streams]
               + ([Patch(color=_HOST[0], label=_HOST[1])]
                  if any(str(e.get("stream", "")) not in _TRANSFERS and e.get("stream") != "compute" for e in trace)
                  else []))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(4, len(handles)),
              fontsize=7, frameon=False)


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
