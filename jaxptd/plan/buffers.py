"""The pipeline executor's buffers in bytes, for the planner (jaxptd/plan/model.py's
activation_memory adds them up; how many slots of each kind: the lowering, or
model.slots_formula). A slot of jaxptd/pipeline/lowering.py: a stash slot holds a stage
input and, with parallel.stash = activations, what the chunk's backward keeps and its
output; a grad slot an output gradient; a zero-bubble W slot the chunk's dense() output
gradients (`dense_tap_bytes`), with stash = inputs also their inputs
(`dense_input_bytes`), which with activations a tape slot holds from F to W. No JAX.
"""
from __future__ import annotations


def dense_tap_bytes(b, s, h, t, e) -> float:
    """Each dense() matmul's output gradient, a layer's, which a zero-bubble B keeps for
    its W (qkv [b, s, 3h/t], the two row-parallel partial sums [b, s, h], fc1 [b, s, 4h/t]),
    in the compute dtype: sbh (2 + 7/t) e."""
    return s * b * h * (2 + 7 / t) * e


def dense_input_bytes(b, s, h, t, e, sp: bool = False) -> float:
    """Each dense() matmul's input, a layer's: the two norm outputs [b, s, h] (with sequence
    parallelism as they were before the all-gather, [b, s/t, h]: W gathers them again,
    model.layer_dense_weight_grads), the context [b, s, h/t], the GeLU output [b, s, 4h/t]:
    sbh (2 + 5/t) e, with SP 7 sbh e / t. A zero-bubble schedule's W reads them: taped by
    the F (stash=activations) or the B's recomputation (inputs)."""
    return s * b * h * (2 / (t if sp else 1) + 5 / t) * e


def taped_not_in_slot(remat: str, b, s, h, t, e, sp: bool = False) -> float:
    """Of a layer's kept values, what a zero-bubble B's stash slot leaves to the F's tape of
    the dense() inputs (stash = activations): the two norm outputs and the context (the
    output projection's input), which model.remat none or selective keeps as dense()
    inputs; minimal and full keep none of them (the context cuDNN keeps is its own
    residual)."""
    return s * b * h * (2 / (t if sp else 1) + 1 / t) * e if remat in ("none", "selective") \
        else 0.0


def stash_bytes(slots: dict, stage_input: float, chunk_layers: int, kept: float,
                keep_activations: bool, b, n, h, t, e, sp: bool) -> float:
    """The executor's buffers (`slots`: {stash, grad, w, tape} counts) of one rank in
    bytes: each as the module docstring says, for b rows of n tokens (a rank's), a chunk
    of chunk_layers layers, each keeping `kept` bytes in a stash slot, and a stage input
    of stage_input bytes; plus the input gradient a round carries to the next, which
    sends it (jaxptd/pipeline/executor.py), and the spare stage input of the stash and of
    the grad buffer that idle arrivals are stored in (lowering's Rounds.spare)."""
    per_slot = stage_input + (chunk_layers * kept + stage_input if keep_activations else 0.0)
    inputs = chunk_layers * dense_input_bytes(b, n, h, t, e, sp)  # in tape or W slots
    # a zero-bubble B with no W slot hands its taps to the W of its round: one W slot's
    # worth live from the B to the W (lowering's w_now)
    handed = slots.get("w", 0) == 0 and slots.get("tape", 0) > 0
    return (slots.get("stash", 0) * per_slot + (slots.get("grad", 0) + 3) * stage_input
            + (slots.get("w", 0) + handed) * (chunk_layers * dense_tap_bytes(b, n, h, t, e)
                                   + (0.0 if keep_activations else inputs))
            + (slots.get("tape", 0) * inputs if keep_activations else 0.0))


def v_slots(p: int, m: int, masked: bool) -> dict:
    """zb-v's buffer slots a rank (model.slots_formula's; chunk-stages, half a stage each),
    fitted to the lowering of schedules/vshape.py's order, exact at m = p, 2p, 3p (as
    tested): min(2m, 5p/2 + 1) stash slots (rounded down); W slots m + 1 at m = p and
    3p/2 + 2 from m = 2p (masked: none); tape slots as stash slots (masked: one fewer from
    m = 2p at p < 4, where every idle F finds one free; from p = 4 one an idle F can take
    is added back: lowering); one grad slot (masked: min(m, p/2), rounded up)."""
    stash = min(2 * m, 5 * p // 2 + 1)
    if masked:
        return {"stash": stash, "grad": max(1, min(m, (p + 1) // 2)), "w": 0,
                "tape": stash - (m >= 2 * p and p < 4)}
    return {"stash": stash, "grad": 1, "w": 3 * p // 2 + 2 if m >= 2 * p else m + 1,
            "tape": stash}
