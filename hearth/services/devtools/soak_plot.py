"""The soak's timeline (matplotlib): each call as a bar over its duration coloured by outcome, the faults as shaded
spans, and each process's resident memory below, on one time axis."""

from __future__ import annotations

from pathlib import Path

OUTCOME_COLOURS = {"identical": "tab:green", "documented": "tab:orange", "wrong": "tab:red", "unexplained": "black"}
FAULT_COLOURS = {"kill_shard": "tab:red", "freeze_shard": "tab:blue", "restart_shard": "tab:purple",
                 "restart_orchestrator": "tab:brown", "cut_link": "tab:gray", "restart_nats": "tab:olive"}
figure_size_in = (12, 7)
figure_dpi = 80


def draw_timeline(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (calls_axis, memory_axis) = plt.subplots(2, 1, sharex=True, figsize=figure_size_in,
                                                     gridspec_kw={"height_ratios": [1, 1.3]})
    for fault in report["faults"]:
        for axis in (calls_axis, memory_axis):
            axis.axvspan(fault["started_s"], fault["healed_s"] or fault["started_s"],
                         color=FAULT_COLOURS.get(fault["kind"], "tab:gray"), alpha=0.18, linewidth=0)
        calls_axis.text(fault["started_s"], 0.98, f"{fault['kind'].replace('_', ' ')} {fault['target']}", fontsize=6,
                        rotation=90, va="top", transform=calls_axis.get_xaxis_transform())
    for outcome, colour in OUTCOME_COLOURS.items():
        spans = [(call["started_s"], call["ended_s"] - call["started_s"], call["chat"])
                 for call in report["call_log"] if call["outcome"] == outcome]
        for chat in range(report["concurrent_chats"]):
            bars = [(start, width) for start, width, row in spans if row == chat]
            if bars:
                calls_axis.broken_barh(bars, (chat - 0.35, 0.7), facecolors=colour, edgecolor="white", linewidth=0.3)
        calls_axis.plot([], [], color=colour, linewidth=6,
                        label=f"{outcome} ({report['outcomes'].get(outcome, 0)})")
    calls_axis.set_yticks(range(report["concurrent_chats"]))
    calls_axis.set_ylabel("chat loop")
    calls_axis.legend(loc="upper right", fontsize=7, ncols=4)
    calls_axis.set_title(f"soak: {report['calls']} calls, {len(report['faults'])} faults, "
                         f"{'passed' if report['passed'] else 'FAILED'}")
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for sample in report["rss_samples"]:
        runs.setdefault((sample["process"], sample["pid"]), []).append((sample["t_s"], sample["rss_mib"]))
    colours: dict[str, str] = {}
    for (name, _pid), points in sorted(runs.items()):
        colour = colours.setdefault(name, f"C{len(colours) % 10}")
        memory_axis.plot([t for t, _ in points], [v for _, v in points], color=colour, linewidth=1,
                         label=name if name not in memory_axis.get_legend_handles_labels()[1] else None)
    memory_axis.set_yscale("log")  # NATS nodes (tens of MiB) beside Python processes (hundreds)
    memory_axis.set_ylabel("RSS (MiB)")
    memory_axis.set_xlabel("seconds since the mesh was up")
    memory_axis.legend(loc="upper left", fontsize=6, ncols=3)
    figure.tight_layout()
    figure.savefig(path, dpi=figure_dpi)
    plt.close(figure)
