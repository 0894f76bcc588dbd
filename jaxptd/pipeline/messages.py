"""A round's messages (pipeline/executor.py): where and when what a round sends is stored.

Owns the store of what arrived (a stage input in the stash, an input gradient in the grad
buffer) at the slot the tables say, unmasked (an idle arrival's slot is its buffer's spare,
lowering's Rounds.spare), the V-shaped pair of channels as one message where only one
arrives, the waits that keep each transfer in flight beside a slot's GEMMs, and the carry's
B message of a round, sent at the start of the next.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxptd.parallel.mesh import PIPE
from jaxptd.parallel.varying import after, mark_varying, waiting
from jaxptd.pipeline import buffers
from jaxptd.pipeline.lowering import Rounds


def stored_after(slot, made, message):
    """The slot a message is stored at, made to depend on `made` (a slot's output; None:
    nothing to wait for). XLA's latency-hiding scheduler puts a transfer's done just
    before what reads it and its start only as far back as its latency estimate needs,
    which a few small fusions can cover. Stored after the F slot's output (an input
    gradient, which the B slot reads) or the B slot's (an output, stored at the end of the
    round), a message's transfer overlaps at least that slot's last GEMMs. With chunks
    only, as the compiled GPU programs showed: the interleaved and zb-interleaved kinds'
    steady loops had sends with no GEMM in flight without it and more sends overlapped
    with it, at about the same time and memory; zb-h1's sends were all overlapped without
    it, and with it kept them but lost much of its tensor all-reduces' overlap; 1F1B's
    sends were all overlapped without it and with it lost some (the mixture of experts'
    layout). Figures: BENCHMARKS.md and the git log."""
    return slot if made is None else after(slot, made, like=message)


def store(buffer, sent, arrivals, made, late, tensor: int, merged: bool = False):
    """buffer with the round's arrived messages stored (buffers.arrive): `sent` (buffers.
    send's: one message, or V-shaped a pair, one a channel) at the slots arrivals say
    ({'_slot'}, V-shaped also {'2_slot', '2_valid'}: the tables' recv_* and recv_*2; an
    idle one the spare); each stored after `made` (`stored_after`) and, given `late`,
    waiting for it too (the round's late stores). `merged` (no rank's two channels both
    valid in the rounds): a V-shaped pair as one message, the channel that arrived, so
    one gather and one store (two each, the turn's select and the channels' in one)."""
    if isinstance(sent, tuple) and merged:
        pick = arrivals["2_valid"] > 0
        sent = jnp.where(pick, sent[1], sent[0])
        arrivals = {"_slot": jnp.where(pick, arrivals["2_slot"], arrivals["_slot"])}
    for message, channel in zip(sent if isinstance(sent, tuple) else (sent,), ("_", "2_")):
        slot = stored_after(arrivals[channel + "slot"], made, message)
        message = message if late is None else waiting(message, late)
        buffer = buffers.arrive(buffer, message, slot, tensor)
    return buffer


def merged(rounds: Rounds, seg) -> tuple:
    """(activations, gradients): whether `store` may take a V-shaped pair as one message in
    the segment's rounds, no rank receiving one in both channels at once: activations but
    in the warm-up, gradients in any round (one stored in a round is its previous round's:
    held to every round's)."""
    return (rounds.one_channel("f", seg.start, seg.stop),
            rounds.one_channel("b", 0, rounds.num_rounds))


def pending(g_x, idle, row, spare, v_shape: bool) -> dict:
    """The carry's B message for the next round: this round's input gradient g_x with the
    tables' recv_b (and V-shaped recv_b2) slots and recv_b2's valid, or, with no B slot
    traced (g_x None), the idle message, stored in the grad buffer's spare slot."""
    if g_x is None:
        return {"x": idle, "_slot": spare,
                **({"2_slot": spare, "2_valid": jnp.zeros_like(spare)} if v_shape else {})}
    # (pinned row-major: left to XLA, the (2,2,2) stash=inputs round loop carried it, and
    # the ends' gradient sums with it, hidden dimension first: tests/test_h100.py)
    return {"x": buffers.row_major(g_x), "_slot": row["recv_b_slot"],
            **({"2_slot": row["recv_b2_slot"], "2_valid": row["recv_b2_valid"]}
               if v_shape else {})}


def spare(rounds: Rounds):
    """The grad buffer's spare slot (Rounds.spare), typed like the tables' slots."""
    return mark_varying(jnp.asarray(rounds.spare("grad"), jnp.int32), (PIPE,))
