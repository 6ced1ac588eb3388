"""The scheduled loop IR: which passes a kernel runs and what runs in each."""

import subprocess
import sys
import textwrap

import pytest

from compll import load, load_source
from compll import schedule as sch
from compll.compiler import generate
from compll.lower import lower
from compll.render import CpuRenderer, CudaRenderer
from compll.scheduling import schedule

pytestmark = pytest.mark.pure


def kernels(prog, renderer=CpuRenderer):
    return schedule(lower(prog), renderer.options)


def kinds(kernel):
    """The items' kinds, without the random streams' keys and the loops' hoisted values
    (``compll.loops``)."""
    return [type(item).__name__ for item in kernel.items if not isinstance(item, sch.StreamKeys)
            and not (isinstance(item, sch.Scalar) and item.name.startswith("%"))]


def test_minmax8_reads_g_twice_and_adds_the_residual_in_the_first_pass():
    encode, decode = kernels(load("minmax8"))
    assert kinds(encode) == ["EncodeInput", "Pass", "Scalar", "Lazy", "PayloadSizes", "Pass",
                             "ScalarSection", "ScalarSection", "Return"]
    first, second = (item for item in encode.items if isinstance(item, sch.Pass))
    assert [type(op).__name__ for op in first.ops] == ["TakeInputOp", "MinMax"]
    assert first.ops[1].watch  # the non-finite flag without a residual rides the minmax
    assert [type(op).__name__ for op in second.ops] == ["PackStore"]
    assert kinds(decode) == ["CheckSections", "BindSections", "Pass", "Return"]


def test_independent_reductions_share_a_pass_and_dependent_ones_wait():
    prog = load_source(textwrap.dedent("""
        encode(g: f32[]) -> bytes:
            let s = reduce(g, sum)
            let t = reduce(g, sum, key=x -> x * s)   # needs s: a second pass
            let m = reduce(g, max)                   # joins the second pass
            let k = f32(size(g)) * 2.0               # needs neither: before the open pass
            return concat(s, t, m, k)
        decode(p: bytes, n: u32) -> f32[n]:
            let s: f32, t: f32, m: f32, k: f32 = extract(p)
            return map(iota(n), i -> s + t + m + k)
    """), "two.cll")
    encode, _ = kernels(prog)
    assert kinds(encode)[:5] == ["EncodeInput", "Pass", "Scalar", "PayloadSizes", "Pass"]
    first, second = encode.items[1], encode.items[4]
    assert [op.out for op in first.ops if isinstance(op, sch.Sum)] == ["s"]
    assert sorted(getattr(op, "out", "") for op in second.ops) == ["m", "t"]


def test_a_gather_adds_the_residual_first_and_selections_write_in_one_pass():
    encode, _ = kernels(load("dgc"))
    assert kinds(encode)[:2] == ["EncodeInput", "TakeInput"]
    stores = [item for item in encode.items if isinstance(item, sch.Pass)
              and any(isinstance(op, sch.Store) for op in item.ops)]
    assert len(stores) == 1 and len(stores[0].ops) == 2  # indices and values together


def test_a_payload_that_may_not_fit_keeps_r_plus_g_for_the_retry():
    encode, _ = kernels(load("onebit"))
    sizes = next(item for item in encode.items if isinstance(item, sch.PayloadSizes))
    assert sizes.residual_on_retry  # the payload is sized before any pass reads g


def test_cuda_passes_merge_no_extremes():
    encode, _ = kernels(load("minmax8"), CudaRenderer)
    ops = [op for item in encode.items if isinstance(item, sch.Pass) for op in item.ops]
    assert [type(op).__name__ for op in ops] == ["TakeInputOp", "Extreme", "Extreme",
                                                 "CheckInputOp", "PackStore"]


def test_hipress_dump_schedule_prints_it():
    code = ("from compll import load; from compll.compiler import generate; "
            "generate(load('minmax8'), 'cpu')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"HIPRESS_DUMP": "schedule", "PATH": ""}, check=True)
    assert "--- compll schedule ---" in out.stderr
    assert ("pass over n:\n      take g (r += g, non-finite flag of the sum)\n"
            "      lo, hi = minmax(g) direct") in out.stderr


@pytest.mark.parametrize("name,take,host,rider", [
    ("onebit", "TakeInputOp", "the first pass", "Sum"),   # a direct reduction's loop
    ("terngrad", "TakeInputOp", "the first pass", "Extreme"),
    ("fp16", "TakeInputOp", "the first pass", "Store"),   # else a section write's
    ("cgx", "TakeInput", "the pass over n", "PackStore"),  # a loop of its own, the check later
    ("qsgd", "TakeInput", "the pass over n", "PackStore"),
    ("dgc", "TakeInput", "a scan of g", "Selection"),     # the filter over g reads it all
    ("topk", "TakeInput", "a scan of g", "Selection"),    # so does top-k's candidate scan
    ("randomk", "TakeInput", None, None),                 # nothing reads all of g: a loop
])
def test_the_non_finite_flag_rides_a_pass_the_encoder_makes_anyway(name, take, host, rider):
    """Without a residual the flag of g rides the loop of an op of a pass over n that
    reads every element anyway (on the GPU: the pass's last op); only an encoder with no
    such pass reads g once more for it."""
    def riders(kernel):
        over_n = [item for item in kernel.items if isinstance(item, sch.Pass)
                  and item.extent.kind == "n"]
        return over_n, [(p, op) for p in over_n for op in p.ops
                        if getattr(op, "watch", False) or isinstance(op, sch.CheckInputOp)]

    encode, _ = kernels(load(name))
    takes = [item for item in encode.items if isinstance(item, sch.TakeInput)]
    if take == "TakeInputOp":
        assert not takes and isinstance(riders(encode)[0][0].ops[0], sch.TakeInputOp)
    else:
        assert len(takes) == 1 and takes[0].checks == (host is None)
    scans = [item for item in encode.items if isinstance(item, sch.Selection) and item.watch]
    over_n, found = riders(encode)
    if host is None:
        assert not found and not scans
        return
    if rider == "Selection":
        assert not found and len(scans) == 1 and scans[0].call.fn in ("filter", "topk")
        cuda, _ = kernels(load(name), CudaRenderer)  # the GPU's take checks g itself
        assert [t.checks for t in cuda.items if isinstance(t, sch.TakeInput)] == [True]
        return
    assert [(p, type(op).__name__) for p, op in found] == [(over_n[0], rider)]
    cuda, _ = kernels(load(name), CudaRenderer)
    over_n, found = riders(cuda)
    assert [(p, type(op).__name__) for p, op in found] == [(over_n[0], "CheckInputOp")]
    assert over_n[0].ops[-1] is found[0][1]


def test_cgx_runs_one_block_minmax_before_its_passes():
    encode, decode = kernels(load("cgx"), CudaRenderer)
    assert kinds(encode) == ["EncodeInput", "TakeInput", "BlockReduce", "Scalar", "Lazy",
                             "Lazy", "Lazy", "PayloadSizes", "Pass", "Pass", "Return"]
    (block,) = (item for item in encode.items if isinstance(item, sch.BlockReduce))
    assert (block.op, block.name, block.other, block.block) == ("min", "lo", "hi", 512)
    assert not block.in_pass
    blocks_pass, element_pass = (item for item in encode.items if isinstance(item, sch.Pass))
    assert blocks_pass.extent.kind == "blocks" and element_pass.extent.kind == "n"
    assert [type(op).__name__ for op in element_pass.ops] == ["PackStore", "CheckInputOp"]
    assert not element_pass.ops[0].watch  # on the GPU each op is a kernel: no loop to share
    assert kinds(decode) == ["CheckSections", "BindSections", "Pass", "Return"]


def test_cgx_reduces_each_chunks_blocks_inside_its_element_pass_on_the_cpu():
    encode, _ = kernels(load("cgx"))
    assert kinds(encode) == ["EncodeInput", "TakeInput", "BlockReduce", "Scalar", "Lazy",
                             "Lazy", "Lazy", "PayloadSizes", "Pass", "Pass", "Return"]
    element_pass, blocks_pass = (item for item in encode.items if isinstance(item, sch.Pass))
    assert element_pass.extent.kind == "n" and element_pass.block == 512
    assert [(type(p).__name__, p.name) for p in element_pass.prologue] == [
        ("BlockReduce", "lo"), ("Lazy", "scale"), ("Lazy", "inv")]
    assert all(p.in_pass for p in element_pass.prologue)
    # the section writes of the block values moved after the pass that computes them
    assert blocks_pass.extent.kind == "blocks" and not blocks_pass.prologue
    assert "each chunk first lo, hi, scale, inv of its blocks of 512" in str(encode)


@pytest.mark.parametrize("name,bucket", [("cgx", 1000), ("zeropp", 100), ("qsgd", 0)])
def test_blocks_that_do_not_divide_a_chunk_stay_a_pass_of_their_own(name, bucket):
    encode, _ = kernels(load(name, bucket=bucket))
    assert not any(isinstance(item, sch.Pass) and item.prologue for item in encode.items)


def test_block_sizes_are_part_of_the_kernel():
    encode, _ = kernels(load("zeropp", bucket=100))
    (block,) = (item for item in encode.items if isinstance(item, sch.BlockReduce))
    assert (block.op, block.block) == ("max", 100) and block.key is not None


# -- how the loops read (compll.loops): decided in the schedule, printed by the renderer --------

def test_a_value_the_same_for_every_element_is_computed_once_before_its_loop():
    encode, _ = kernels(load("cgx"))
    (temp,) = (item for item in encode.items
               if isinstance(item, sch.Scalar) and item.name.startswith("%"))
    assert sch.ir.show(temp.value) == "i32(top)" and temp.elem == "i32"
    (q,) = (item for item in encode.items if isinstance(item, sch.Lazy) and item.name == "q")
    assert temp.name in sch.ir.show(q.value) and "i32(top)" not in sch.ir.show(q.value)
    assert encode.items.index(temp) < encode.items.index(q)
    assert encode.arrays["q"].value == q.value  # the pass that inlines q reads it too
    source = generate(load("cgx"), "cpu")
    assert source.count("hp_f2i32(v_top)") == 1  # once, not per element nor per pass


def test_literal_only_values_are_folded_not_hoisted():
    encode, _ = kernels(load("qsgd"))
    assert not any(isinstance(item, sch.Scalar) and item.name.startswith("%")
                   and "bits" in sch.ir.show(item.value) for item in encode.items)


def test_a_cpu_decode_pass_stages_its_unpacks_and_expands_and_runs_block_by_block():
    _, decode = kernels(load("qsgd"))
    (out,) = (item for item in decode.items if isinstance(item, sch.Pass))
    assert out.stage == (("codes", 8),) and out.expand == (("unit", 512),)
    assert out.by_block and out.settle
    assert decode.block_arrays == {"norms", "unit"}
    _, gpu = kernels(load("qsgd"), CudaRenderer)
    (out,) = (item for item in gpu.items if isinstance(item, sch.Pass))
    assert out.stage == (("codes", 8),) and out.expand == () and not out.by_block
    assert not out.settle


def test_a_pass_stages_at_most_max_staged_arrays_and_reads_the_rest_in_place():
    from compll.constants import MAX_STAGED

    k = MAX_STAGED + 1
    names = [f"p{j}" for j in range(k)]
    lets = "\n".join(f"    let {p} = pack(map(g, x -> u32(x > {j}.0)), bits=1)"
                     for j, p in enumerate(names))
    packs = ", ".join(names)
    args = " + ".join(f"f32(u{j})" for j in range(k))
    params = ", ".join(f"u{j}" for j in range(k))
    unpacks = ", ".join(f"unpack({p})" for p in names)
    prog = load_source(
        f"encode(g: f32[]) -> bytes:\n{lets}\n    return concat({packs})\n"
        f"decode(p: bytes, n: u32) -> f32[n]:\n"
        f"    let {', '.join(f'{p}: u1[n]' for p in names)} = extract(p)\n"
        f"    return map({unpacks}, ({params}) -> {args})\n", "many.cll")
    _, decode = kernels(prog)
    (out,) = (item for item in decode.items if isinstance(item, sch.Pass))
    assert [name for name, _ in out.stage] == names[:MAX_STAGED]
    source = generate(prog, "cpu")
    assert f"hp_unpack(pk_{names[-1]}, " in source and f"st.get({MAX_STAGED - 1}, " in source


def test_random_stream_keys_come_first_in_encode_and_after_the_check_in_decode():
    encode, decode = kernels(load("randomk"))
    assert isinstance(encode.items[0], sch.StreamKeys) and encode.items[0].streams == (1,)
    check = next(k for k, item in enumerate(decode.items) if isinstance(item, sch.CheckSections))
    assert isinstance(decode.items[check + 1], sch.StreamKeys)
    assert not any(isinstance(item, sch.StreamKeys) for item in kernels(load("onebit"))[0].items)


def test_scheduling_a_program_twice_gives_equal_kernels():
    lowered = lower(load("cgx"))
    first = schedule(lowered, CpuRenderer.options)
    assert schedule(lowered, CpuRenderer.options) == first
