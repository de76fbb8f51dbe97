"""Draw the pipeline timelines pretrain.py --pipeline-timeline DIR wrote into one PNG: a row per rank, a bar per
instruction (forward, backward, input and weight gradients, sends, receives, loads, reductions, the optimizer
step), time in milliseconds from the first recorded instruction.

    python tools/plot_timeline.py --timeline-dir runs/timeline --output runs/timeline/timeline.png
"""
import argparse
import glob
import json
import os
import sys

COLOURS = {"ForwardPass": "#4c72b0", "BackwardPass": "#dd8452", "BackwardInputPass": "#c44e52",
           "BackwardWeightPass": "#8172b3", "SendActivation": "#55a868", "RecvActivation": "#8fd19e",
           "SendGrad": "#937860", "RecvGrad": "#d9b38c", "LoadMicroBatch": "#aaaaaa"}
OTHER = "#333333"   # the reductions and the optimizer step


def read_timelines(folder):
    """{rank: (process name, [(name, start ms, duration ms)])}, times from the earliest event of any rank."""
    traces = {}
    for path in sorted(glob.glob(os.path.join(folder, "timeline_rank*.json"))):
        events = json.load(open(path))["traceEvents"]
        names = {event["pid"]: event["args"]["name"] for event in events if event.get("name") == "process_name"}
        for event in events:
            if event.get("ph") == "X":
                traces.setdefault(event["pid"], (names.get(event["pid"], f"rank {event['pid']}"), []))[1].append(
                    (event["cat"], event["ts"], event["dur"]))
    if not traces:
        raise ValueError(f"no timeline_rank*.json in {folder} (pretrain.py --pipeline-timeline {folder} writes them)")
    origin = min(start for _, events in traces.values() for _, start, _ in events)
    return {rank: (name, [(kind, (start - origin) / 1e3, duration / 1e3) for kind, start, duration in events])
            for rank, (name, events) in sorted(traces.items())}


def plot(timelines, output):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    figure, axis = plt.subplots(figsize=(14, 0.6 * len(timelines) + 1.5))
    for row, (rank, (name, events)) in enumerate(timelines.items()):
        for kind in {kind for kind, _, _ in events}:
            bars = [(start, duration) for each, start, duration in events if each == kind]
            axis.broken_barh(bars, (row - 0.4, 0.8), color=COLOURS.get(kind, OTHER))
    axis.set_yticks(range(len(timelines)), [name for name, _ in timelines.values()])
    axis.invert_yaxis()
    axis.set_xlabel("ms")
    shown = {kind for _, events in timelines.values() for kind, _, _ in events}
    axis.legend(handles=[Patch(color=colour, label=kind) for kind, colour in COLOURS.items() if kind in shown]
                + [Patch(color=OTHER, label="reductions, optimizer step")], loc="upper center",
                bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize="small")
    figure.tight_layout()
    temporary = output + ".tmp.png"
    figure.savefig(temporary, dpi=110)
    os.replace(temporary, output)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="plot_timeline.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeline-dir", required=True, help="the folder pretrain.py --pipeline-timeline wrote")
    parser.add_argument("--output", default=None, help="the PNG (default: DIR/timeline.png)")
    args = parser.parse_args(argv)
    try:
        timelines = read_timelines(args.timeline_dir)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as error:
        print(f"plot_timeline: error: {error}", file=sys.stderr)
        return 2
    output = args.output or os.path.join(args.timeline_dir, "timeline.png")
    plot(timelines, output)
    print(f"plot_timeline: wrote {output} ({len(timelines)} ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
