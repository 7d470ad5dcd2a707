"""Pictures: a step's timeline (``fz3.trace(..., png=)``) and a memory plan over the step's ops
(``MemoryPlan.plot``). matplotlib is optional (``pip install 'fz3[plot]'``): without it a
picture raises ``ImportError`` naming the extra, and nothing else changes."""

from __future__ import annotations

from typing import Any, Sequence

MiB = 2**20
# op kinds whose position the memory picture marks, and how
MARKS = {"gather": ("tab:green", "gather"), "free": ("tab:gray", "free"),
         "reduce": ("tab:red", "reduce")}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files, no display), or ImportError naming the
    extra that installs it."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("fz3's pictures need matplotlib: pip install 'fz3[plot]' (or "
                          "matplotlib); nothing else in fz3 needs it") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory_picture(path: str, labels: Sequence[str], planned: Sequence[int], persistent: int,
                   measured: Sequence[int] | None = None, title: str = "") -> None:
    """Bytes over a step's ops: the plan's (``persistent`` + what the step holds after each op)
    and, when given, what was measured at each op; each unit's gathers, frees and reduces
    marked at their op."""
    plt = pyplot()
    xs = range(len(planned))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.18 * len(planned)), 4.5))
    ax.step(xs, [(persistent + b) / MiB for b in planned], where="mid", color="tab:blue",
            label="planned (fz3.memory_plan)")
    if measured is not None:
        ax.step(xs, [(persistent + b) / MiB for b in measured], where="mid", color="tab:orange",
                linestyle="--", label="measured (fz3.measure_memory)")
    ax.axhline(persistent / MiB, color="black", linewidth=0.6, linestyle=":",
               label="params, grads and optimizer state kept between steps")
    top = max([*planned, *(measured or [])], default=0)
    for kind, (color, name) in MARKS.items():
        at = [i for i, label in enumerate(labels) if label.split(" ")[0] == kind]
        if at:
            ax.scatter(at, [(persistent + top) / MiB * 1.02] * len(at), marker="|", s=60,
                       color=color, label=name)
    ax.set_xticks(list(xs), list(labels), rotation=90, fontsize=6)
    ax.set_xlabel("the step's ops (schedule order)")
    ax.set_ylabel("MiB on this rank")
    ax.set_title(title or "memory over one step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_picture(chrome: dict, path: str, rank: int, lanes: dict[str, int]) -> None:
    """The lanes of ``chrome`` (a ``fz3.chrome_trace``): each compute block labelled with its
    unit, each step's start marked, the steps that traced or compiled layers left out (unless
    all did), times in ms from the first step shown; ``lanes``: lane name -> its row."""
    plt = pyplot()
    timed = [ev for ev in chrome["traceEvents"] if ev["ph"] == "X"]
    shown = [ev for ev in timed if not ev.get("args", {}).get("traced")] or timed
    left_out = sorted({ev["args"]["step"] for ev in timed if ev.get("args", {}).get("traced")
                       and "step" in ev["args"]}) if len(shown) < len(timed) else []
    t0 = min((ev["ts"] for ev in shown), default=0.0)
    fig, ax = plt.subplots(figsize=(14, 3.6))
    colors = {"compute": "tab:blue", "waits": "tab:red", "issue": "tab:gray",
              "in flight": "tab:green", "device": "tab:purple"}
    names = {tid: name for name, tid in lanes.items()}
    span = max((ev["ts"] + ev["dur"] - t0 for ev in shown), default=1.0) / 1e3
    starts: dict[int, float] = {}
    for ev in shown:
        name = names[ev["tid"]]
        left, width = (ev["ts"] - t0) / 1e3, ev["dur"] / 1e3
        ax.barh(ev["tid"], width, left=left, color=colors[name], height=0.8,
                edgecolor="white", linewidth=0.3)
        if ev.get("cat") == "op" and "step" in ev["args"]:
            starts[ev["args"]["step"]] = min(starts.get(ev["args"]["step"], left), left)
        if name == "compute" and width > span / 60:  # wide enough to read: the unit's name
            unit = ev["name"].split(" ", 1)[-1]
            ax.text(left + width / 2, ev["tid"], unit, ha="center", va="center", fontsize=6,
                    color="white", clip_on=True)
    for step, x in sorted(starts.items()):
        ax.axvline(x, color="black", linewidth=0.8, linestyle="--")
        ax.text(x, -0.7, f" step {step}", fontsize=7, va="bottom")
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_ylim(len(lanes) - 0.4, -1.0)
    ax.set_xlabel("host time (ms) from the first step shown")
    note = f"; step(s) {left_out} traced or compiled layers, left out" if left_out else ""
    ax.set_title(f"rank {rank}: one lane per kind of op{note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
