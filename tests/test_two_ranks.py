"""2 ranks = 1 rank on one global batch, for every option that changes micro-batches, collectives
or normalisers.

tests/fsdp_step.py runs each scenario (one rollout's updates, 2 mini-batches) on the embedded tiny model under
`torchrun` with gloo on CPU, with 1 rank and with 2, on the same 16 rows: token budgets that plan different
micro-batch counts on the two ranks (rank 0's responses are 1-2 tokens, rank 1's 8-10), --share-prompt, the
sequence-level rollout corrections, --old-logp engine, the KL term, bf16 compute, a resume, packed
micro-batches with selective recomputation and with compiled layers (their own pair, `slow`: Inductor compiles
cold in each process), and FSDP2's reduce after every micro-batch (the reference of the update's one reduce
per mini-batch). The normalisers are the whole mini-batch's, so the update must not depend on how rows fall
into ranks and micro-batches: the weights after it agree to float32 rounding. A run that hangs (ranks running
different numbers of collectives) fails at the guard.
"""
import functools
import math
import os
import subprocess

import pytest
import torch

from machinery.precision import cpu_has_native_bf16
from test_train import HANG, ROOT, TORCHRUN, env, free_port

import rollout

U32 = torch.finfo(torch.float32).eps / 2  # float32 unit roundoff
NAMES = ["budget", "share-prompt", "sequence-truncate", "sequence-mask", "engine", "kl", "resume",
         "pack-budget", "pack-kl-is", "pack-selective", "budget-reduce-each"]
# compiled layers: Inductor compiles each process's layers cold (~50 CPU-s a process on a 2-core Zen 4, as much as
# all the scenarios above), so their 2-rank run is `slow`; tests/test_recompute.py's compiled packed = padded runs
# in `make test`
COMPILED = ["budget", "pack-compiled"]
BF16 = ["bf16", "bf16-budget", "bf16-pack", "bf16-budget-reduce-each"]


def start_scenarios(out, nproc, names):
    """tests/fsdp_step.py under torchrun, started -> (Popen, out)."""
    cmd = [TORCHRUN, "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
           "tests/fsdp_step.py", str(out), *names]
    # one thread per rank on both world sizes (torchrun's default for several): the same kernels
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(env(), OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out


def finish_scenarios(started, nproc):
    """-> the results of a started run; a run past HANG is stopped and fails."""
    proc, out = started
    try:
        _, err = proc.communicate(timeout=HANG)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops its workers on SIGTERM
        _, err = proc.communicate(timeout=120)
        pytest.fail(f"{nproc} rank(s) still running after {HANG} s (a hang?): {err[-2000:]}")
    assert proc.returncode == 0, err[-3000:]
    return torch.load(out)


def torchrun_scenarios(out, nproc, names):
    """tests/fsdp_step.py under torchrun -> its results; a run past HANG is stopped and fails."""
    return finish_scenarios(start_scenarios(out, nproc, names), nproc)


def both_world_sizes(tmp, names):
    """{1: results, 2: results} of `names`, both world sizes at once (three single-threaded processes: each run's
    numbers are its own either way)."""
    started = {n: start_scenarios(tmp / f"ranks{n}.pt", n, names) for n in (1, 2)}
    return {n: finish_scenarios(started[n], n) for n in (1, 2)}


def _scenarios(tmp):
    """Every scenario of NAMES (and BF16 where the CPU has native bf16) on 1 and 2 ranks."""
    return both_world_sizes(tmp, NAMES + (BF16 if cpu_has_native_bf16() else []))


def _compiled(tmp):
    return both_world_sizes(tmp, COMPILED)


pytestmark = pytest.mark.ahead.with_args(_scenarios, cpu_s=53)


@pytest.fixture(scope="module")
def runs(ahead):
    return ahead.result(_scenarios)


def assert_same_update(one, two, scale=1):
    """The weights after the step agree to float32 rounding (`scale` times the bound below), and
    the step moved them."""
    from safetensors.torch import load_file
    before = load_file(os.path.join(rollout.DEFAULT_MODEL, "model.safetensors"))
    moved = max((w - before[k].double()).abs().max().item()
                for k, w in one.items() if k in before)
    assert moved > 1e-3  # the step really moved the weights: the comparison means something
    # float32, the same sums in other orders (micro-batches, ranks): each w - lr g is rounded once
    # (u |w|), each gradient carries a summation-order error <~ n_layers sqrt(d_ff) u max|g| (tiny
    # model: 4 * 16 = 64, tests/test_train.py's bound), and lr max|g| = moved. Both runs err:
    # |dw| <= 2u |w| + 2 * 64 u moved. An embedding row's gradient is besides a sum over every position of its
    # token, whose order the micro-batches and the attention kernel set: one more sqrt(count) factor, count the most
    # positions any token holds in the batch (embed_positions).
    for k, w in one.items():
        s = scale * (math.sqrt(embed_positions()) if "embed_tokens" in k else 1)
        assert torch.allclose(two[k], w, rtol=2 * U32, atol=s * 2 * 64 * U32 * moved), k


@functools.cache
def embed_positions():
    """The most positions one token id holds in tests/fsdp_step.py's global batch (a prompt's tokens sit in each of
    its group's 4 rows)."""
    import fsdp_step
    from transformers import AutoConfig
    ids, attn, _, _ = fsdp_step.global_batch(AutoConfig.from_pretrained(rollout.DEFAULT_MODEL).vocab_size)
    return int(torch.bincount(ids[attn.bool()]).max())


# a log-prob from micro-batches of other shapes: each side's logit errs by <~ 64 u max|z| (|z| <= 40
# on the tiny model, tests/test_train.py), a log-prob by <= 2x that (sum_v |d log p / d z_v| <= 2),
# and both sides err: 4 * 64 * 40 u = 6e-4
LOGP_TOL = 4 * 64 * 40 * U32


def test_token_budget_unequal_counts_agree_and_equal_one_rank(runs):
    """--micro-batch-tokens with rank 0's rows short and rank 1's long: rank 0 plans fewer
    micro-batches than rank 1, both run rank 1's count (no hang), and the update, the loss and the
    old-log-prob pass equal 1 rank's, whose plan is another."""
    (raw0, agreed0), (raw1, agreed1) = runs[2]["budget"]["counts"]
    assert all(a < b for a, b in zip(raw0, raw1))  # each rank's own plan, in both mini-batches
    assert agreed0 == agreed1 == raw1
    one, two = runs[1]["budget"], runs[2]["budget"]
    assert_same_update(one["weights"], two["weights"])
    # the loss: O(1) terms over 16 rows, float32 in other orders (64 u relative, as the gradient)
    assert two["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=64 * U32)
    assert torch.allclose(two["old_pass"], one["old_pass"], rtol=0, atol=LOGP_TOL)


def test_share_prompt_equal_one_rank(runs):
    """--share-prompt (micro-batches of whole groups, each prompt run once): the update equals 1
    rank's, whose micro-batches hold other groups."""
    assert_same_update(runs[1]["share-prompt"]["weights"], runs[2]["share-prompt"]["weights"])


@pytest.mark.parametrize("mode", ["sequence-truncate", "sequence-mask"])
def test_sequence_rollout_correction_equal_one_rank(runs, mode):
    """--rollout-is sequence-*: a response's weight is its own tokens' product however the rows fall
    into ranks and token-budget micro-batches; the correction acts (responses outside [0, 1.5])."""
    one, two = runs[1][mode], runs[2][mode]
    assert_same_update(one["weights"], two["weights"])
    assert one["metrics"]["rollout_is/seqs_out_frac"] > 0
    assert (two["metrics"]["rollout_is/seqs_out_frac"]
            == one["metrics"]["rollout_is/seqs_out_frac"])


def test_engine_old_logp_equal_one_rank_and_gap_measured_before_any_step(runs):
    """--old-logp engine: the update equals 1 rank's, and rollout/logprob_diff and
    rollout/ratio_out_0.1_frac are the gap between the engine's log-probs and π_θ before any
    optimizer step on the first mini-batch (rows 0-7), computed here from one plain forward of the
    global batch."""
    one, two = runs[1]["engine"], runs[2]["engine"]
    assert_same_update(one["weights"], two["weights"])
    first = slice(0, 8)
    mask = two["mask"][first].double()                                            # (8, T)
    gap = (two["engine"][first] - two["before"][first]).double()                  # (8, T)
    want_diff = (gap.abs() * mask).sum() / mask.sum()
    want_out = (((gap.neg().exp() - 1).abs() > 0.1) * mask).sum() / mask.sum()
    for res in (one, two):
        m = res["metrics"]
        assert m["rollout/logprob_diff"] == pytest.approx(float(want_diff), abs=LOGP_TOL)
        assert m["rollout/ratio_out_0.1_frac"] == pytest.approx(float(want_out), abs=1e-12)
        assert m["entropy"] > 0


def test_kl_term_equal_one_rank(runs):
    """--kl-coef with token budgets: the reference pass runs the agreed micro-batches, and the KL
    term's gradient and its metric equal 1 rank's."""
    one, two = runs[1]["kl"], runs[2]["kl"]
    assert_same_update(one["weights"], two["weights"])
    assert torch.allclose(two["ref_pass"], one["ref_pass"], rtol=0, atol=LOGP_TOL)
    assert one["metrics"]["kl/ref"] > 0
    assert two["metrics"]["kl/ref"] == pytest.approx(one["metrics"]["kl/ref"], rel=64 * U32)


def test_resume_equals_uninterrupted(runs):
    """A checkpoint after the first update, then a fresh model and AdamW loaded from it: the second
    update gives the uninterrupted run's weights bit for bit (the same operations on the same
    state), with token budgets, on 1 and on 2 ranks."""
    for n in (1, 2):
        res = runs[n]["resume"]
        for k, w in res["uninterrupted"].items():
            assert torch.equal(res["weights"][k], w), (n, k)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16 (avx512_bf16, amx_bf16)")
def test_bf16_equal_one_rank_and_first_ratio_exactly_one(runs):
    """--train-dtype bfloat16 (bf16 compute, fp32 reduction): with micro-batches of the same shapes
    on 1 and 2 ranks, the bf16 products are the same and only the fp32 sums differ in order, so the
    update equals 1 rank's to float32 rounding; with token budgets of unequal counts, the
    old-log-prob pass and the update run the same agreed micro-batches, so the first mini-batch's
    ratio is exactly 1 on 2 ranks as on 1."""
    assert_same_update(runs[1]["bf16"]["weights"], runs[2]["bf16"]["weights"])
    (raw0, _), (raw1, _) = runs[2]["bf16-budget"]["counts"]
    assert raw0 != raw1
    for n in (1, 2):
        assert runs[n]["bf16-budget"]["metrics"]["ratio/first_abs_dev"] == 0.0, n


def test_packed_token_budget_equal_one_rank_and_padded(runs):
    """--pack with a budget of real tokens planning unequal micro-batch counts on the two ranks: no
    hang, the update equals 1 rank's packed update and the padded path's (the "budget" scenario:
    the same rows and normalisers, other micro-batches), and the packed old-log-prob pass equals
    the padded one."""
    (raw0, agreed0), (raw1, agreed1) = runs[2]["pack-budget"]["counts"]
    assert raw0 != raw1 and agreed0 == agreed1
    for n in (1, 2):
        assert_same_update(runs[1]["budget"]["weights"], runs[n]["pack-budget"]["weights"])
        assert torch.allclose(runs[n]["pack-budget"]["old_pass"], runs[1]["budget"]["old_pass"],
                              rtol=0, atol=LOGP_TOL)


def test_packed_kl_and_rollout_correction_equal_one_rank(runs):
    """--pack with the KL term and a sequence-level rollout correction: 2 ranks = 1 rank, the
    packed reference pass equals the padded one (the "kl" scenario's: the same model and rows), and
    both terms act."""
    one, two = runs[1]["pack-kl-is"], runs[2]["pack-kl-is"]
    assert_same_update(one["weights"], two["weights"])
    assert torch.allclose(two["ref_pass"], runs[1]["kl"]["ref_pass"], rtol=0, atol=LOGP_TOL)
    assert one["metrics"]["kl/ref"] > 0 and one["metrics"]["rollout_is/seqs_out_frac"] > 0
    assert two["metrics"]["kl/ref"] == pytest.approx(one["metrics"]["kl/ref"], rel=64 * U32)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16 (avx512_bf16, amx_bf16)")
def test_bf16_packed_first_ratio_exactly_one(runs):
    """bf16 packed: the old-log-prob pass and the update's forward run the same packed shapes
    through the same kernels, so the first mini-batch's ratio is exactly 1, on 1 and 2 ranks."""
    for n in (1, 2):
        assert runs[n]["bf16-pack"]["metrics"]["ratio/first_abs_dev"] == 0.0, n


def test_packed_selective_recompute_equal_one_rank_and_padded(runs):
    """--recompute selective changes what the backward runs, not what it computes: the packed update on 2 ranks
    equals 1 rank's and the padded row micro-batches' ("budget"); it reruns the same ops: the same bound."""
    for n in (1, 2):
        assert_same_update(runs[1]["budget"]["weights"], runs[n]["pack-selective"]["weights"])
    assert_same_update(runs[1]["pack-selective"]["weights"], runs[2]["pack-selective"]["weights"])


@pytest.mark.slow
@pytest.mark.ahead.with_args(_compiled, cpu_s=120)
def test_packed_compiled_layers_equal_one_rank_and_padded(ahead):
    """--compile-layers changes what the backward runs, not what it computes: the packed update on 2
    ranks equals 1 rank's and the padded row micro-batches' ("budget"). Compiled layers run
    Inductor's own kernels: its vectorised exp, rsqrt and sigmoid are 1-ulp functions (Sleef's)
    where eager's are within 0.5 ulp, and its reductions associate differently (within a vector
    register, then across), so each value errs by up to ~4 u where eager's errs by u: the bound x 4
    against eager runs, for the 8 float32 lanes of AVX2 code. Inductor writes its CPU code for the ISA torch
    detects: at AVX-512 its vectors and its reductions' partial sums are 16 lanes wide, and the embedding's
    gradient, a sum over every position of a token, carries twice the reassociation: x 8 there. Between two
    compiled runs the kernels are the same: the plain bound."""
    runs = ahead.result(_compiled)
    lanes = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
    for n in (1, 2):
        assert_same_update(runs[1]["budget"]["weights"], runs[n]["pack-compiled"]["weights"], lanes // 2)
    assert_same_update(runs[1]["pack-compiled"]["weights"], runs[2]["pack-compiled"]["weights"])


def test_one_reduce_per_mini_batch_equals_a_reduce_per_micro_batch(runs):
    """Gradients accumulated whole over a mini-batch's micro-batches and reduced once (policy._reduce_on_last), with
    token budgets that plan unequal micro-batch counts on the two ranks (no hang: every rank runs the agreed count and
    reduces after the same last one): on 1 rank the same float32 sums in the same order as FSDP2's reduce after every
    backward, so the weights and the loss are equal bit for bit, in float32 and in bf16 compute (whose gradients FSDP2
    accumulates in its float32 reduce dtype); on 2 ranks each rank sums its own micro-batches first, other orders of
    the same sums: float32 rounding (`assert_same_update`'s bound)."""
    pairs = [("budget", "budget-reduce-each")] + (
        [("bf16-budget", "bf16-budget-reduce-each")] if "bf16-budget" in runs[1] else [])
    for once, each in pairs:
        for k, w in runs[1][each]["weights"].items():
            assert torch.equal(runs[1][once]["weights"][k], w), (once, k)
        assert runs[1][once]["metrics"]["loss"] == runs[1][each]["metrics"]["loss"]
        assert_same_update(runs[2][each]["weights"], runs[2][once]["weights"])
        assert runs[2][once]["metrics"]["loss"] == pytest.approx(runs[2][each]["metrics"]["loss"], rel=64 * U32)
