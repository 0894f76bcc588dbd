"""The planner's calibrated time model (jaxptd/plan/kernels.py, timing.link_bandwidths):
GEMM wave quantization, the links by how a group lies over nodes, the step from a compiled
step's kernels, and PTD-P's Table 1 rows (their stored compiles, bench/results/table1/)
against the paper's step times."""
import json
import pathlib

import pytest

from jaxptd.plan import kernels
from jaxptd.plan import timing as plan_time
from jaxptd.runtime.target import TARGETS

REPO = pathlib.Path(__file__).resolve().parent.parent
TABLE1 = ("1.7b", "3.6b", "7.5b", "18.4b", "39.1b", "76.1b", "145.6b", "310.1b", "529.6b",
          "1008b")


def test_wave_efficiency_counts_the_last_wave_whole():
    """108 tiles of 256 x 128 fill an A100 once (1.0); one tile more takes a second wave
    (109 / 216); a ragged edge pays for its whole tile; the better orientation wins."""
    assert kernels.wave_efficiency(256, 128 * 108, 108) == pytest.approx(1.0)
    assert kernels.wave_efficiency(256, 128 * 109, 108) == pytest.approx(109 / 216)
    assert kernels.wave_efficiency(256, 100, 1) == pytest.approx(100 / 128)
    assert kernels.wave_efficiency(128, 256 * 108, 108) == pytest.approx(1.0)
    # FLOP-weighted over forward, data and weight gradient: all whole waves -> 1
    assert kernels.gemms_efficiency(256, [(128 * 108, 128 * 108)], 108, 2) == pytest.approx(1.0)


def test_links_use_a_node_s_nics_in_parallel():
    """t = 8 fills a node: every other axis crosses InfiniBand on one NIC a GPU; t = 1 and
    32 data ranks: a node holds 8 of a group, 8 rings on 8 NICs (at most NVLink's ring); a
    group inside a node rings over NVLink."""
    hw = TARGETS["a100"]
    nvlink, nic = hw.intra * hw.intra_fraction, hw.inter * hw.inter_fraction
    wide = plan_time.link_bandwidths(hw, t=8, p=4, d=32)
    assert wide["tensor"] == nvlink and wide["p2p"] == nic and wide["data"] == nic
    assert plan_time.link_bandwidths(hw, t=1, d=32)["data"] == min(8 * nic, nvlink)
    assert plan_time.link_bandwidths(hw, t=2, d=32)["data"] == 4 * nic
    assert plan_time.link_bandwidths(hw, t=2, d=4)["data"] == nvlink


def test_step_from_compiled_kernels_adds_its_parts():
    """GEMM seconds at the measured ceiling times the wave efficiency, the rest at the HBM
    fraction, a launch cost each; tensor traffic less the bytes-weighted covered share of
    the reduce-scatters and all-gathers, the pipe's likewise, data as planned."""
    hw = TARGETS["a100"]
    planned = {"kernels": {"gemm_efficiency": 0.9}, "options": {"sequence_parallel": True},
               "step_time_s": {"tensor": 2.0, "p2p": 1.0, "context": 0.0, "expert": 0.0,
                               "fsdp": 0.0, "data": 0.5, "host": 0.0}}
    compiled = {"cost": {"seconds": 10.0, "launches": 1000,
                         "category": {"gemm": {"seconds": 7.0}, "other": {"seconds": 3.0}}},
                "collectives": {"by_kind": {
                    "all-gather": {"launches": 10, "bytes": 3.0, "covered": 5},
                    "reduce-scatter": {"launches": 10, "bytes": 1.0, "covered": 0},
                    "collective-permute": {"launches": 4, "bytes": 1.0, "covered": 4}}}}
    t = kernels.compiled_step_time(planned, compiled, hw)
    assert t["gemm"] == pytest.approx(7.0 / (hw.gemm_fraction * 0.9))
    assert t["other"] == pytest.approx(3.0 / kernels.HBM_FRACTION)
    assert t["launches"] == pytest.approx(1000 * kernels.KERNEL_S)
    assert t["tensor"] == pytest.approx(2.0 * (1 - 3.0 * 0.5 / 4.0))
    assert t["p2p"] == pytest.approx(0.0) and t["data"] == 0.5
    assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"))


def test_the_cli_plans_with_kernels_unless_given_a_rate(capsys):
    """On a target with a measured ceiling the plan's compute is the kernel model's (its
    parts, the bubble on all but the update); --device-tflops gives the flat rate."""
    from jaxptd.plan.cli import main
    argv = ["--config", str(REPO / "configs/megatron/gpt_1.7b.yaml"), "--json"]
    main(argv)
    r = json.loads(capsys.readouterr().out)
    k, t = r["kernels"], r["step_time_s"]
    assert r["time_model"] == "kernels" and 0.8 < k["gemm_efficiency"] <= 1
    assert t["compute"] == pytest.approx(k["total"])  # (p = 1: no bubble)
    assert k["total"] == pytest.approx(sum(k[p] for p in ("gemm", "attention", "memory",
                                                          "rounds", "launches", "update")))
    assert k["rounds"] == 0  # (unpipelined: no executor)
    main(argv + ["--device-tflops", "156"])
    flat = json.loads(capsys.readouterr().out)
    assert flat["time_model"] == "flat" and flat["kernels"] is None
    assert flat["step_time_s"]["compute"] == pytest.approx(
        flat["flops_per_iteration"] / flat["num_devices"] / 156e12)


def test_pipelined_rounds_move_the_chunk_s_sums_copies_and_stash(capsys):
    """A pipelined rank's executor, each of its m v rounds that run an F and a B: the
    chunk's float32 gradient sums, 8 bytes a parameter, and with chunks (529.6B's
    interleaved v 3) its weights copied out of the stack and its gradients added outside
    the GEMMs at the traced chunk, 8 more each; the stash slot written (read and written; under full
    recomputation nothing copied out of it); the ends' casts and scatter-add on every
    rank where the head is not spread (529.6B's p 35), at the HBM rate."""
    from jaxptd.config import load_config
    from jaxptd.plan.cli import main
    from jaxptd.plan.counts import real_counts
    path = REPO / "configs/megatron/gpt_529.6b.yaml"
    main(["--config", str(path), "--json"])
    r = json.loads(capsys.readouterr().out)
    counts, lay = real_counts(load_config(str(path))), r["layout"]
    assert lay["schedule"] == "interleaved" and lay["chunks"] == 3
    stage_input = 2048 * 20480 * 2 / 8  # [b, s/t, h] bf16, b 1
    chunk_layers = 105 // lay["pipe"] // lay["chunks"]
    per_round = kernels.executor_bytes(
        chunk_params=counts["stage_params"] / 3, chunks=3,
        stash_slot=(chunk_layers + 2) * stage_input, copied=0.0,
        head_params=counts["head_params"])
    assert per_round == pytest.approx(24 * counts["stage_params"] / 3
                                      + 2 * 3 * stage_input + 20 * counts["head_params"])
    hw = TARGETS["a100"]
    assert r["kernels"]["rounds"] == pytest.approx(
        lay["microbatches"] * lay["chunks"] * per_round / (hw.hbm * kernels.HBM_FRACTION))


@pytest.mark.parametrize("source", ["plan", "kernels"])
def test_table1_within_ten_percent_of_the_paper(source, capsys):
    """Issue 50: the planner's step time from the config alone (planned now, from the row's
    config) within 10% of the paper's on at least 8 of Table 1's 10 rows. From the stored
    compile's kernels no row is more than 10% slower than the paper's: with the paper's
    recomputation (one forward again) the pipelined 39.1B-310.1B programs are 12-18%
    faster than its step, and bench.table1 says so (`miss`)."""
    import bench.table1 as table1
    from jaxptd import plan
    ratios = {}
    for name in TABLE1:
        row = json.loads((REPO / f"bench/results/table1/gpt_{name}_a100.json").read_text())
        if source == "plan":
            plan.main(["--config", str(REPO / row["config"]), "--target", row["target"],
                       "--json"])
            planned = json.loads(capsys.readouterr().out)
            assert planned["flops_recompute"] == row["plan"]["flops_recompute"], name
        seconds = planned["step_time_s"]["total"] if source == "plan" else \
            table1.kernel_time(row)["total"]
        ratios[name] = seconds / table1.paper_seconds(row)
        if source == "kernels" and ratios[name] < 0.9:
            assert table1.miss(row).startswith("faster than the paper"), name
    if source == "plan":
        assert sum(abs(r - 1) <= 0.10 for r in ratios.values()) >= 8, ratios
    assert max(ratios.values()) <= 1.10, ratios


def test_zero_bubble_rounds_copy_the_tape_whatever_the_recomputation(capsys):
    """A zero-bubble F tapes each layer's dense() inputs for its W: with model.remat=minimal
    its rounds copy no less than without recomputation (the B's slot keeps the inputs'
    sources instead), where 1F1B's copy less (as the compiled program's stash and tape
    writes: BENCHMARKS.md)."""
    from jaxptd.plan.cli import main
    deep = ["parallel.data=1", "parallel.pipe=8", "parallel.tensor=1",
            "parallel.microbatches=32", "train.global_batch=64", "model.num_layers=32"]

    def rounds(schedule, remat):
        main(["--config", str(REPO / "configs/gpu/gpt_1.3b.yaml"), "--target", "h100",
              "--json", *deep, f"parallel.schedule={schedule}", f"model.remat={remat}"])
        return json.loads(capsys.readouterr().out)["kernels"]["rounds"]
    assert rounds("zb-h1", "minimal") >= rounds("zb-h1", "none") > rounds("1f1b", "none")
    assert rounds("1f1b", "minimal") < rounds("1f1b", "none")


def test_the_planner_ranks_the_schedules_as_their_compiled_steps(capsys):
    """Issue 48: at its three layouts ((1,8,1) 32 layers m 32, (2,2,2) m 8, (1,4,2) m 16)
    the planner's step times order the schedules, with and without minimal recomputation,
    as the compiled programs' static times do (bench/results/h100_schedules.json: `python
    -m bench.h100_compile --schedules`), every pair of a layout more than 1% apart in the
    compile but the interleaved rows over a tensor split, whose chunk sums and selects
    cost more than the model's CHUNKS_BYTES at p 2 and 4 (BENCHMARKS.md). Before the
    copies out of the stash, minimal's recomputed elementwise work, the chunks' sums and
    the rounds that run the head were counted, the planner put zb-interleaved first at
    (1,8,1), where the compile has it fifth of nine."""
    from jaxptd.plan.cli import main
    misses = {"(2,2,2) interleaved m8", "(1,4,2) interleaved m16"}
    rows = json.loads((REPO / "bench/results/h100_schedules.json").read_text())["rows"]
    steps = {}
    for r in rows:
        if r["name"].startswith("1 device"):
            continue
        main(["--config", str(REPO / "configs/gpu/gpt_1.3b.yaml"), "--target", "h100",
              "--json", *r["overrides"]])
        steps[r["name"]] = (r["cost"]["seconds"],
                            json.loads(capsys.readouterr().out)["step_time_s"]["total"])
    assert len(steps) == 19
    for a, (compiled_a, planned_a) in steps.items():
        for b, (compiled_b, planned_b) in steps.items():
            if a[:7] == b[:7] and compiled_a < 0.99 * compiled_b and not {a, b} & misses:
                assert planned_a < planned_b, (a, b, steps[a], steps[b])
