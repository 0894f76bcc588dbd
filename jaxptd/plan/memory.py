"""The planner's device and host bytes per device, by category, from the parameter counts
(jaxptd/plan/counts.py) and the activations (jaxptd/plan/model.py's activation_memory):
what stays for the whole step, the forward and backward phase, the update phase, and what
offloading puts in host memory. No JAX.

Memory per device (the empirical study's model, Lu et al. §4.5: (alpha + 2) w + a, with our
specifics): float32 master weights (4 bytes), float32 gradients (4), the optimizer's float32
moments (Adam's mu and nu 8, SGD's momentum 4): 16 bytes per local parameter with Adam (the
3D-parallelism notes' "N_d 16 Psi < GPU RAM" for ZeRO-3). ZeRO-1 splits the moments over the
data replicas; FSDP (ZeRO-3) splits all of them over g and adds the one matmul weight it
gathers at a time; offload.optimizer keeps the masters and moments, and unpipelined the
gradients too, in host memory for the whole step, the device holding one layer's at a time
(see device_memory).

Two programs differ in what the backward holds beside the accumulator. A scanned layer
stack (CPU: model.scan_layers auto) makes a microbatch's gradient a whole stacked buffer
before it is added (the gradient workspace), and the reduction writes its result beside
the sum. Unrolled layers on a GPU add each layer's gradient into the accumulator as the
backward makes it, and hold the layers' weights cast to the compute dtype instead
(unrolled_gpu_extras): the A100 compiles of PTD-P's Table 1 rows (bench/table1.py).
"""
from __future__ import annotations

from jaxptd.plan.model import DTYPE_BYTES


def fsdp_gathered_bytes(counts: dict, gather_dtype: str, dtype: str,
                        whole_layer: bool = True, recomputed: bool = False,
                        gpu: bool = False, unrolled: bool = False,
                        head_cotangent: float = 0.0) -> dict:
    """What FSDP holds gathered on a device, {"layer": in a layer's backward, "head": in
    the head's} (jaxptd/train/step.py): the unit it gathers, in gather_dtype
    (optimizer.grad_reduce_dtype), cast to the compute dtype when that differs, and the
    unit's gradient in the compute dtype before its reduce-scatter; the unit is a whole
    layer (parallel.fsdp_unit=layer: counts["layer_gathered_params"]) or the largest
    dense() weight of a layer (matmul: one matmul's, counts["dense_unit_params"], 4 h^2
    for GPT's MLP, beside the rest of the layer, biases and norms, gathered with it); and
    a tied embedding's float32 gradient, which the head's backward begins and the
    embedding's ends (its reduce-scatter waits for both); the ends (embedding, positions,
    final norm) gathered and cast back to the masters' float32. A whole layer recomputed
    from its input (`recomputed`, model.remat=full) has no gradient of it held beside it:
    each weight's is reduce-scattered as it is made (measured on the CPU compile,
    tests/test_plan.py). gpu: the head's backward holds the ends gathered in the compute
    dtype alone (XLA's GPU program casts before gathering, and the tied embedding's
    float32 gradient comes after: the GPU program of the PyTorch FSDP 1T run's config).
    gpu with a recomputed layer gathered a matmul at a time (`_combined_layer_bytes`):
    the layer's weight gradients, and the head's cotangent (`head_cotangent` bytes) in
    place of the tied embedding's float32 gradient."""
    gather_bytes, e = DTYPE_BYTES[gather_dtype], DTYPE_BYTES[dtype]
    if gpu and recomputed and not whole_layer:
        return {"layer": _combined_layer_bytes(counts, gather_bytes, unrolled, head_cotangent),
                "head": e * counts["ends_params"]}
    unit = gather_bytes + (e if dtype != gather_dtype else 0) + e  # a gathered element
    layer_unit = unit - (e if recomputed else 0)
    rest = counts["layer_gathered_params"] * (layer_unit if whole_layer else gather_bytes)
    return {"layer": unit * counts["dense_unit_params"] + rest
            + 4 * counts["shared_ends_params"],
            "head": (e if gpu else gather_bytes + 4) * counts["ends_params"]}


def _combined_layer_bytes(counts: dict, gather_bytes: int, unrolled: bool,
                         head_cotangent: float) -> float:
    """What a GPU program holds for FSDP in a recomputed layer's backward, one matmul's
    weight gathered at a time: XLA's combiner makes one reduce-scatter of the layer's
    weight gradients, so all of them wait for the last, in the reduce dtype (the gathered
    weights the data gradients read are freed by then); unrolled, the next matmul's
    gather is in flight beside them. A tied embedding's gradient waits in its head's
    pieces instead: XLA runs the head's weight-gradient matmul after the layers', holding
    the logits' cotangent [b, s, V/t] and the head's input [b, s, h] (which XLA may
    recompute instead) in the compute dtype (`head_cotangent`). Read buffer by buffer at
    the peak of bench/table1.py's fsdp_175b (unrolled) and fsdp_1t (scanned) programs."""
    tied = head_cotangent if counts["shared_ends_params"] else 0.0
    return gather_bytes * (counts["layer_params"]  # (a stack element's, all its weights)
                           + (counts["dense_unit_params"] if unrolled else 0.0)) + tied


def offloaded_state_bytes(counts: dict, streams: bool) -> dict:
    """offload.optimizer (jaxptd/train/offload.py): {"device": what the device holds of the
    masters (and as much of their gradients) in the forward and backward: one layer's and
    the ends' with `streams`, fetched for their use and sent back, pipelined all of them;
    "update": the update's working set, one unit (a layer, or the ends) of masters,
    gradients and moments brought and written back}. Bytes."""
    W, M = counts["weight_params"], counts["moment_params"]
    unit = max(counts["layer_weight_params"], counts["ends_weight_params"]) / W if W else 0.0
    held = 4.0 * (counts["layer_weight_params"] + counts["ends_weight_params"]) if streams \
        else 4.0 * W
    return {"device": held, "update": 2 * unit * (8.0 * W + 4.0 * M)}


def unrolled_gpu_extras(counts: dict, dtype_bytes: float, pipe: int, chunk_layers: int,
                        microbatches: int, casts: bool) -> dict:
    """What a GPU program with unrolled layers holds through the backward in place of the
    scanned program's gradient workspace and reduced copy (module docstring), bytes:

    weight_copies: the weights cast to the compute dtype (`casts`: the step casts its
    stored weights, not FSDP's gathered units nor offload's fetched ones; none in
    float32). Unpipelined, each layer's are buffers of their own, read by its forward and
    again by its recomputation and backward: the stage's weights once. Pipelined, the
    executor casts the stage's stacked weights once before the rounds, and a round's F and
    B slots each slice their chunk's layers out of that stack into buffers of their own:
    the stage's weights plus two chunks' layers.
    gradient_workspace: unpipelined with m > 2, XLA double-buffers the microbatch loop
    (GPU_XLA_FLAGS' while-loop double buffering) and gives the largest stacked layer
    gradient of its carry a second buffer (the MLP's [L, 4h/t, h] in float32).
    Measured in XLA's buffer assignment of the 1.7B and 18.4B rows (at their peak, the
    last microbatch's backward) and a 39.1B stage, compiled for A100s: bench/table1.py."""
    sliced = 2 * chunk_layers * counts["layer_params"] if pipe > 1 else 0.0
    cast = dtype_bytes * (counts["stage_params"] + sliced) if casts and dtype_bytes < 4 else 0.0
    second = 4.0 * counts["layer_leaf_params"] if pipe == 1 and microbatches > 2 else 0.0
    return {"weight_copies": cast, "gradient_workspace": second}


def device_memory(*, counts: dict, activations: dict, microbatches: int,
                  gathered: dict | None = None, offload_optimizer: bool = False,
                  streams: bool = False, peeled: int = 0, zero1_hook: bool = False,
                  early_reduced: float = 0.0, reduced_copy: float = 0.0,
                  unrolled_gpu: dict | None = None) -> tuple[dict, dict]:
    """(device bytes, host bytes) per device, by category. The device total is its peak:
    what stays for the whole step plus the larger of two phases.

    counts (local element counts, jaxptd.plan.real_counts): weight_params (the masters,
    after tensor, pipe and FSDP sharding), moment_params (the optimizer's moments, also
    split by ZeRO-1), and what one layer and the ends are of them.
    For the whole step: weights (float32 masters), gradients (the float32 accumulator) and
    optimizer (the moments). Forward and backward phase: `_backward_phase` (its arguments
    are the rest of this function's). Update phase: the reduced gradient the update reads.
    unrolled_gpu (the GPU program, model.scan_layers resolved to unrolled: its
    unrolled_gpu_extras): no whole gradient workspace and no reduced copy beside the
    backward, its extras instead; the reduction and the update write in place of the sum
    and the state (at the A100 rows' end only the sum is live), so no update phase.
    offload.optimizer (jaxptd/train/offload.py): masters and moments live in host memory, and
    with `streams` (unpipelined) the gradients too: the device holds one layer's masters
    and gradients in the backward (and the ends'), and in the update one unit's state
    (offloaded_state_bytes); pipelined, the masters and gradients whole on the device.
    Unrolled on a GPU (unrolled_gpu) the masters fetched for a layer's forward stay until
    its backward (XLA fetches them once), every layer's at the first (the fsdp_175b
    compile of bench/table1.py grows a layer's masters a layer: 4, 8, 16, 32 layers), and
    with one microbatch each layer's update reads its gradient on the device as the
    backward reduces it: no host gradients."""
    W, M = counts["weight_params"], counts["moment_params"]
    grads, moments = 4.0 * W, 4.0 * M
    on_host = offload_optimizer and streams  # the gradients' sums, too
    offloaded = offloaded_state_bytes(counts, streams) if offload_optimizer else None
    if unrolled_gpu:  # each layer's gradient goes into the sum as it is made (docstring)
        reduced_copy = 0.0
    extras = unrolled_gpu or {"weight_copies": 0.0, "gradient_workspace": 0.0}
    device = {"weights": offloaded["device"] if on_host and not unrolled_gpu else 4.0 * W,
              "gradients": offloaded["device"] if on_host else grads,
              "optimizer": 0.0 if offload_optimizer else moments,
              **_backward_phase(activations, grads,
                                microbatches=1 if unrolled_gpu else microbatches,
                                gathered=gathered, on_host=on_host, peeled=peeled,
                                zero1_hook=zero1_hook, early_reduced=early_reduced,
                                reduced_copy=reduced_copy),
              "weight_copies": extras["weight_copies"]}
    device["gradient_workspace"] += extras["gradient_workspace"]
    device["backward_phase"] = sum(device[k] for k in BACKWARD_PHASE)
    device["update_phase"] = offloaded["update"] if offload_optimizer else \
        0.0 if unrolled_gpu else grads
    device["peak_phase"] = "backward" if device["backward_phase"] >= device["update_phase"] \
        else "update"
    device["total"] = device["weights"] + device["gradients"] + device["optimizer"] \
        + device[f"{device['peak_phase']}_phase"]
    host = {  # (unrolled, one microbatch: the fsdp_175b compile's host temp is its inputs)
            "weights": 4.0 * W if offload_optimizer else 0.0,
            "gradients": 0.0 if not on_host or (unrolled_gpu and microbatches == 1)
            else grads * (2 if microbatches > 1 else 1),
            "optimizer": moments if offload_optimizer else 0.0,
            "activations": activations["offloaded"]}
    host["total"] = sum(host.values())
    return device, host


def _backward_phase(activations: dict, grads: float, *, microbatches: int,
                    gathered: dict | None, on_host: bool, peeled: int, zero1_hook: bool,
                    early_reduced: float, reduced_copy: float) -> dict:
    """The device bytes of the forward and backward phase, by category (BACKWARD_PHASE):
    activations (kept, plus the larger of a layer's and the head's transient), what FSDP
    has gathered for them (`gathered`: fsdp_gathered_bytes, None without FSDP), the stash,
    and with m > 1 gradient_workspace, each microbatch's gradient (`grads` bytes) before it
    is added to the accumulator (none when the gradients stream to the host: `on_host`).
    peeled (unpipelined, jaxptd/train/step.py: microbatches, or 0 when pipelined): the step runs
    the last microbatch outside the scan over the others, and XLA gives the two their own
    buffers: with m >= 2 the layers' kept activations twice; with m >= 3, where the scan
    stays a loop, also the gathered layer and the workspace.
    (Measured on the compiled step, tests/test_plan.py; a step that ran every microbatch
    in one loop would not pay it.) zero1_hook (ZeRO-1 without FSDP, reduced inside the
    backward: Config.overlaps_grad_reduce): the reduce-scatter hook places each rank's
    part in a zero gradient of the full shape, one more gradient-sized buffer.
    reduced_copy: the gradients are summed over microbatches in a loop's carry (the
    pipeline's, or the microbatch scan's) and then reduced over the data replicas, which
    writes the reduced gradient beside the sum: this fraction of a gradient more (1, with
    ZeRO-1 the replica's part), in the compiled program on CPU and H100 alike.
    early_reduced (bytes; pipelined, Config.reduces_chunks_early): the reduced gradients of
    the chunks done before the last round, held beside the accumulator until the end.
    """
    gathered = gathered or {"layer": 0.0, "head": 0.0}
    phase = max(("layer", "head"), key=lambda k: activations[f"{k}_transient"] + gathered[k])
    looped = 2 if peeled > 2 else 1  # the loop body's buffers and the peeled microbatch's
    return {"activations": activations["kept"] * (2 if peeled > 1 else 1)
            + activations[f"{phase}_transient"],
            "stash": activations["stash"], "fsdp_gathered": gathered[phase] * looped,
            "gradient_workspace": (grads * looped if microbatches > 1 and not on_host
                                   else 0.0)
            + (grads if zero1_hook else 0.0) + early_reduced
            + (0.0 if early_reduced else reduced_copy * grads)}


BACKWARD_PHASE = ("activations", "stash", "fsdp_gathered", "gradient_workspace",
                  "weight_copies")
