"""The scheduled loop IR: which passes a kernel runs and what runs in each."""

import subprocess
import sys
import textwrap

import pytest

from compll import load, load_source
from compll import schedule as sch
from compll.lower import lower
from compll.render import CpuRenderer, CudaRenderer
from compll.scheduling import schedule

pytestmark = pytest.mark.pure


def kernels(prog, renderer=CpuRenderer):
    return schedule(lower(prog), renderer.options)


def kinds(kernel):
    return [type(item).__name__ for item in kernel.items]


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
