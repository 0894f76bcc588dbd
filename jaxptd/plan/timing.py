"""The planner's time model: pipeline bubble, communication volumes, step time, training
days, context parallelism's attention work, traffic and balance, and expert parallelism's
all-to-all. No JAX. Notation as
in jaxptd/plan/model.py (the PTD-P paper's, Narayanan et al. 2021 §3.1); c context ranks, n = s/c
tokens a rank, k key/value heads.

Context parallelism (jaxptd/model/context.py): a rank's n queries attend to all s keys.
allgather gathers the keys and values (each rank receives (c - 1) blocks [2, b, n, k/t,
d]) before its one attention and reduce-scatters their gradients after it: not overlapped.
The ring passes a key/value block c - 1 times a layer forward; its backward (flash
attention's) passes the blocks round again, c - 1 times, and their float32 gradients
c - 1 times; each permute runs beside one block's attention: hidden when a block's bytes
cross the context link in less time than its matmuls take. Under the causal mask the
ring computes 3/4 of its own block (n x n) and the visible half of every other (n x n/2):
3 n^2/4 + (c - 1) n^2/2 scores a row and head against allgather's n s (every score
computed, then masked), of the model count's n s a rank (eq. 3's 4 s h a token: no causal
halving); an encoder's ring computes every block whole, n s.
"""
from __future__ import annotations

DAY = 86400.0


def bubble_formula(p: int, v: int, m: int, zero_bubble: bool = False,
                   masked: bool = False, v_shape: bool = False) -> float:
    """§2.2: (p - 1) / (v m) for 1F1B and interleaved; GPipe has the same bubble. Zero-bubble
    kinds (uniform t_f = t_b = t_w, lockstep; jaxptd/pipeline/schedules/make.py): the ZB-H1
    paper's (p - 1) / (3 m) for v = 1 from m >= p, (p - 1 + p - m) / (3 m) below;
    (p - 1 + max(0, 2p - 2 - m)) / (3 v m) for v > 1 and m >= p. Masked rounds (a GPU's
    round forms, schedules.Costs.masked), where a slot kind some rank uses runs on every
    rank: the F and B slots keep 1F1B's bubble and the W's only stop adding to it,
    2 (p - 1) / (3 v m) (v = 1 at every m, v > 1 from m >= p). zb-v (v_shape, v = 2): in
    lockstep rounds no better than ZB-H1, whose formulas it takes from m >= p (the
    simulator's time within one t_f, masked half of it: vshape.py's order)."""
    if v_shape:
        v = 1
    if zero_bubble and masked:
        return 2 * (p - 1) / (3 * v * m)
    if zero_bubble and v == 1:
        return (p - 1 + max(0, p - m)) / (3 * m)
    if zero_bubble:
        return (p - 1 + max(0, 2 * p - 2 - m)) / (3 * v * m)
    return (p - 1) / (v * m)


def context_chunks(rank: int, c: int, pairs: bool = True) -> tuple:
    """The chunks (of 2c) context rank `rank` holds: r and 2c-1-r (pairs, as
    jaxptd/model/sequence.local_index lays them), or contiguous 2r and 2r+1."""
    return (rank, 2 * c - 1 - rank) if pairs else (2 * rank, 2 * rank + 1)


def context_imbalance(c: int, pairs: bool = True) -> float:
    """Max over the context ranks / mean of the causal attention work of their chunks:
    chunk i's queries see i whole chunks and half of their own, i + 1/2 chunk areas.
    Pairs: every rank 2c, 1.0; contiguous chunks: (2c - 1)/c."""
    work = [sum(i + 0.5 for i in context_chunks(r, c, pairs)) for r in range(c)]
    return max(work) / (sum(work) / c)


def context_core_fraction(c: int, method: str, causal: bool = True) -> float:
    """The attention-core FLOPs a context rank executes over the model count (n s scores
    a row and head): the causal ring's 3 n^2/4 + (c - 1) n^2/2 = (2c + 1)/(4c) of it,
    allgather's and a bidirectional ring's n s all of it (module docstring)."""
    return (2 * c + 1) / (4 * c) if c > 1 and method == "ring" and causal else 1.0


def ring_block_flops(b, s, h, t, c) -> float:
    """The forward matmul FLOPs of one of the ring's visible half blocks on a rank (its
    two [n/2, n/2] quarters): q k^T and p v over n x n/2 scores of a/t heads of d = h/a,
    2 b n^2 h / t. Its backward's are 5/2 of them (context_overlap)."""
    n = s / c
    return 4 * b * n * (n / 2) * h / t


def context_volumes(*, b, s, h, a, t, e, c, kv_heads, layers_per_stage,
                    method: str = "ring", forward_again: bool = False) -> dict:
    """Context traffic per device: `block`, a key/value block [2, b, n, k/t, d] in the
    compute dtype; `gradient_block`, the ring's float32 gradients of one [2, b, n, k/t, d]
    (allgather reduce-scatters them in the compute dtype: a `block`); `per_microbatch`,
    what the stage's layers move for one microbatch: (c - 1) blocks a layer forward (the
    ring's permutes, or what allgather receives), backward (c - 1) gradient blocks and,
    the ring, (c - 1) key/value blocks again, and the forward's again with
    `forward_again` (model.remat full or minimal: the attention's inputs are no matmul
    outputs, so the layer's forward and its context traffic rerun; XLA may merge some of
    the ring's with the backward's key/value sends, counted here all the same). What
    hides them: context_overlap."""
    if c == 1:
        return {"block": 0.0, "gradient_block": 0.0, "per_microbatch": 0.0}
    block = 2 * b * (s / c) * h * (kv_heads or a) / a / t * e
    ring = method == "ring"
    gradient = block * 4 / e if ring else block
    blocks = (1 + forward_again + ring) * block + gradient
    return {"block": block, "gradient_block": gradient,
            "per_microbatch": layers_per_stage * (c - 1) * blocks}


def moe_volumes(*, rows: float, h, e, ep: int, layers_per_stage, forward_again=False) -> dict:
    """Expert parallelism's all-to-all traffic per device (jaxptd/model/moe.py): each MoE
    layer sends a microbatch's routed rows to their experts' ranks (dispatch) and the
    expert outputs back (combine) in the forward, and the same two in the backward (their
    gradients), each `message` = rows x h in the compute dtype (rows: moe_rows' balanced,
    the routed A that a GPU's ragged all-to-all moves, or with a capacity factor the
    buffer's E C; XLA's CPU pads each destination's block to A, e times the bytes), of
    which (ep - 1)/ep leave the rank; with
    `forward_again` (model.remat full or minimal: no all-to-all output is a matmul output)
    the forward's two again. `per_microbatch`: what leaves the rank for the stage's layers."""
    message = rows * h * e
    passes = 4 + 2 * forward_again
    return {"message": message,
            "per_microbatch": layers_per_stage * passes * message * (ep - 1) / ep}


def comm_volumes(*, b, s, h, t, e, layers_per_stage, grad_bytes, replicas, fsdp_group=1,
                 stage_params=0.0, gather_bytes=4, fp8_gathered=0.0, tied_grad_bytes=0.0,
                 host_per_step=0.0, host_per_microbatch=0.0, c=1, context=None,
                 expert_grad_bytes=0.0, expert_replicas=1, moe=None, head=None,
                 forward_again=False) -> dict:
    """Bytes per device. §3.2: point-to-point b s h per microbatch between consecutive
    stages (b s h / t with scatter/gather, §4.1, or sequence parallelism); tensor
    8 b s h (t - 1) / t per layer per microbatch (forward + backward; sequence parallelism's
    all-gathers and reduce-scatters move the same, Korthikanti et al. §4.2.2), 11 with
    `forward_again` (full recomputation runs 3 of the forward's 4 again: the last one's
    output, the layer's, is the next layer's checkpointed input); with c
    context ranks each of these carries s/c tokens, and `context` (context_volumes) is
    the attention's traffic; data: ring
    all-reduce 2 (r - 1) / r of the float32 gradients over the r data replicas once per
    step (§3.3.1; ZeRO-1's reduce-scatter and all-gather move the same; r counts the
    context ranks too, which hold the same parameters). FSDP over g ranks:
    per microbatch each layer is gathered for the forward and again for the backward and
    its gradient reduce-scattered, 3 (g - 1) / g of the stage's parameters (the
    `fp8_gathered` of them gathered at a byte each: model.fp8=delayed). Embedding
    (pipelined, tied): the first and last stage send each other their gradient of it
    once per step (§3.3.1's embedding group of two; jaxptd/train/step.py). Host: what
    offloading moves over PCIe (the optimizer state per step, layer inputs per microbatch).
    Expert parallelism: `moe` (moe_volumes) is the all-to-all traffic; the experts'
    expert_grad_bytes of grad_bytes are all-reduced over their own expert_replicas (the
    data ranks holding the same experts: replicas / parallel.expert), the rest over all
    `replicas`. A head spread over pipe: `head` (head_volumes).
    """
    n = s / c
    context = context or {"block": 0.0, "gradient_block": 0.0, "per_microbatch": 0.0}
    moe = moe or {"message": 0.0, "per_microbatch": 0.0}

    def ring(r, grads):  # a ring all-reduce over r ranks
        return 2 * (r - 1) / r * grads if r > 1 else 0.0
    return {
        "p2p_per_microbatch": b * n * h * e / t,
        "tensor_per_microbatch": layers_per_stage * (8 + 3 * forward_again) * b * n * h
        * (t - 1) / t * e,
        "context_per_microbatch": context["per_microbatch"],
        "context_block": context["block"],
        "context_gradient_block": context["gradient_block"],
        "fsdp_per_microbatch": (fsdp_group - 1) / fsdp_group * (
            3 * stage_params * gather_bytes - 2 * fp8_gathered * (gather_bytes - 1)),
        "expert_per_microbatch": moe["per_microbatch"], "expert_message": moe["message"],
        "data_per_step": ring(replicas, grad_bytes - expert_grad_bytes)
        + ring(expert_replicas, expert_grad_bytes),
        "tied_per_step": tied_grad_bytes,
        "host_per_step": host_per_step, "host_per_microbatch": host_per_microbatch,
        **(head or head_volumes()),
    }


def head_volumes(*, b=0, s=0, h=0, e=2, p=1, t=1, sp=False, head_params=0.0) -> dict:
    """A head spread over the p pipe ranks (jaxptd/pipeline/head.py), bytes a device:
    per microbatch the last stage's output [b, s, h] to the other ranks by an all-to-all
    and its gradient back, (p - 1)/p of it each way (every tensor rank sends its own; with
    sequence parallelism it is gathered over tensor first and its gradient reduce-scattered:
    (t - 1)/t of it each way on the tensor link); per step the head's float32 weights
    broadcast and their gradients summed over pipe, two ring all-reduces. Zeros: no
    spread head."""
    ring = 2 * (p - 1) / p * 4 * head_params
    return {"head_per_microbatch": 2 * (p - 1) / p * b * s * h * e,
            "head_tensor_per_microbatch": 2 * (t - 1) / t * b * s * h * e if sp else 0.0,
            "head_per_step": 2 * ring}


def context_overlap(*, comm, c, method, layers_per_stage, block_flops, device_flops,
                    bandwidth, forward_again: bool = False) -> dict:
    """Seconds of context traffic per microbatch: `permute_s` one key/value block over the
    context link, `block_s` one visible half block's forward matmuls at device_flops;
    `backward_permute_s` a key/value block and its float32 gradients, `backward_block_s`
    the backward's matmuls of a block (5 a part against the forward's 2: 5/2 block_s).
    The ring exposes at each of its c - 1 forward steps what of permute_s exceeds block_s,
    and at each of its c - 1 backward steps (a block received, the gradients of the one
    before passed on) what of backward_permute_s exceeds backward_block_s (the own block's
    two query halves, beside the first and the last send, counted as one step); `hidden`
    when neither does. allgather's traffic is all exposed (its attention waits for the
    gather). `exposed_s` per microbatch."""
    if c == 1:
        return {"permute_s": 0.0, "block_s": 0.0, "backward_permute_s": 0.0,
                "backward_block_s": 0.0, "hidden": True, "exposed_s": 0.0}
    permute, block = comm["context_block"] / bandwidth, block_flops / device_flops
    backward = (comm["context_block"] + comm["context_gradient_block"]) / bandwidth
    times = {"permute_s": permute, "block_s": block, "backward_permute_s": backward,
             "backward_block_s": 2.5 * block}
    if method == "allgather":
        return {**times, "hidden": False,
                "exposed_s": comm["context_per_microbatch"] / bandwidth}
    forwards = 2 if forward_again else 1
    per_layer = (c - 1) * (forwards * max(0.0, permute - block)
                           + max(0.0, backward - 2.5 * block))
    return {**times, "hidden": permute <= block and backward <= 2.5 * block,
            "exposed_s": layers_per_stage * per_layer}


def link_bandwidths(hw, *, t, c=1, ep=1, p=1, fsdp=1, d=1) -> dict:
    """Bytes/s a device moves over each axis's collectives, the mesh [data, fsdp, pipe,
    expert, context, tensor] laid over nodes tensor innermost: a group whose devices fit
    in a node rings over NVLink at the target's intra_fraction of `intra`; one spread over
    nodes crosses InfiniBand through each node's NICs, one a GPU: a node holding k of the
    group's devices (k = gpus_per_node / the axes inside it, at least 1) runs k rings at
    once, k x `inter` x inter_fraction, at most the NVLink ring's rate."""
    gpn = hw.gpus_per_node
    intra, inter = hw.intra * hw.intra_fraction, hw.inter * hw.inter_fraction

    def axis(inner: int, size: int) -> float:
        if inner * size <= gpn:
            return intra
        return min(max(1, gpn // inner) * inter, intra)
    return {"tensor": axis(1, t), "context": axis(t, c), "expert": axis(c * t, ep),
            "p2p": axis(ep * c * t, p), "fsdp": axis(p * ep * c * t, fsdp),
            "data": axis(fsdp * p * ep * c * t, d)}


def step_time(*, flops_device, bubble, comm, m, v, p, t, d, fsdp_group=1, gpus_per_node,
              device_flops, hbm_bytes_per_s, weight_bytes_per_microbatch, intra_bw, inter_bw,
              host_bw=25e9, c=1, context_exposed_s=0.0, ep=1, links=None,
              kernels=None) -> dict:
    """Seconds per iteration: compute (roofline per microbatch: its FLOPs at device_flops
    or its weight reads from memory, whichever is slower) stretched by the bubble, plus
    communication that is not overlapped: tensor (intra-node when t <= gpus_per_node),
    context (context_exposed_s a microbatch, context_overlap's), expert parallelism's
    all-to-all (intra-node when an expert group's ep c t devices fit in a node; not
    overlapped: a layer's expert matmuls wait for their tokens and the next layer for
    the combine, and the schedule gives them no independent work), point-to-point forward
    and backward (inter-node when a stage spans beyond a node)
    and the tied embedding's exchange between the first and last stage (a spread head's
    traffic, head_volumes, beside them on the pipe and tensor links),
    FSDP's gathers (intra-node when a group's g p ep c t devices fit in a node), the data-
    parallel reduction (inter-node unless the whole job fits in one node) and host
    transfers at host_bw. The mesh is [data, fsdp, pipe, expert, context, tensor], tensor
    innermost: a group of an axis spans the axes inside it. The calibrated model
    (jaxptd/plan/kernels.py): `kernels`, its seconds of kernels a step (the update outside
    the bubble), and `links`, link_bandwidths.
    """
    if kernels:
        compute = (kernels["total"] - kernels["update"]) * (1 + bubble) + kernels["update"]
    else:
        compute = m * (1 + bubble) * max(flops_device / m / device_flops,
                                         weight_bytes_per_microbatch / hbm_bytes_per_s)
    tensor_bw = intra_bw if t <= gpus_per_node else inter_bw
    expert_bw = intra_bw if ep * c * t <= gpus_per_node else inter_bw
    p2p_bw = intra_bw if t * c * ep * p <= gpus_per_node else inter_bw
    fsdp_bw = intra_bw if fsdp_group * p * ep * c * t <= gpus_per_node else inter_bw
    data_bw = intra_bw if t * c * p * d <= gpus_per_node else inter_bw
    if links:
        tensor_bw, expert_bw, p2p_bw, fsdp_bw, data_bw = (
            links[k] for k in ("tensor", "expert", "p2p", "fsdp", "data"))
    parts = {
        "compute": compute,
        "tensor": m * (comm["tensor_per_microbatch"] + comm["head_tensor_per_microbatch"])
        / tensor_bw,
        "context": m * context_exposed_s,
        "expert": m * comm["expert_per_microbatch"] / expert_bw,
        "p2p": (2 * m * v * comm["p2p_per_microbatch"] + comm["tied_per_step"]
                + m * comm["head_per_microbatch"] + comm["head_per_step"]) / p2p_bw
        if p > 1 else 0.0,
        "fsdp": m * comm["fsdp_per_microbatch"] / fsdp_bw,
        "data": comm["data_per_step"] / data_bw,
        "host": (comm["host_per_step"] + m * comm["host_per_microbatch"]) / host_bw,
    }
    parts["total"] = sum(parts.values())
    return parts


def days_to_train(tokens: float, flops_per_token: float, n: int, tflops: float) -> float:
    """§5.1: iterations T / (B s) times F at n X FLOP/s; F / (B s) is per token."""
    return tokens * flops_per_token / (n * tflops * 1e12) / DAY


def days_eq4(tokens: float, params: float, n: int, tflops: float) -> float:
    """Equation (4): end-to-end time ~ 8 T P / (n X)."""
    return 8 * tokens * params / (n * tflops * 1e12) / DAY
