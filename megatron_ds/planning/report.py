"""Plain-text rendering of a plan, a search and a meta-instantiation check."""
from megatron_ds.planning.memory import GIB

MIB = 1024 ** 2


def _count(n) -> str:
    return f"{n:,} ({n / 1e9:.2f}e9)" if n >= 1e8 else f"{n:,}"


def _gib(x) -> str:
    return f"{x / GIB:.2f}"


def human_bytes(x) -> str:
    return f"{x / GIB:.2f} GiB" if x >= GIB else f"{x / MIB:.1f} MiB"


def model_lines(model_summary, cluster_summary):
    m, c = model_summary, cluster_summary
    kv = f" ({m['kv_heads']} kv)" if m["kv_heads"] != m["heads"] else ""
    features = ", ".join(m["features"])
    moe = ([f"         {_count(m['total_parameters'])} parameters, {_count(m['active_parameters'])} active per "
            f"token (vocab padded for TP 1)"] if "moe" in m or "dropless_moe" in m else [])
    return [f"model:   {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads{kv}, FFN {m['ffn']}, "
            f"seq {m['seq_length']}, vocab {m['vocab_size']}, {m['precision']}, {features}"] + moe + [
            f"cluster: {c['world_size']} x {c['device']} ({c['memory_gib']:g} GiB, {c['peak_tflops']:g} TFLOP/s "
            f"peak{_fp8_peak(m, c)}), {c['gpus_per_node']} per node"]


def _fp8_peak(model_summary, cluster_summary) -> str:
    return f", FP8 {cluster_summary['peak_fp8_tflops']:g}" if "FP8" in model_summary["precision"] else ""


def _parameter_lines(parameters, moe=None, dropless=None):
    lines = ["Parameters", f"  total (distinct, vocab padded to {parameters['padded_vocab_size']}): "
                           f"{_count(parameters['total'])}"]
    if "mtp" in parameters:
        lines.append(f"  multi-token prediction modules, beside the total (embedding and head shared): "
                     f"{_count(parameters['mtp'])}")
    if dropless:
        lines += _dropless_parameter_lines(parameters, dropless)
    elif moe:
        lines.append(f"  active per token (router, top-{moe['top_k']} experts"
                     f"{', residual MLP' if moe['residual'] else ''}): {_count(parameters['active'])}")
        lines.append(f"  MoE: {len(moe['moe_layers'])} layers (every {moe['expert_interval']}), "
                     f"{_values(moe['experts'])} experts of {moe['parameters_per_expert']:,} parameters; EP "
                     f"{moe['expert_parallel_size']}: {_values(moe['experts_per_rank'])} experts per rank and "
                     f"layer; expert states sharded over {moe['expert_data_parallel_size']} (TP x DP / EP) ranks")
        lines.append("  stages  layers  stage total (all TP/EP ranks) per device     "
                     "(embedding / layers (of which experts) / norm / head)")
    else:
        lines.append("  stages  layers  stage total (all TP ranks)   per device     (embedding / layers / norm / head)")
    for first, last, row in _runs_of_equal_stages(parameters["per_stage"]):
        parts = row["per_device_parts"]
        stages = f"{first}" if first == last else f"{first}-{last}"
        experts = f" ({parts['experts']:,})" if "experts" in parts else ""
        mtp = f" + MTP {parts['mtp']:,}" if parts.get("mtp") else ""
        lines.append(f"  {stages:>6}  {row['layers']:>6}  {_count(row['stage_total']):>27}  "
                     f"{_count(row['per_device']):>22}  ({parts['embedding']:,} / {parts['layers']:,}{experts} / "
                     f"{parts['final_norm']:,} / {parts['output_head']:,}{mtp})")
    return lines


def _dropless_parameter_lines(parameters, dropless):
    shared = ", shared expert" if dropless["shared_expert_ffn_hidden_size"] else ""
    return [f"  active per token (router, top-{dropless['top_k']} experts{shared}): {_count(parameters['active'])}",
            f"  dropless MoE: {len(dropless['moe_layers'])} layers, {dropless['experts']} experts of "
            f"{dropless['parameters_per_expert']:,} parameters (FFN {dropless['ffn_hidden_size']}); EP "
            f"{dropless['expert_parallel_size']}: {dropless['experts_per_rank']} experts per rank and layer; expert "
            f"states sharded over {dropless['expert_data_parallel_size']} (TP x U x DP / EP) ranks; fp32 buffers "
            f"(expert bias, counts) {dropless['buffer_bytes_per_layer']:,} bytes per layer; its MLP's forward "
            f"{dropless['forward_flops_per_token']:,.0f} FLOPs per token (router, top-{dropless['top_k']}, shared)",
            "  stages  layers  stage total (all TP/EP ranks) per device     "
            "(embedding / layers (of which experts) / norm / head)"]


def _dropless_row_lines(dropless):
    """The rows one rank routes and computes per dropless MoE layer, and the MoE MLP's activations for each."""
    if not dropless:
        return []
    rows = dropless["rows_per_layer_per_micro_batch"]
    return [f"  dropless MoE per layer and micro-batch: {rows['tokens']:,.0f} tokens routed, {rows['rows_sent']:,.0f} "
            f"rows sent ({rows['rows_per_expert_from_each_rank']:,.1f} per expert); a rank's experts compute "
            f"{rows['rows_computed_expected']:,.0f} rows expected (planned: uniform routing), "
            f"{rows['rows_computed_worst']:,.0f} at worst; MoE MLP activations "
            f"{human_bytes(rows['mlp_activation_bytes_expected'])} expected, "
            f"{human_bytes(rows['mlp_activation_bytes_worst'])} at worst"]


def _values(values) -> str:
    """One value when all MoE layers share it (8), else each layer's (2, 4: PR-MoE's pyramid)."""
    return str(values[0]) if len(set(values)) == 1 else ", ".join(map(str, values))


def _runs_of_equal_stages(rows):
    """(first stage, last stage, row) for each run of consecutive stages with the same counts."""
    runs = []
    for row in rows:
        same = runs and {**runs[-1][2], "stage": row["stage"]} == row and runs[-1][1] == row["stage"] - 1
        if same:
            runs[-1] = (runs[-1][0], row["stage"], runs[-1][2])
        else:
            runs.append((row["stage"], row["stage"], row))
    return runs


def _stage_columns(rows):
    """Stages to show as columns: all up to 4, else the first two, the peak and the last."""
    if len(rows) <= 4:
        return rows
    return rows[:2] + [rows[-1]]


def _memory_lines(memory):
    rows = memory["per_stage"]
    shown = _stage_columns(rows)
    peak = next(row for row in rows if row["stage"] == memory["peak_stage"])
    if peak not in shown:
        shown = shown[:2] + [peak] + shown[2:]
    state = memory["state_bytes_per_parameter_on_device"]
    header = "  GiB per device                 " + "".join(f"{'stage ' + str(row['stage']):>11}" for row in shown)
    entries = [("weights", "weights", f"{state['weights']:g} B/param"),
               ("gradients", "gradients", f"{state['gradients']:g} B/param"),
               ("fp32 grad accumulation", "grad_accumulation", f"{state['grad_accumulation']:g} B/param"),
               ("optimizer (sharded)", "optimizer", f"{state['optimizer']:.3g} B/param" + (
                   f"; experts {memory['expert_state_bytes_per_parameter_on_device']['optimizer']:.3g} B/param"
                   if "expert_state_bytes_per_parameter_on_device" in memory else "")),
               ("activations", "activations", "micro-batches in flight: " +
                ", ".join(str(row["in_flight_micro_batches"]) for row in shown)),
               ("runtime overhead (assumed)", "overhead", ""),
               ("total", "total", "")]
    if any(row.get("buffers") for row in rows):
        entries.insert(-2, ("buffers (fp32)", "buffers", "the dropless MoE layers' expert bias and counts"))
    if any(row.get("teacher") for row in rows):
        entries.insert(-2, ("teacher (--kd, frozen)", "teacher", "weights, carried hidden states, logits"))
    lines = ["Memory per device", header]
    for label, key, note in entries:
        values = "".join(f"{_gib(row[key]):>11}" for row in shown)
        lines.append(f"  {label:<30}{values}" + (f"   {note}" if note else ""))
    verdict = "fits" if memory["fits"] else "DOES NOT FIT"
    lines.append(f"  peak: stage {memory['peak_stage']}, {_gib(memory['peak_bytes'])} GiB of "
                 f"{_gib(memory['capacity_bytes'])} GiB: {verdict}, margin {_gib(memory['margin_bytes'])} GiB")
    per_layer = memory["activation_bytes_per_layer"]
    lines.append("  activations per layer and micro-batch: " + ", ".join(
        f"{'no recompute' if key == 'None' else key} {human_bytes(value)}" for key, value in per_layer.items()))
    return lines


def _flops_lines(flops, layout):
    variants = flops["hardware_per_iteration_by_recompute"]
    return ["FLOPs per iteration",
            f"  model {flops['model_per_iteration']:.4e}; hardware {flops['hardware_per_iteration']:.4e} "
            f"(recompute {layout['recompute'] or 'none'})",
            "  hardware by recompute: " + ", ".join(
                f"{'none' if key == 'None' else key} {value:.4e}" for key, value in variants.items())]


def _expert_parallel_lines(communication, links):
    if "expert_parallel" not in communication:
        return []
    ep = communication["expert_parallel"]
    if isinstance(ep["all_to_all_per_layer_per_micro_batch"], dict):
        return _dropless_all_to_all_lines(ep, links)
    layers = "; ".join(
        f"{row['num_experts']} experts x capacity {row['capacity']} slots: buffer {human_bytes(row['payload'])}, "
        f"{human_bytes(row['per_all_to_all'])} sent per all-to-all, {human_bytes(row['forward'] + row['backward'])} "
        f"forward + backward" + (f", recompute {human_bytes(row['recompute'])}" if row["recompute"] else "")
        for row in ep["all_to_all_per_layer_per_micro_batch"])
    return [f"  EP ({_link(links, 'expert')}): 4 all-to-alls per MoE layer per micro-batch "
            f"(dispatch and combine, forward and backward), (EP-1)/EP of each sent: {layers}; per iteration "
            f"{human_bytes(ep['per_iteration_per_device'])}"]


def _dropless_all_to_all_lines(ep, links):
    row = ep["all_to_all_per_layer_per_micro_batch"]
    return [f"  EP ({_link(links, 'expert')}): per dropless MoE layer and micro-batch an all-to-all of the expert "
            f"counts ({row['counts']:,.0f} bytes sent), the {row['rows']:,.0f} rows out and their outputs back "
            f"(uneven splits, uniform routing taken: {human_bytes(row['payload'])} each, "
            f"{human_bytes(row['per_all_to_all'])} sent), the two conjugates in backward: "
            f"{human_bytes(row['forward'] + row['backward'])} forward + backward"
            + (f", recompute {human_bytes(row['recompute'])}" if row["recompute"] else "")
            + f"; per iteration {human_bytes(ep['per_iteration_per_device'])}"]


def _link(links, axis) -> str:
    """"300 GB/s", " inter-node" added where the axis's groups cross nodes."""
    return f"{links[axis] / 1e9:g} GB/s{' inter-node' if links[f'{axis}_spans_nodes'] else ''}"


def _per_layer(per_layer) -> str:
    return (f"per layer per micro-batch forward {human_bytes(per_layer['forward'])}, backward "
            f"{human_bytes(per_layer['backward'])}, recompute {human_bytes(per_layer['recompute'])}")


def _ulysses_lines(communication, links):
    if "ulysses" not in communication:
        return []
    ulysses = communication["ulysses"]
    per_layer = ulysses["per_layer_per_micro_batch"]
    return [f"  Ulysses SP {ulysses['ranks']} ({_link(links, 'ulysses')}): 4 all-to-alls in forward (q, k, v, "
            f"context), 4 in backward, (U-1)/U of each sent: payload {human_bytes(per_layer['payload'])}, "
            f"{human_bytes(per_layer['per_all_to_all'])} sent per all-to-all; {_per_layer(per_layer)}; per iteration "
            f"{human_bytes(ulysses['per_iteration_per_device'])}"]


def _context_lines(communication, links):
    if "context" not in communication:
        return []
    context = communication["context"]
    per_layer = context["per_layer_per_micro_batch"]
    exchange = ("the ring: K/V CP-1 hops forward; K/V CP-1 and fp32 dK/dV CP hops backward"
                if per_layer["exchange"] == "p2p" else
                "all-gathered: K/V forward and again backward, fp32 dK/dV reduce-scattered")
    return [f"  CP {context['ranks']} ({_link(links, 'context')}): {exchange}; key/value block "
            f"{human_bytes(per_layer['block'])}, its fp32 gradients {human_bytes(per_layer['gradient_block'])}; "
            f"{_per_layer(per_layer)}; per iteration {human_bytes(context['per_iteration_per_device'])}"]


def _split_note(pipeline, links):
    """DeepSpeed's messages split over TP: each rank sends 1/t, the receiver all-gathers them on the TP link."""
    if not pipeline["split_over_tensor_parallel"]:
        return ""
    return (f", split over TP (1/t sent per rank, all-gathered on arrival: "
            f"{human_bytes(pipeline['tensor_parallel_gathers_per_iteration_per_device'])} per iteration over "
            f"{_link(links, 'tensor')})")


def _communication_lines(communication, links):
    tp, pp, dp = communication["tensor_parallel"], communication["pipeline"], communication["data_parallel"]
    dp_parts = dp["per_iteration_per_device"]
    split = " x ".join(name for name in ("U", "CP") if {"U": "ulysses", "CP": "context"}[name] in communication)
    over = f", over {split} x DP = {dp['ranks']} ranks" if split else ""
    return ["Communication per device per iteration (bytes sent, ring algorithms)",
            f"  TP ({_link(links, 'tensor')}): {tp['collectives']}; payload {human_bytes(tp['payload_bytes'])}; "
            f"{_per_layer(tp['per_layer_per_micro_batch'])}; per iteration "
            f"{human_bytes(tp['per_iteration_per_device'])}",
            *_fp8_amax_lines(communication),
            *_ulysses_lines(communication, links),
            *_context_lines(communication, links),
            f"  PP ({links['pipeline'] / 1e9:g} GB/s): activation {human_bytes(pp['payload_bytes_per_micro_batch'])} "
            f"forward + gradient backward per micro-batch{_split_note(pp, links)}; per iteration "
            f"{human_bytes(pp['per_iteration_per_device'])} (the rank that sends most)",
            f"  DP ({links['data'] / 1e9:g} GB/s{over}): gradient all-reduce "
            f"{human_bytes(dp_parts.get('gradient_all_reduce', 0))}, ZeRO weight all-gather "
            f"{human_bytes(dp_parts.get('weight_all_gather', 0))}; tied embedding all-reduce "
            f"{human_bytes(dp['tied_embedding_all_reduce'])}"] + _expert_parallel_lines(communication, links)


def _fp8_amax_lines(communication):
    amax = communication.get("fp8_amax_per_layer_per_micro_batch")
    if not amax or not amax["forward"] + amax["backward"]:
        return []
    return [f"  FP8 amax all-reduces over TP per FP8 layer and micro-batch: {amax['forward']} forward, "
            f"{amax['backward']} backward ({human_bytes(amax['forward_bytes'] + amax['backward_bytes'])} sent; "
            f"timed as latency)"]


def _performance_lines(performance):
    b, slowest = performance["breakdown_s"], performance["slowest_stage"]
    return ["Estimated time",
            f"  iteration {performance['iteration_s']:.3f} s = pipeline {b['pipeline']:.3f} (bubble "
            f"{performance['bubble_fraction']:.1%}: {b['of_which_bubble']:.3f}) + data-parallel "
            f"{b['data_parallel']:.3f} + tied embedding {b['tied_embedding']:.3f} + optimizer step "
            f"{b['optimizer_step']:.3f}",
            f"  slowest stage ({slowest['stage']}) per micro-batch: compute {slowest['compute'] * 1e3:.1f} ms, TP "
            f"{slowest['tensor_parallel'] * 1e3:.1f} ms, PP send/recv {slowest['pipeline_p2p'] * 1e3:.1f} ms, "
            f"grad accumulation {slowest['grad_accumulation'] * 1e3:.1f} ms"
            + "".join(f", {name} all-to-all {slowest[key] * 1e3:.1f} ms" for name, key in
                      (("EP", "expert_all_to_all"), ("Ulysses", "ulysses_all_to_all")) if slowest.get(key))
            + _context_time(slowest)
            + (f", {slowest['fp8_amax_reductions']} FP8 amax all-reduces {slowest['fp8_amax_latency'] * 1e3:.1f} ms"
               if slowest.get("fp8_amax_reductions") else ""),
            f"  TFLOP/s per device: {performance['hardware_tflops_per_device']:.1f} hardware, "
            f"{performance['model_tflops_per_device']:.1f} model; MFU {performance['mfu']:.1%}; "
            f"{performance['tokens_per_second']:,.0f} tokens/s"]


def _context_time(slowest) -> str:
    """", CP 1.2 ms exposed (3.4 ms behind the attention blocks)" where the stage has CP traffic."""
    if not (slowest.get("context_exposed") or slowest.get("context_hidden")):
        return ""
    return (f", CP {slowest['context_exposed'] * 1e3:.1f} ms exposed ({slowest['context_hidden'] * 1e3:.1f} ms behind "
            f"the attention blocks)")


def _checkpoint_lines(checkpoint):
    lines = ["Checkpoints",
             f"  {human_bytes(checkpoint['bytes'])} each (weights and optimizer states), written in "
             f"{checkpoint['write_s']:.0f} s at {checkpoint['write_gbs']:g} GB/s"]
    if "save_interval" in checkpoint:
        lines.append(f"  with a failure every {checkpoint['mtbf_hours']:g} h: --save-interval "
                     f"{checkpoint['save_interval']} (Young: sqrt(2 x write time x MTBF)); a failure then loses "
                     f"{checkpoint['lost_per_failure_s'] / 60:.1f} min of iterations on average plus the restart, "
                     f"saves take {checkpoint['overhead_fraction']:.1%} of the time (less with --async-save)")
    else:
        lines.append("  --mtbf-hours H gives the --save-interval that loses the least time to failures and saves")
    return lines


def plan_text(result) -> str:
    lines = model_lines(result["model"], result["cluster"])
    plan = result["plan"]
    lines.append(f"layout:  {result['layout_description']}")
    if plan["errors"]:
        lines += ["Invalid layout:"] + [f"  - {reason}: {detail}" for reason, detail in plan["errors"]]
        return "\n".join(lines)
    for section in (_parameter_lines(plan["parameters"], plan.get("moe"), plan.get("dropless_moe")),
                    _memory_lines(plan["memory"]) + _dropless_row_lines(plan.get("dropless_moe")),
                    _flops_lines(plan["flops"], plan["layout"]),
                    _communication_lines(plan["communication"], plan["performance"]["links"]),
                    _performance_lines(plan["performance"]), _checkpoint_lines(plan["checkpoint"])):
        lines += [""] + section
    if plan["warnings"]:
        lines += ["", "Warnings"] + [f"  - {warning}" for warning in plan["warnings"]]
    lines += ["", "Assumptions"] + [f"  - {assumption}" for assumption in result["assumptions"]]
    return "\n".join(lines)


def search_text(result) -> str:
    search = result["search"]
    lines = model_lines(result["model"], result["cluster"])
    lines.append(f"search:  global batch {search['global_batch_size']}; {search['candidates']} layouts, "
                 f"{search['feasible']} feasible; top {len(search['ranked'])} by estimated iteration time")
    if search["sequence_split_skipped"]:
        lines.append(f"         {search['sequence_split_skipped']} layouts with Ulysses SP or CP not tried: the same "
                     f"TP, PP, micro batch, SP and recompute fit with a smaller Ulysses or CP size (or none)")
    lines.append("   #   TP  Uly   CP   PP   DP  mb     m  SP   recompute     schedule  mem GiB  bubble   iter s  "
                 "TFLOP/s    MFU")
    for rank, row in enumerate(search["ranked"], 1):
        lines.append(f"  {rank:>2} {row['tp']:>4} {row['ulysses']:>4} {row['context']:>4} {row['pp']:>4} "
                     f"{row['dp']:>4} {row['micro_batch_size']:>3} {row['num_micro_batches']:>5}  "
                     f"{'on ' if row['sequence_parallel'] else 'off'} "
                     f"{row['recompute'] or 'none':>11} {_schedule_name(row):>12} "
                     f"{row['peak_memory_gib']:>8.1f} {row['bubble_fraction']:>7.1%} "
                     f"{row['iteration_s']:>8.3f} {row['hardware_tflops_per_device']:>8.1f} {row['mfu']:>6.1%}"
                     + ("  TP spans nodes" if row["tp_spans_nodes"] else ""))
    lines.append("Infeasible, by the first rule broken:")
    for reason, entry in search["infeasible_by_reason"].items():
        lines.append(f"  {reason}: {entry['count']}")
        lines += [f"      e.g. {example}" for example in entry["examples"]]
    lines += ["", "Assumptions"] + [f"  - {assumption}" for assumption in result["assumptions"]]
    return "\n".join(lines)


def _schedule_name(row) -> str:
    """"1f1b", "zbh1", "dualpipev", "interleaved 2" (v) as the search table shows them."""
    if row["pipeline_schedule"] == "interleaved":
        return f"interleaved {row['virtual_stages']}"
    return row["pipeline_schedule"]


def instantiate_text(check) -> str:
    lines = [f"Meta-device instantiation (TP rank 0 of {check['tp']}, {check['pp']} stages): "
             + ("every stage matches the formula" if check["ok"] else "MISMATCH")]
    for stage, row in check["stages"].items():
        if row["difference"] or len(check["stages"]) <= 4 or stage in (0, check["pp"] - 1):
            lines.append(f"  stage {stage}: built {row['built']:,}, formula {row['formula']:,}, "
                         f"difference {row['difference']:,}")
    lines.append(f"  ({check['seconds']:.1f} s)")
    return "\n".join(lines)
