"""The lowering's slot tables (jaxptd/pipeline/lowering.py, slot_pool.py) replayed the way
the executor runs them, with labels in place of tensors: every message lands in the slot
its tables say and no live slot is overwritten (training, forward-only, V-shaped), each B
and W reads what its own F kept or taped though idle F's write garbage unmasked, and the
slots read where the buffers start unzeroed were written first. (The schedules themselves,
against the papers' formulas: tests/test_schedules.py.)"""
import os

import pytest

from jaxptd.pipeline.lowering import lower
from jaxptd.pipeline.schedules import Costs, forward_only, make_schedule
from jaxptd.pipeline.simulate import simulate


def _place(kind: str, p: int, s: int) -> int:
    """The rank of virtual stage s, restated from the schedules' docstrings: s mod p, or
    V-shaped s for s < p and 2p - 1 - s after the turn."""
    return 2 * p - 1 - s if kind == "zb-v" and s >= p else s % p


def _channel(kind: str, forward: bool, src: int, dst: int) -> str:
    """The tables a message is received in: 'recv_f'/'recv_b', V-shaped 'recv_f2' for an
    activation from rank dst + 1 or the turn's (src = dst), 'recv_b2' for a gradient from
    dst - 1."""
    other = kind == "zb-v" and (src >= dst if forward else src < dst)
    return ("recv_f" if forward else "recv_b") + ("2" if other else "")


def _deliver(R, t, p, letter, sent, buffers):
    """Stores round t's messages of a kind (letter 'f' or 'b'; sent: {(dst, tables):
    label}) in buffers[dst] at their tables' slot, checking that both channels' tables
    expect exactly these, and that no live slot is overwritten; every idle channel stores
    garbage, as the executor does, in the buffer's spare slot (its last)."""
    for dst in range(p):
        for channel in (f"recv_{letter}", f"recv_{letter}2"):
            label = sent.get((dst, channel))
            assert getattr(R, channel + "_valid")[t][dst] == (label is not None), (t, dst)
            slot = getattr(R, channel + "_slot")[t][dst]
            if label:
                assert buffers[dst][slot] is None  # never overwrite a live input
            else:
                assert slot == len(buffers[dst]) - 1
            buffers[dst][slot] = label or "garbage"


@pytest.mark.parametrize("forward", [False, True], ids=["train", "forward-only"])
@pytest.mark.parametrize("kind,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 4, 6, 2),
                                        ("interleaved", 3, 7, 3), ("gpipe", 3, 4, 1),
                                        ("zb-v", 4, 9, 2), ("zb-v", 2, 3, 2)])
def test_messages_and_slot_tables_replay(kind, p, m, v, forward):
    """Replays the tables the way the executor does, with labels in place of tensors:
    every (microbatch, virtual stage) forward runs once, on its own input, and a live
    stash or grad slot is never overwritten."""
    schedule, S = make_schedule(kind, p, m, v), p * v
    schedule = forward_only(schedule) if forward else schedule
    R = lower(schedule)
    stash = [[None] * (R.spare("stash") + 1) for _ in range(p)]
    grads = [[None] * (R.spare("grad") + 1) for _ in range(p)]
    forwards, done = [], 0
    for t in range(R.num_rounds):
        sent = {}  # (destination rank, its tables) -> label
        for r in range(p):
            if R.f_valid[t][r]:
                j, s = R.f_mb[t][r], R.stage(R.f_chunk[t][r], r)
                assert _place(kind, p, s) == r
                if s == 0:
                    stash[r][R.f_slot[t][r]] = (j, 0)
                assert stash[r][R.f_slot[t][r]] == (j, s)
                forwards.append((j, s))
                if s < S - 1:
                    dst = _place(kind, p, s + 1)
                    sent[(dst, _channel(kind, True, r, dst))] = (j, s + 1)
        _deliver(R, t, p, "f", sent, stash)
        for r in range(p):  # forward-only: the input is free once its F has read it
            if forward and R.f_valid[t][r]:
                stash[r][R.f_slot[t][r]] = None
        sent = {}
        for r in range(p):
            if R.b_valid[t][r]:
                j, s = R.b_mb[t][r], R.stage(R.b_chunk[t][r], r)
                assert stash[r][R.b_slot[t][r]] == (j, s)
                if s < S - 1:
                    assert grads[r][R.b_grad_slot[t][r]] == (j, s)
                    grads[r][R.b_grad_slot[t][r]] = None
                stash[r][R.b_slot[t][r]] = None
                if s > 0:
                    dst = _place(kind, p, s - 1)
                    sent[(dst, _channel(kind, False, r, dst))] = (j, s - 1)
                done += 1
        _deliver(R, t, p, "b", sent, grads)
    assert sorted(forwards) == [(j, s) for j in range(m) for s in range(S)]
    assert done == (0 if forward else m * S)
    assert all(x is None for rank in stash + grads for x in rank[:-1])
    stats = simulate(schedule)
    assert stats.messages == {"forward": m * (S - 1), "backward": 0 if forward else m * (S - 1)}
    assert R.num_stash_slots == max(stats.peak_stash)


@pytest.mark.parametrize("kind,p,m,v,free", [
    ("1f1b", 2, 8, 1, True), ("1f1b", 4, 8, 1, True), ("interleaved", 4, 8, 2, True),
    ("interleaved", 3, 7, 3, True), ("zb-h1", 4, 8, 1, True), ("zb-interleaved", 2, 4, 2, True),
    ("1f1b", 4, 3, 1, False), ("gpipe", 3, 4, 1, False)])
def test_idle_forwards_write_where_nothing_is_kept(kind, p, m, v, free):
    """Every idle F slot points at a stash slot that holds no kept values in its round
    (lowering.idle_f_slots_free), so a masked F may write garbage there unmasked: replayed
    with labels, each B still reads what its own F kept. Not where an idle F's rank holds
    a kept microbatch in every slot (GPipe's last forwards; 1F1B with m < p): those F's
    write masked."""
    costs = Costs(masked=True)
    R = lower(make_schedule(kind, p, m, v, costs), costs)
    assert R.idle_f_slots_free == free
    if not free:
        return
    kept = [[None] * R.num_stash_slots for _ in range(p)]
    again = {(r, R.b_mb[t][r], R.b_chunk[t][r]) for t in range(R.num_rounds)
             for r in range(p) if R.b_again[t][r]}  # (their first B keeps the slot)
    for t in range(R.num_rounds):
        for r in range(p):
            f = (R.f_mb[t][r], R.f_chunk[t][r]) if R.f_valid[t][r] else "garbage"
            kept[r][R.f_slot[t][r]] = f
        for r in range(p):
            if R.b_valid[t][r]:
                key = (R.b_mb[t][r], R.b_chunk[t][r])
                assert kept[r][R.b_slot[t][r]] == key
                if R.b_again[t][r] or (r, *key) not in again:
                    kept[r][R.b_slot[t][r]] = None


@pytest.mark.parametrize("kind,p,m,v,written", [
    ("1f1b", 4, 8, 1, True), ("1f1b", 8, 32, 1, True), ("interleaved", 3, 7, 3, True),
    ("zb-h1", 4, 8, 1, True), ("zb-v", 4, 8, 2, True), ("1f1b", 4, 3, 1, False),
    ("gpipe", 3, 4, 1, False)])
def test_every_b_slot_reads_a_slot_an_f_wrote(kind, p, m, v, written):
    """lowering.b_reads_written, under which training leaves the buffers of what F keeps
    unzeroed (lax.empty): replayed, in every round each rank's B slot (an idle one too,
    which the masked round forms run) reads a stash slot that some F on the rank computed
    into by then: a valid F, or an idle F in a round where some rank's F is valid, where
    idle F's write unmasked (idle_f_slots_free). Not so with m < p or GPipe (an idle
    rank's B reads a slot no F has written yet)."""
    costs = Costs(masked=True)
    R = lower(make_schedule(kind, p, m, v, costs), costs)
    assert R.b_reads_written == written
    computed = [set() for _ in range(p)]
    unread = []
    for t in range(R.num_rounds):
        for r in range(p):
            if R.f_valid[t][r] or (R.idle_f_slots_free and any(R.f_valid[t])):
                computed[r].add(R.f_slot[t][r])
            if R.b_slot[t][r] not in computed[r]:
                unread.append((t, r))
    assert (not unread) == written


@pytest.mark.parametrize("masked", [False, True], ids=["cond", "masked"])
@pytest.mark.parametrize("kind,p,m,v", [("zb-h1", 4, 8, 1), ("zb-h1", 3, 3, 1),
                                        ("zb-interleaved", 4, 6, 2),
                                        ("zb-interleaved", 2, 5, 3), ("zb-v", 4, 8, 2)])
def test_zb_w_slot_tables_replay(kind, p, m, v, masked):
    """Every B that keeps for a later W (b_keeps) fills the W slot its W empties; a W in
    its B's round (w_now), or in the round where that B runs again (b_again: masked rounds,
    the rank's B slot free there), takes what the B kept in the round, in no W slot; every
    F fills the tape slot its W empties; one W per B, no live W or tape slot is
    overwritten, and a W never runs before its B. Masked, zb-h1 (from m = 2p - 2) runs every
    W so: rank r runs the B's of its first r W's again after its last B, and no W slot."""
    costs = Costs(masked=masked)
    R = lower(make_schedule(kind, p, m, v, costs), costs)
    wbuf = [[None] * R.num_w_slots for _ in range(p)]
    tapes = [[None] * R.num_tape_slots for _ in range(p)]
    ran, now = set(), 0
    for t in range(R.num_rounds):
        for r in range(p):
            if R.f_valid[t][r]:  # (a round's F writes before its W reads)
                assert tapes[r][R.f_tslot[t][r]] is None
                tapes[r][R.f_tslot[t][r]] = (R.f_mb[t][r], R.f_chunk[t][r])
            b_key = (R.b_mb[t][r], R.b_chunk[t][r]) if R.b_valid[t][r] else None
            if R.b_keeps[t][r]:
                assert not R.b_again[t][r] and wbuf[r][R.b_wslot[t][r]] is None
                wbuf[r][R.b_wslot[t][r]] = b_key
            if R.w_valid[t][r]:
                key = (R.w_mb[t][r], R.w_chunk[t][r])
                if R.w_now[t][r]:
                    assert key == b_key == tapes[r][R.w_tslot[t][r]]
                    now += 1
                else:
                    assert wbuf[r][R.w_slot[t][r]] == key == tapes[r][R.w_tslot[t][r]]
                    wbuf[r][R.w_slot[t][r]] = None
                tapes[r][R.w_tslot[t][r]] = None
                ran.add((r,) + key)
    assert ran == {(r, j, c) for r in range(p) for j in range(m) for c in range(v)}
    assert all(x is None for rank in wbuf + tapes for x in rank)
    assert max(sum(row) for row in zip(*R.w_valid)) <= R.num_rounds  # one W slot a round
    if masked and kind == "zb-h1" and m >= 2 * p - 2:
        assert now == p * m and R.num_w_slots == 0, now


@pytest.mark.parametrize("kind,p,m,v,tapes", [
    ("zb-h1", 8, 32, 1, 15), ("zb-h1", 4, 8, 1, 7), ("zb-interleaved", 4, 8, 2, 11),
    ("zb-v", 4, 8, 2, 11), ("zb-h1", 4, 3, 1, 4)])
def test_idle_forwards_tape_where_no_weight_reads(kind, p, m, v, tapes):
    """Replayed in the masked round forms, every W slot reads the dense inputs its own F
    taped, though each idle F writes its tape slot unmasked (idle_f_tslots_free: where
    some round's idle F found no slot free, the tapes have one slot more than the W's
    keep at once: zb-v from p = 4, 10 at p = 4, m = 8; zb-h1 with m < p, 3); and every W
    slot, an idle one too, reads a tape slot some valid F wrote (w_reads_written: the
    tapes start unzeroed)."""
    costs = Costs(masked=True)
    R = lower(make_schedule(kind, p, m, v, costs), costs)
    assert R.idle_f_tslots_free and R.w_reads_written and R.num_tape_slots == tapes
    tapes = [[None] * R.num_tape_slots for _ in range(p)]
    for t in range(R.num_rounds):
        for r in range(p):
            if R.f_valid[t][r] or R.idle_f_tslots_free:
                tapes[r][R.f_tslot[t][r]] = (R.f_mb[t][r], R.f_chunk[t][r]) \
                    if R.f_valid[t][r] else "garbage"
        for r in range(p):
            if R.w_valid[t][r]:
                assert tapes[r][R.w_tslot[t][r]] == (R.w_mb[t][r], R.w_chunk[t][r])


@pytest.mark.parametrize("kind, p, m, swapped", [
    ("zb-v", 8, 32, True), ("zb-v", 4, 8, True), ("zb-v", 2, 4, None),
    ("interleaved", 8, 32, False), ("zb-interleaved", 4, 8, False)])
def test_static_chunks_name_every_rank_s_chunk(kind, p, m, swapped):
    """static_chunks: zb-v's slots run one held chunk on every rank once odd ranks hold
    their chunks swapped (None at p = 2: either swap); interleaved kinds keep the tables'
    traced chunk. The runs cover each segment's rounds in order, and where a phase names
    a held chunk, every rank that runs the kind in such a round runs that chunk."""
    from jaxptd.pipeline import static_chunks
    from jaxptd.pipeline.executor import rounds_for
    from jaxptd.pipeline.scans import segments

    rounds = rounds_for(kind, p, m, 2, "steady")
    swaps = static_chunks.swaps(rounds)
    if swapped is False:
        assert swaps is None
        return
    if swapped:
        assert swaps == tuple(r % 2 for r in range(p))
    held = static_chunks.round_chunks(rounds, swaps)
    static = 0
    for seg in segments(rounds, "steady"):
        parts = static_chunks.runs(held, seg.start, seg.stop)
        assert [a for a, _, _ in parts] == [seg.start] + [b for _, b, _ in parts[:-1]]
        assert parts[-1][1] == seg.stop
        for a, b, phases in parts:
            assert (b - a) % len(phases) == 0
            for t in range(a, b):
                for k, kind_ in enumerate("fbw"):
                    at = phases[(t - a) % len(phases)][k]
                    valid = getattr(rounds, f"{kind_}_valid")[t]
                    chunk = getattr(rounds, f"{kind_}_chunk")[t]
                    if at is not None:
                        static += sum(map(bool, valid))
                        assert all(chunk[r] ^ swaps[r] == at for r in range(p) if valid[r])
    assert static > 0


@pytest.mark.parametrize("kind, p, m, v, head_rounds", [
    ("interleaved", 8, 32, 2, 32), ("zb-interleaved", 4, 8, 2, None), ("1f1b", 8, 32, 1, 32),
    ("interleaved", 2, 8, 2, None), ("zb-h1", 8, 32, 1, 32), ("zb-interleaved", 8, 32, 2, 32),
    ("zb-v", 8, 32, 2, None)])
def test_steady_scans_run_the_head_where_rounds_need_it(kind, p, m, v, head_rounds):
    """scans.segments, steady: the scans cover the rounds in order, each with the ends its
    rounds need, and a scan that runs the head holds no stretch of HEADLESS rounds that
    need none (the interleaved kinds' last stage takes its B's p rounds on, p off): at
    p = 8, m = 32 the head runs in the 32 rounds that need it (it ran in 56). 1F1B's
    scans are its runs of slot usage, uncut. The zero-bubble kinds' last stage runs its
    first p - 1 B's again for their W's after its last B, each reading the head's output
    gradient its first run kept (b_stores, in a grad slot held until then): no head in
    those rounds (it ran in 39)."""
    from jaxptd.pipeline import scans, static_chunks
    from jaxptd.pipeline.executor import rounds_for
    from jaxptd.pipeline.scans import HEADLESS, ends_of, segments

    rounds = rounds_for(kind, p, m, v, "steady")
    segs = segments(rounds, "steady")
    assert [s.start for s in segs] == [0] + [s.stop for s in segs[:-1]]
    assert segs[-1].stop == rounds.num_rounds
    running = 0
    for seg in segs:
        assert seg.ends == ends_of(rounds, range(seg.start, seg.stop))
        if ("head", "B") not in seg.ends:
            continue
        need = "".join("1" if ("head", "B") in ends_of(rounds, [t]) else "0"
                       for t in range(seg.start, seg.stop))
        assert "0" * HEADLESS not in need, (seg, need)
        running += seg.stop - seg.start
    if head_rounds is not None:
        assert running == head_rounds
    # what the planner counts (scans.head_rounds): these rounds, or with two held chunks
    # (static_chunks.swaps) those of the phases that need the head, and no fewer than m
    swaps = static_chunks.swaps(rounds) if v == 2 else None
    counted = scans.head_rounds(rounds, "steady", HEADLESS, swaps)
    assert counted == running if swaps is None else m <= counted <= running
    if kind == "1f1b":
        assert len(segs) == 5
    for t, r in ((t, r) for t in range(rounds.num_rounds) for r in range(p)):
        if rounds.b_again[t][r] and rounds.stage(rounds.b_chunk[t][r], r) == p * v - 1:
            first = [u for u in range(t) if rounds.b_stores[u][r] and
                     (rounds.b_mb[u][r], rounds.b_chunk[u][r]) ==
                     (rounds.b_mb[t][r], rounds.b_chunk[t][r])]
            assert first and rounds.b_grad_slot[first[0]][r] == rounds.b_grad_slot[t][r]


def test_the_headless_stretches_are_cut_out_only_where_the_head_weighs():
    """scans.headless_stretch: a steady scan is cut around its rounds without the head
    where the head is HEAD_SHARE or more of a round's matmul work (GPT-1.3B's width 8
    stages deep, interleaved), not where it is far less (PTD-P's 76.1B row, interleaved over
    4 stages of 3 chunks, with full recomputation: its cuts cost more memory than they
    save time). Uncut (0), the steady scans are the runs of slot usage: two scans in a row
    differ in their slots or taps."""
    from jaxptd.config import load_config
    from jaxptd.pipeline.executor import rounds_for
    from jaxptd.pipeline.scans import HEADLESS, headless_stretch, segments
    from jaxptd.plan.program import recomputation

    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    row = load_config(os.path.join(root, "megatron", "gpt_76.1b.yaml"), [])
    assert headless_stretch(row, recomputation(row)) == 0
    deep = load_config(os.path.join(root, "gpu", "gpt_1.3b.yaml"), [
        "parallel.pipe=8", "parallel.data=1", "parallel.tensor=1", "model.num_layers=32",
        "parallel.microbatches=32", "train.global_batch=64", "parallel.schedule=interleaved",
        "parallel.chunks=2"])
    for remat in ("none", "full"):
        assert headless_stretch(deep, remat) == HEADLESS
    par = row.parallel
    rounds = rounds_for(par.schedule, par.pipe, par.microbatches, par.chunks, "steady")
    uncut, cut = segments(rounds, "steady", 0), segments(rounds, "steady")
    assert len(cut) > len(uncut)
    assert [s.start for s in uncut] == [0] + [s.stop for s in uncut[:-1]]
    assert all((a.modes, a.taps) != (b.modes, b.taps) for a, b in zip(uncut, uncut[1:]))
