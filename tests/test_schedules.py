"""Schedules against independent references: hand-worked grids, the PTD-P paper's bubble
formulas (§2.2) and the zero-bubble paper's (Qi et al. §3), the forward-only rounds' closed
form, the validator on broken schedules, and the CLI. (The slot tables replayed as the
executor runs them: tests/test_lowering.py.)"""
import dataclasses
import json
import subprocess
import sys

import pytest

from jaxptd.pipeline import simulate as sim
from jaxptd.pipeline.lowering import lower
from jaxptd.pipeline.schedules import (Action, Costs, Schedule, ScheduleError, check_layers,
                                       forward_only, make_schedule, packed_time, validate)
from jaxptd.pipeline.simulate import simulate

UNIFORM = Costs(1.0, 1.0, 1.0)  # t_f = t_b = t_w; a kind without W runs B + W = 2 t_f


def _rows(rounds):
    """Per rank, per round: 'F<mb>.<chunk>' / 'B..' / '.' pairs, from the tables."""
    def cell(k, t, r):
        if not getattr(rounds, f"{k}_valid")[t][r]:
            return "."
        return f"{k.upper()}{getattr(rounds, f'{k}_mb')[t][r]}.{getattr(rounds, f'{k}_chunk')[t][r]}"
    return [[(cell("f", t, r), cell("b", t, r)) for t in range(rounds.num_rounds)]
            for r in range(rounds.stages)]


def test_p2_m2_1f1b_hand_worked_grid():
    # rank 1 (last stage) does F then B of a microbatch in one round; the gradient
    # reaches rank 0 one round later
    assert _rows(lower(make_schedule("1f1b", 2, 2))) == [
        [("F0.0", "."), ("F1.0", "."), (".", "B0.0"), (".", "B1.0")],
        [(".", "."), ("F0.0", "B0.0"), ("F1.0", "B1.0"), (".", ".")],
    ]


def test_p1_is_unpipelined():
    schedule = make_schedule("1f1b", 1, 3)
    assert [a.label() for a in schedule.actions[0]] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    stats = simulate(schedule)
    assert stats.bubble_fraction == 0 and stats.num_rounds == 3 and stats.peak_stash == [1]
    assert stats.messages == {"forward": 0, "backward": 0}


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_p4_m8_grid_closed_form(kind):
    # forward wave: F(j) on rank r in round j + r. 1f1b: B(j) on rank r in round
    # j + 2(p-1) - r (one hop back per round). gpipe: the last rank starts backwards in the
    # round of its last forward, m - 1 + p - 1.
    p, m = 4, 8
    rows = _rows(lower(make_schedule(kind, p, m)))
    for r in range(p):
        for j in range(m):
            b_round = j + 2 * (p - 1) - r + (m - 1 if kind == "gpipe" else 0)
            assert rows[r][j + r][0] == f"F{j}.0"
            assert rows[r][b_round][1] == f"B{j}.0"


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_bubble_gpipe_1f1b_is_paper_formula(p, m):
    for kind in ("gpipe", "1f1b"):
        stats = simulate(make_schedule(kind, p, m), UNIFORM)
        assert stats.bubble_fraction == pytest.approx((p - 1) / m) == stats.paper_bubble
        assert stats.ideal_time == m * 3.0
        assert stats.async_total_time == pytest.approx(stats.total_time)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 4), (3, 3), (8, 2)])
def test_bubble_interleaved_is_paper_formula_for_m_at_least_p(p, v):
    # any m >= p, not only multiples of p (groups of >= p microbatches)
    for m in range(p, 3 * p + 2):
        stats = simulate(make_schedule("interleaved", p, m, v), UNIFORM)
        assert stats.bubble_fraction == pytest.approx((p - 1) / (v * m)), m


@pytest.mark.parametrize("p,v,m", [(4, 2, 1), (4, 2, 3), (4, 4, 2), (5, 3, 4)])
def test_bubble_interleaved_below_p_microbatches(p, v, m):
    # with m < p rank 0 idles p - m rounds at each of the v - 1 chunk wrap-arounds,
    # forward and backward: (p-1)/(vm) + (v-1)(p-m)/(vm)
    stats = simulate(make_schedule("interleaved", p, m, v))
    assert stats.bubble_fraction == pytest.approx((v * (p - m) + m - 1) / (v * m))


def test_interleaved_with_one_chunk_is_1f1b():
    assert make_schedule("interleaved", 4, 8, 1).actions == make_schedule("1f1b", 4, 8).actions
    for m in (4, 5, 8):  # one action a round (m < 2p - 2) and W's in the slots
        zb = make_schedule("zb-interleaved", 4, m, 1)
        assert zb.actions == make_schedule("zb-h1", 4, m).actions, m
        assert simulate(zb).bubble_fraction == pytest.approx(1 / m), m  # (p-1)/(3m)


def test_interleaved_matches_megatron_order_when_m_is_multiple_of_p():
    p, v, m = 2, 2, 4
    # Megatron: groups of p, chunk-major; warm-up (p-r-1)*2 + (v-1)*p
    rank0 = [a.label(v) for a in make_schedule("interleaved", p, m, v).actions[0]]
    assert rank0[:4] == ["F0.0", "F1.0", "F0.1", "F1.1"]
    assert rank0[4:8] == ["F2.0", "B0.1", "F3.0", "B1.1"]


def test_peak_stash():
    p = 4
    assert simulate(make_schedule("gpipe", p, 16)).peak_stash[0] == 16
    # lockstep 1f1b: rank r keeps 2(p-1-r) forwards ahead of its backwards (a gradient
    # needs p-1-r rounds to return), plus the stage input in flight: 2p-1 on rank 0
    for m in (2 * p, 8 * p):
        assert simulate(make_schedule("1f1b", p, m)).peak_stash == [7, 6, 4, 2]
    for v in (2, 4):
        peaks = {tuple(simulate(make_schedule("interleaved", p, m, v)).peak_stash)
                 for m in (2 * p, 3 * p, 6 * p)}
        assert len(peaks) == 1 and max(next(iter(peaks))) <= (v + 1) * p


@pytest.mark.parametrize("kind,p,v", [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 1, 1),
                                      ("interleaved", 4, 2), ("interleaved", 3, 3),
                                      ("interleaved", 2, 4)])
def test_forward_only_rounds_closed_form(kind, p, v):
    """Chunk c of microbatch j can start on rank 0 once chunk c-1 has left rank p-1, p
    rounds after it started there: a group of g >= p microbatches never waits, one of
    g < p waits p - g rounds at each of the v - 1 chunk wrap-arounds. So the last forward
    ends in round (v-1) max(m, p) + m + p - 2, and the bubble is (p-1)/(v m) for m >= p.
    Stash: an input arrives the round before its forward on every rank (2 slots) except
    at rank 0's wrap-around, where a group of g waits g - p + 1 rounds (g - p + 2 slots)."""
    for m in range(1, 3 * p + 2):
        schedule = forward_only(make_schedule(kind, p, m, v))
        rounds, stats = lower(schedule), simulate(schedule)
        assert rounds.num_rounds == (v - 1) * max(m, p) + m + p - 1, m
        assert rounds.num_grad_slots == 0 and not any(map(any, rounds.b_valid))
        if m >= p:
            assert stats.bubble_fraction == pytest.approx((p - 1) / (v * m)), m
        g = -(-m // max(1, m // p))  # the largest of make_schedule's max(1, m // p) groups
        assert rounds.num_stash_slots == (1 if p == 1 or m == 1 else
                                          2 if v == 1 else max(2, g - p + 2)), m
        if v == 1:  # a forward wave: F(j) on rank r in round j + r
            assert all(rounds.f_valid[j + r][r] and rounds.f_mb[j + r][r] == j
                       for j in range(m) for r in range(p))


def test_forward_only_keeps_the_training_rule_strict():
    schedule = forward_only(make_schedule("1f1b", 2, 2))
    assert [[a.label() for a in acts] for acts in schedule.actions] == [["F0", "F1"]] * 2
    with pytest.raises(ScheduleError, match=r"rank 0: B0 is missing \(each F and B"):
        validate(dataclasses.replace(schedule, forward_only=False))
    with_backward = dataclasses.replace(schedule, actions=(
        (Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0)), schedule.actions[1]))
    with pytest.raises(ScheduleError, match=r"rank 0: .* is outside kind F, .*"
                                            r"\(forward-only: each F exactly once, no B\)"):
        validate(with_backward)


def _broken(actions, p=2, m=2):
    return Schedule("1f1b", p, m, 1, tuple(tuple(Action(k, j, 0) for k, j in rank)
                                           for rank in actions))


def test_validator_missing_backward():
    with pytest.raises(ScheduleError, match=r"rank 1: B1 is missing") as e:
        validate(_broken([[("F", 0), ("F", 1), ("B", 0), ("B", 1)],
                           [("F", 0), ("B", 0), ("F", 1)]]))
    assert "(missing B1)!" in str(e.value)


def test_validator_backward_before_forward():
    with pytest.raises(ScheduleError, match=r"rank 0: B1 comes before its forward") as e:
        validate(_broken([[("F", 0), ("B", 1), ("F", 1), ("B", 0)],
                          [("F", 0), ("B", 0), ("F", 1), ("B", 1)]]))
    assert "B1!" in str(e.value).splitlines()[2]  # marked on rank 0's row of the grid


def test_validator_cross_rank_deadlock():
    # rank 0 waits for B0's gradient before sending F1; rank 1 wants F1 before B0
    with pytest.raises(ScheduleError, match=r"deadlock at round 1") as e:
        validate(_broken([[("F", 0), ("B", 0), ("F", 1), ("B", 1)],
                          [("F", 1), ("B", 1), ("F", 0), ("B", 0)]]))
    lines = str(e.value).splitlines()
    assert lines[2].rstrip().endswith("B0!") and lines[3].rstrip().endswith("F1!")


def test_parameter_errors():
    with pytest.raises(ScheduleError, match="chunks=2 must be 1 for kind='zb-h1'"):
        make_schedule("zb-h1", 4, 8, 2)
    with pytest.raises(ScheduleError, match="chunks=2 must be 1 for kind='1f1b'"):
        make_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="microbatches=0 must be an integer >= 1"):
        make_schedule("gpipe", 4, 0)
    with pytest.raises(ScheduleError, match="kind='zb'"):
        make_schedule("zb", 4, 8)
    assert check_layers(16, 4, 2) == 2
    with pytest.raises(ScheduleError, match=r"num_layers=18 .* stages\*chunks=4\*2=8"):
        check_layers(18, 4, 2)


def test_hop_latency_is_paid_once_per_round():
    """A round's messages overlap its later slots; the last one's latency is exposed."""
    base, slow = (simulate(make_schedule("1f1b", 4, 8), hop_latency=h) for h in (0.0, 0.5))
    assert slow.total_time == pytest.approx(base.total_time + base.num_rounds * 0.5)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxptd.pipeline.schedules", *args],
                          capture_output=True, text=True)


def test_cli_json_and_grid():
    out = _cli("--kind", "interleaved", "--stages", "4", "--microbatches", "8", "--chunks",
               "2", "--json")
    assert out.returncode == 0
    got = json.loads(out.stdout)
    assert got["bubble_fraction"] == pytest.approx(3 / 16)
    assert len(got["peak_stash"]) == 4 and got["messages"]["forward"] == 8 * 7
    text = _cli("--kind", "1f1b", "--stages", "2", "--microbatches", "2").stdout
    assert "rank 1  . .   F0 B0 F1 B1 . ." in text and "bubble_fraction 0.5000" in text


def test_cli_forward_only(capsys):
    assert sim.main(["--kind", "1f1b", "--stages", "2", "--microbatches", "2",
                     "--forward-only"]) == 0
    text = capsys.readouterr().out
    assert "rank 0  F0 F1 .\nrank 1  .  F0 F1\n" in text and "bubble_fraction 0.5000" in text


@pytest.mark.parametrize("args", [["--kind", "gpipe", "--stages", "4", "--microbatches", "8",
                                   "--chunks", "2"],
                                  ["--kind", "nope", "--stages", "4", "--microbatches", "8"],
                                  ["--kind", "1f1b", "--stages", "0", "--microbatches", "8"]])
def test_cli_bad_arguments(args):
    out = _cli(*args)
    assert out.returncode == 2 and out.stderr.startswith("error: ")
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_cli_refuses_a_schedule_too_large_to_simulate_at_once():
    """p = 64, m = 100000 is 12.8 million actions (over a minute of silence before): one
    error line, within seconds, naming the limit, the paper's bubble and what to do."""
    out = subprocess.run([sys.executable, "-m", "jaxptd.pipeline.schedules", "--kind",
                          "1f1b", "--stages", "64", "--microbatches", "100000"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    [line] = out.stderr.splitlines()
    assert line.startswith("error: --stages 64 x --microbatches 100000 is 12,800,000 actions")
    assert f"{sim.MAX_ACTIONS:,}" in line and "--microbatches" in line
    assert "0.00063" in line  # (p-1)/m, the paper's bubble


def test_cli_png_without_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(SystemExit) as e:
        sim.main(["--kind", "1f1b", "--stages", "2", "--microbatches", "2",
                  "--png", str(tmp_path / "t.png")])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: --png")


def test_cli_png_draws(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    assert sim.main(["--kind", "interleaved", "--stages", "4", "--microbatches", "8",
                     "--chunks", "2", "--png", str(path)]) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- zero bubble


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_h1_bubble_is_paper_formula_for_every_m_from_p(p):
    """Uniform costs: (p-1)(t_f+t_b-t_w)/(m(t_f+t_b+t_w)) = (p-1)/(3m) for every m >= p, at
    a peak stash of min(m, 2p-1) (counted from a stage input's arrival to its W)."""
    for m in range(p, 4 * p + 1):
        stats = simulate(make_schedule("zb-h1", p, m), UNIFORM)
        assert stats.paper_bubble == pytest.approx((p - 1) / (3 * m))
        assert stats.bubble_fraction == pytest.approx((p - 1) / (3 * m)), m
        assert max(stats.peak_stash) == min(m, 2 * p - 1), m
        assert stats.async_total_time <= stats.total_time + 1e-9


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 4), (3, 3), (8, 2)])
def test_zb_interleaved_bubble_is_formula_over_v(p, v):
    for m in range(p, 4 * p + 2):
        stats = simulate(make_schedule("zb-interleaved", p, m, v), UNIFORM)
        expected = (p - 1 + max(0, 2 * p - 2 - m)) / (3 * v * m)
        assert stats.bubble_fraction == pytest.approx(expected), m
        assert stats.paper_bubble == pytest.approx((p - 1) / (3 * v * m))


@pytest.mark.parametrize("costs", [Costs(1, 2, 1), Costs(2, 3, 1), Costs(1, 1, 0.5)])
def test_zb_h1_reaches_the_formula_when_w_is_no_longer_than_f(costs):
    """The paper's bubble (p-1)(t_f+t_b-t_w) holds whenever t_w <= t_f (the W fills what a
    forward would); 1F1B's (p-1)(t_f+t_b+t_w) is the bound it beats."""
    p, m = 4, 16
    zb = simulate(make_schedule("zb-h1", p, m, costs=costs), costs)
    ofb = simulate(make_schedule("1f1b", p, m), costs)
    assert zb.bubble_fraction == pytest.approx(zb.paper_bubble)
    assert ofb.bubble_fraction == pytest.approx((p - 1) / m)
    assert ofb.bubble_fraction > zb.bubble_fraction


def test_zb_peak_stash_keeps_the_base_kinds_and_does_not_grow_with_m():
    """Counted from a stage input's arrival to its W: zb-h1 holds at most 1F1B's peak (2p-1
    on the busiest rank); zb-interleaved at most one more than interleaved's."""
    for p in (2, 4, 8):
        base = max(simulate(make_schedule("1f1b", p, 8 * p)).peak_stash)
        peaks = {max(simulate(make_schedule("zb-h1", p, m)).peak_stash)
                 for m in range(2 * p, 8 * p + 1, p // 2 or 1)}
        assert peaks == {base == 2 * p - 1 and base}
    for p, v in [(4, 2), (2, 4), (8, 2)]:
        base = max(simulate(make_schedule("interleaved", p, 8 * p, v)).peak_stash)
        peaks = {max(simulate(make_schedule("zb-interleaved", p, m, v)).peak_stash)
                 for m in (3 * p, 4 * p, 6 * p, 8 * p)}
        assert peaks == {base + 1}


def test_zb_validator_rules():
    schedule = make_schedule("zb-h1", 2, 2)
    rank0 = schedule.actions[0]
    w0 = rank0.index(Action("W", 0, 0))
    early = rank0[:1] + (rank0[w0],) + tuple(a for i, a in enumerate(rank0) if i not in (0, w0))
    with pytest.raises(ScheduleError, match=r"rank 0: W0 comes before its backward \(each F, "
                                            r"B and W exactly once"):
        validate(dataclasses.replace(schedule, actions=(early, schedule.actions[1])))
    no_w = tuple(a for a in rank0 if a != Action("W", 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 0: W1 is missing"):
        validate(dataclasses.replace(schedule, actions=(no_w, schedule.actions[1])))
    with pytest.raises(ScheduleError, match=r"outside kind F/B"):
        validate(dataclasses.replace(schedule, kind="1f1b"))


def test_cli_zero_bubble_json():
    out = _cli("--kind", "zb-h1", "--stages", "4", "--microbatches", "8", "--fwd-cost", "1",
               "--bwd-cost", "1", "--json")
    got = json.loads(out.stdout)
    assert out.returncode == 0 and got["bubble_fraction"] == pytest.approx(3 / 24)
    assert got["paper_bubble"] == pytest.approx(3 / 24) and max(got["peak_stash"]) == 7
    assert set(got) >= {"total_time", "ideal_time", "num_rounds", "messages",
                        "async_total_time"}
    # the default W cost is B's: --bwd-cost 2 alone means B = W = 2
    two = json.loads(_cli("--kind", "zb-h1", "--stages", "4", "--microbatches", "8",
                          "--bwd-cost", "2", "--json").stdout)
    assert two["ideal_time"] == 8 * 5
    text = _cli("--kind", "zb-h1", "--stages", "2", "--microbatches", "2").stdout
    # the last rank defers W0 to round 3, where rank 0's B1 sets the cost
    assert "rank 0  F0 . .  F1 . .  . B0 W0 . B1 .  . . W1" in text
    assert "rank 1  . . .   F0 B0 . F1 B1 . . . W0  . . W1" in text


# --------------------------------------------------------------------------- masked rounds


MASKED = Costs(1.0, 1.0, 1.0, masked=True)


def test_masked_zb_h1_p2_m8_hand_worked():
    """A GPU's round forms run a slot kind some rank uses on every rank, so a W that only
    one rank runs costs the other a W too. Packed for that, both ranks run their W's in
    the same rounds: F and B present in 9 rounds each, W in 8, 26 units (1F1B's 27 less
    the (p - 1) W's of its bubble); packed for skipped idle slots (25 units there), the
    rounds cost 27 masked: one W round more, and two of W's alone at the end. A W slot
    runs its round's B's W where it can (rank 1 keeps W0 for the end)."""
    packed = lower(make_schedule("zb-h1", 2, 8, 1, MASKED), MASKED)
    assert packed.grid().splitlines()[1:] == [
        "rank 0  F0 . .   F1 . .   F2 B0 W0 F3 B1 W1 F4 B2 W2 F5 B3 W3 F6 B4 W4 F7 B5 W5"
        " . B6 W6  . B7 W7",
        "rank 1  . . .    F0 B0 .  F1 B1 W1 F2 B2 W2 F3 B3 W3 F4 B4 W4 F5 B5 W5 F6 B6 W6"
        " F7 B7 W7 . . W0"]
    assert simulate(make_schedule("zb-h1", 2, 8, 1, MASKED), MASKED).total_time == 26
    skipped = lower(make_schedule("zb-h1", 2, 8)).packed  # packed for skipped idle slots
    assert packed_time(skipped, UNIFORM, True, 1) == 25
    assert packed_time(skipped, MASKED, True, 1) == 27
    assert simulate(make_schedule("1f1b", 2, 8), MASKED).total_time == 27


@pytest.mark.parametrize("p", range(1, 9))
def test_masked_zb_bubble_is_two_thirds_of_1f1b_for_every_m(p):
    """Masked rounds: the F and B slots keep 1F1B's bubble, (p - 1)(t_f + t_b), and the W
    slots add none (W's in m v rounds, every rank's together): 2(p - 1)/(3 v m) at uniform
    costs, zb-h1 at every m, zb-interleaved from m = p; the kinds without W are timed as
    skipped idle slots time them; the peak stash stays the base kind's."""
    for m in range(1, 3 * p + 1):
        stats = simulate(make_schedule("zb-h1", p, m, 1, MASKED), MASKED)
        assert stats.bubble_fraction == pytest.approx(2 * (p - 1) / (3 * m)), m
        assert max(stats.peak_stash) == min(m, 2 * p - 1), m
        w_rounds = sum(any(row) for row in stats.rounds.w_valid)
        assert w_rounds == m, m
        for v in (2, 3) if m >= p > 1 else ():
            stats = simulate(make_schedule("zb-interleaved", p, m, v, MASKED), MASKED)
            assert stats.bubble_fraction == pytest.approx(2 * (p - 1) / (3 * v * m)), (m, v)
            base = simulate(make_schedule("interleaved", p, m, v), MASKED)
            assert base.bubble_fraction == pytest.approx(
                simulate(make_schedule("interleaved", p, m, v)).bubble_fraction), (m, v)
        for kind in ("gpipe", "1f1b"):
            assert simulate(make_schedule(kind, p, m), MASKED).bubble_fraction == \
                pytest.approx((p - 1) / m)


def test_masked_timeline_starts_each_slot_after_the_longest_before_it():
    """A rank's B starts where the round's longest F ends, also on a rank without an F
    (p = 2, m = 8: round 8, rank 0 runs B6 while rank 1 runs F7)."""
    costs = Costs(2.0, 1.0, 1.0, masked=True)
    stats = simulate(make_schedule("zb-h1", 2, 8, 1, costs), costs)
    packed = stats.rounds.packed
    t = next(t for t, row in enumerate(packed) if row[0][0] is None and row[0][1]
             and row[1][0] is not None)
    begins = sum(costs.round(row, True, 1) for row in packed[:t])
    starts = {(a.kind, a.microbatch): start for start, _, a in stats.timeline[0]}
    assert starts[("B", packed[t][0][1].microbatch)] == begins + 2.0
    assert stats.total_time == sum(costs.round(row, True, 1) for row in packed)


def test_cli_masked_json():
    out = _cli("--kind", "zb-h1", "--stages", "4", "--microbatches", "8", "--masked",
               "--json")
    got = json.loads(out.stdout)
    assert out.returncode == 0 and got["bubble_fraction"] == pytest.approx(6 / 24)


@pytest.mark.parametrize("costs", [UNIFORM, MASKED], ids=["cond", "masked"])
def test_zb_v_is_a_v_within_1f1bs_time_and_stash(costs):
    """zb-v: chunk 0 of rank r is stage r, chunk 1 stage 2p - 1 - r (the last on rank 0);
    its rounds take no longer than 1F1B's (zb-h1's: about as long, not always less), and
    the chunk-stages a rank holds stay within twice 1F1B's whole stages (a chunk is half a
    stage: no more bytes) and do not grow with m."""
    for p in (2, 3, 4, 8):
        assert [make_schedule("zb-v", p, 1, 2).stage(c, r) for c in (0, 1)
                for r in range(p)] == [*range(p), *range(2 * p - 1, p - 1, -1)]
        peaks = set()
        for m in (p, 2 * p, 4 * p):
            v_shape = simulate(make_schedule("zb-v", p, m, 2, costs), costs)
            one = simulate(make_schedule("1f1b", p, m, 1, costs), costs)
            assert v_shape.total_time <= one.total_time
            assert max(v_shape.peak_stash) <= 2 * max(one.peak_stash)
            peaks.add(max(v_shape.peak_stash)) if m >= 2 * p else None
        assert len(peaks) == 1
