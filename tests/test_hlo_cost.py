"""jaxptd/hlo/'s static cost on hand-written programs (no compiler needed): what a kernel
reads and writes, which operations are kernels, and the phase a kernel's jax name puts it
in. The compiled programs these rules serve are tests/test_h100.py's."""
import pytest

from jaxptd import hlo
from jaxptd.hlo.cost import ROUNDS_SCOPE, phase

COST_HLO = """
HloModule test
%body_dot (p0: bf16[64,128], p1: bf16[128,32]) -> bf16[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  ROOT %d = bf16[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
%update (q0: f32[10,64,32], q1: s32[], q2: bf16[64,32]) -> f32[10,64,32] {
  %q0 = f32[10,64,32]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %q2 = bf16[64,32]{1,0} parameter(2)
  %c = f32[64,32]{1,0} convert(%q2)
  %r = f32[1,64,32]{2,1,0} bitcast(%c)
  %z = s32[] constant(0)
  ROOT %u = f32[10,64,32]{2,1,0} dynamic-update-slice(%q0, %r, %q1, %z, %z)
}
%peek (r0: f32[10,64,32]) -> f32[1,1] {
  %r0 = f32[10,64,32]{2,1,0} parameter(0)
  %flat = f32[640,32]{1,0} bitcast(%r0)
  ROOT %e = f32[1,1]{1,0} slice(%flat), slice={[0:1], [0:1]}
}
%loop (s: (s32[], bf16[64,128], bf16[128,32], f32[10,64,32])) -> (s32[], bf16[64,128], bf16[128,32], f32[10,64,32]) {
  %s = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, f32[10,64,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %a = bf16[64,128]{1,0} get-tuple-element(%s), index=1
  %w = bf16[128,32]{1,0} get-tuple-element(%s), index=2
  %acc = f32[10,64,32]{2,1,0} get-tuple-element(%s), index=3
  %g = bf16[64,32]{1,0} fusion(%a, %w), kind=kCustom, calls=%body_dot
  %n = f32[10,64,32]{2,1,0} fusion(%acc, %i, %g), kind=kLoop, calls=%update
  %k = f32[1,1]{1,0} fusion(%n), kind=kLoop, calls=%peek
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, f32[10,64,32]{2,1,0}) tuple(%j, %a, %w, %n)
}
%cond (s: (s32[], bf16[64,128], bf16[128,32], f32[10,64,32])) -> pred[] {
  %s = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, f32[10,64,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %limit = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}
ENTRY %main (x: bf16[64,128], y: bf16[128,32], z: f32[10,64,32]) -> f32[10,64,32] {
  %x = bf16[64,128]{1,0} parameter(0)
  %y = bf16[128,32]{1,0} parameter(1)
  %z = f32[10,64,32]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, f32[10,64,32]{2,1,0}) tuple(%zero, %x, %y, %z)
  %l = (s32[], bf16[64,128]{1,0}, bf16[128,32]{1,0}, f32[10,64,32]{2,1,0}) while(%init), condition=%cond, body=%loop
  ROOT %out = f32[10,64,32]{2,1,0} get-tuple-element(%l), index=3
}
"""


def test_static_cost_counts_a_known_program():
    """jaxptd/hlo/'s walk on a hand-written program: a dot fusion in a loop of 10 (trip count from the
    condition's constant) is 10 x 2 m n k FLOPs and its operands and result; the
    dynamic-update-slice fusion writes its update [64, 32] in float32 (and reads the bf16
    value), not the [10, 64, 32] buffer; a fusion that slices one element of a buffer it
    sees through a bitcast reads that element, not the buffer."""
    module = hlo.parse(COST_HLO)
    kernels = {k.name: k for k in hlo.cost(module, peak=1e12, bandwidth=1e9)}
    gemm, update = kernels["g"], kernels["n"]
    assert gemm.count == update.count == 10
    assert gemm.category == "gemm" and gemm.flops == 2 * 64 * 32 * 128
    assert gemm.bytes == 2 * (64 * 128 + 128 * 32 + 64 * 32)
    assert update.category == "stack write" and update.flops == 0
    assert update.bytes == 4 + 2 * 64 * 32 + 4 * 64 * 32  # index, bf16 in, f32 update out
    assert gemm.seconds(1e12, 1e9) == pytest.approx(gemm.bytes / 1e9)
    assert kernels["k"].bytes == 4 + 4


HOST_HLO = """
HloModule host
%wrapped_dus (a: f16[4,8], b: f16[1,8], i: s32[]) -> f16[4,8] {
  %a = f16[4,8]{1,0:S(5)} parameter(0)
  %b = f16[1,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f16[4,8]{1,0:S(5)} dynamic-update-slice(%a, %b, %i, %z)
}
%neg (n0: f16[1,8]) -> f16[1,8] {
  %n0 = f16[1,8]{1,0} parameter(0)
  ROOT %n = f16[1,8]{1,0} negate(%n0)
}
ENTRY %main (h: f16[4,8], x: f16[1,8], i: s32[]) -> f16[4,8] {
  %h = f16[4,8]{1,0:S(5)} parameter(0)
  %x = f16[1,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %y = f16[1,8]{1,0} fusion(%x), kind=kLoop, calls=%neg
  %s = ((f16[4,8]{1,0:S(5)}, f16[1,8]{1,0}, s32[]), f16[4,8]{1,0:S(5)}, u32[]) fusion-start(%h, %y, %i), kind=kCustom, calls=%wrapped_dus
  ROOT %d = f16[4,8]{1,0:S(5)} fusion-done(%s)
}
"""


def test_static_cost_leaves_host_transfers_out():
    """An update written into a buffer in host memory (the async fusion XLA wraps the
    offloading dynamic-update-slice in, as in the offloaded layer inputs of a scan) is a
    copy over the host link, not a kernel: the static cost counts the negate only (it
    counted the whole host buffer at HBM speed, so a scanned offloading step looked
    slower than the same step unrolled, whose offloads are copy-starts)."""
    kernels = hlo.cost(hlo.parse(HOST_HLO), peak=1e12, bandwidth=1e9)
    assert [k.name for k in kernels] == ["y"]


ALLOCATE_HLO = """
HloModule allocate
%put (a: f16[4,8], b: f16[1,8], i: s32[]) -> f16[4,8] {
  %a = f16[4,8]{1,0} parameter(0)
  %b = f16[1,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f16[4,8]{1,0} dynamic-update-slice(%a, %b, %i, %z)
}
ENTRY %main (x: f16[1,8], i: s32[]) -> f16[4,8] {
  %x = f16[1,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %e = f16[4,8]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %w = f16[4,8]{1,0} fusion(%e, %x, %i), kind=kLoop, calls=%put
}
"""


def test_static_cost_leaves_allocations_out():
    """A buffer `lax.empty` makes (an AllocateBuffer call: nothing written, the pipeline's
    unzeroed slot buffers) is no kernel; the update written into it in place is."""
    kernels = hlo.cost(hlo.parse(ALLOCATE_HLO), peak=1e12, bandwidth=1e9)
    assert [(k.name, k.bytes) for k in kernels] == [("w", 4 + 2 * 2 * 8)]


AFTER_HLO = """
HloModule after
%read (b: f32[10,64], s: f32[512,512], g: f32[512,512], i: s32[]) -> f32[1,64] {
  %b = f32[10,64]{1,0} parameter(0)
  %s = f32[512,512]{1,0} parameter(1)
  %g = f32[512,512]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %sum = f32[512,512]{1,0} add(%s, %g)
  %first = f32[1,1]{1,0} slice(%sum), slice={[0:1], [0:1]}
  %bits = s32[1,1]{1,0} bitcast-convert(%first)
  %sign = s32[] bitcast(%bits)
  %at = s32[] maximum(%i, %sign)
  %z = s32[] constant(0)
  ROOT %r = f32[1,64]{1,0} dynamic-slice(%b, %at, %z), dynamic_slice_sizes={1,64}
}
ENTRY %main (b: f32[10,64], s: f32[512,512], g: f32[512,512], i: s32[]) -> f32[1,64] {
  %b = f32[10,64]{1,0} parameter(0)
  %s = f32[512,512]{1,0} parameter(1)
  %g = f32[512,512]{1,0} parameter(2)
  %i = s32[] parameter(3)
  ROOT %k = f32[1,64]{1,0} fusion(%b, %s, %g, %i), kind=kLoop, calls=%read
}
"""


def test_static_cost_reads_the_elements_a_slice_needs():
    """A slot read made to wait for a gradient sum (varying.after: an index that depends on
    the sign of the sum's first element, an add fused in) reads the slot and one element
    of each summed operand, not the [512, 512] sums: 64 + 1 + 1 floats, the index and the
    result."""
    (kernel,) = hlo.cost(hlo.parse(AFTER_HLO), peak=1e12, bandwidth=1e9)
    assert kernel.bytes == 4 * 64 + 4 + 4 + 4 + 4 * 64


SCATTER_HLO = """
HloModule scatter
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%scat (t: f32[1000,8], i: s32[4,1], u: f32[4,8]) -> f32[1000,8] {
  %t = f32[1000,8]{1,0} parameter(0)
  %i = s32[4,1]{1,0} parameter(1)
  %u = f32[4,8]{1,0} parameter(2)
  ROOT %r = f32[1000,8]{1,0} scatter(%t, %i, %u), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}
ENTRY %main (t: f32[1000,8], i: s32[4,1], u: f32[4,8]) -> f32[1000,8] {
  %t = f32[1000,8]{1,0} parameter(0)
  %i = s32[4,1]{1,0} parameter(1)
  %u = f32[4,8]{1,0} parameter(2)
  ROOT %k = f32[1000,8]{1,0} fusion(%t, %i, %u), kind=kInput, calls=%scat
}
"""


def test_static_cost_counts_a_scatter_s_updates():
    """A scatter-add into a fusion operand (the embedding table's gradient sums, a B slot
    at a time) reads its indices and updates and writes the updated rows in place, not the
    table: 4 indices, 4 x 8 float32 read and written."""
    (kernel,) = hlo.cost(hlo.parse(SCATTER_HLO), peak=1e12, bandwidth=1e9)
    assert kernel.bytes == 4 * 4 + 2 * 4 * 8 * 4


def test_static_cost_phases_by_jax_name():
    """A kernel's phase from its op's jax name: autodiff's transpose is the backward, its
    jvp the forward; outside both, in a pipeline's rounds (slot copies and gradient sums)
    the rounds, the rest the update, in a loop too (the offloaded optimizer's; names from
    the H100 compiles of GPT-1.3B)."""
    rounds = f"jit(step_fn)/shard_map/{ROUNDS_SCOPE}/while/body/closed_call/"
    assert phase(rounds + "transpose(jvp(Block))/mlp/dot_general") == "backward"
    assert phase(rounds + "jvp(Block)/mlp/dot_general") == "forward"
    assert phase(rounds + "jit(dynamic_update_index_in_dim)/dynamic_update_slice") == "rounds"
    assert phase(rounds + "add") == "rounds"
    assert phase("jit(step_fn)/add") == phase("jit(step_fn)/reduce_sum") == phase("") \
        == phase("jit(step_fn)/while/body/closed_call/dynamic_update_slice") == "update"


COLLECTIVES_HLO = """
HloModule test
%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
%scatter (a: f32[8,16]) -> f32[2,16] {
  %a = f32[8,16]{1,0} parameter(0)
  ROOT %r = f32[2,16]{1,0} reduce-scatter(%a), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%sum
}
ENTRY %main (p: bf16[4,16], q: f32[8,16]) -> (bf16[8,16], f32[2,16]) {
  %p = bf16[4,16]{1,0} parameter(0)
  %q = f32[8,16]{1,0} parameter(1)
  %ags = (bf16[4,16]{1,0}, bf16[8,16]{1,0}) all-gather-start(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  %agd = bf16[8,16]{1,0} all-gather-done(%ags)
  %rss = ((f32[8,16]{1,0}), f32[2,16]{1,0}) async-start(%q), calls=%scatter
  %rsd = f32[2,16]{1,0} async-done(%rss)
  ROOT %t = (bf16[8,16]{1,0}, f32[2,16]{1,0}) tuple(%agd, %rsd)
}
"""


def test_collectives_move_what_a_ring_rank_moves():
    """A collective's bytes are what it delivers; link_bytes what one rank of its replica
    group moves in a ring: an all-gather of 2 receives half its output (its group from
    {{...}}), a reduce-scatter of 4 sends 3 parts its output's size (the iota form
    [groups,size]<=[n], on the collective an async-start wraps)."""
    found = {c.kind: c for c in hlo.collectives(hlo.parse(COLLECTIVES_HLO))}
    gather, scatter = found["all-gather"], found["reduce-scatter"]
    assert (gather.bytes, gather.group, gather.link_bytes()) == (256, 2, 128)
    assert (scatter.bytes, scatter.group, scatter.link_bytes()) == (128, 4, 384)
