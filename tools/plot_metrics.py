"""Plot a run's TensorBoard scalars (loss, learning rate, throughput) into one PNG.

    python tools/plot_metrics.py --tensorboard-dir runs/demo --output runs/demo/metrics.png
"""
import argparse
import os
import sys

PANELS = [("loss", ["lm loss", "validation lm loss"]), ("learning rate", ["learning-rate"]),
          ("tokens per second", ["tokens-per-second"]), ("TFLOP/s per device", ["tflops-per-device"])]


def read_scalars(log_dir):
    """{tag: ([steps], [values])} from every event file under log_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: ([e.step for e in accumulator.Scalars(tag)], [e.value for e in accumulator.Scalars(tag)])
            for tag in accumulator.Tags()["scalars"]}


def plot(scalars, output):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 3.6))
    for axis, (title, tags) in zip(axes, PANELS):
        for tag in tags:
            if tag in scalars:
                axis.plot(*scalars[tag], marker="." if len(scalars[tag][0]) < 50 else None, label=tag)
        axis.set_title(title)
        axis.set_xlabel("iteration")
        if len([t for t in tags if t in scalars]) > 1:
            axis.legend()
    figure.tight_layout()
    temporary = output + ".tmp.png"
    figure.savefig(temporary, dpi=110)
    os.replace(temporary, output)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensorboard-dir", required=True, help="the --tensorboard-dir of a pretrain.py run")
    parser.add_argument("--output", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.tensorboard_dir):
        parser.error(f"--tensorboard-dir {args.tensorboard_dir}: no such directory")
    scalars = read_scalars(args.tensorboard_dir)
    if "lm loss" not in scalars:
        parser.error(f"--tensorboard-dir {args.tensorboard_dir}: no 'lm loss' scalars (was the run logged there?)")
    plot(scalars, args.output)
    print(f"wrote {args.output} ({len(scalars['lm loss'][0])} logged iterations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
