"""The training loop on text (``fsdp_pass.loop``): its data (one process, no compile), and runs of the loop on gloo
ranks: a tiny built-in model learns a text sample on 2 ranks, and a run resumed on 1 rank from the 2 ranks'
checkpoint goes on with their losses. Two compiles in all (one per world size: no accumulation), of a one-layer
model: Thunder's tracing time grows with the layers, and the loop is the same for any depth."""

import warnings

import pytest
import torch

from fsdp_pass import CheckpointWarning, loop
from fsdp_pass.errors import FSDPError
from fsdp_pass.models import zoo
from fsdp_pass.train import text_data
from fsdp_pass.train.byte_model import byte_model
from fsdp_pass.train.progress import Window, progress_line
from fsdp_pass.train.text_data import (
    BYTE_VOCAB,
    corpus_files,
    default_corpus_files,
    load_corpus,
    rank_slice,
    train_windows,
    val_windows,
)
from fsdp_pass.train.throughput import peak_flops
from tests import loop_cases

TOL = 1e-5  # another world size sums the same gradients in another order; AdamW divides by their roots


def _corpus(tmp_path, train: bytes, val: bytes):
    (tmp_path / "text.txt").write_bytes(train + val)
    return load_corpus(tmp_path / "text.txt", val_fraction=len(val) / (len(train) + len(val)))


def test_a_steps_batch_depends_on_seed_and_step_alone(tmp_path):
    corpus = _corpus(tmp_path, bytes(range(32, 127)) * 40, b"!" * 200)
    again = load_corpus(tmp_path / "text.txt", val_fraction=len(corpus.val) / (len(corpus.train) + len(corpus.val)))
    first = train_windows(corpus, 8, 16, seed=3, step=5)
    assert first.shape == (8, 17) and first.dtype == torch.int64
    assert torch.equal(first, train_windows(again, 8, 16, seed=3, step=5))  # read again, drawn again: the same
    assert not torch.equal(first, train_windows(corpus, 8, 16, seed=3, step=6))
    assert not torch.equal(first, train_windows(corpus, 8, 16, seed=4, step=5))
    # each row is a run of the text: the next byte of the input is the target
    text = bytes(corpus.train.tolist())
    assert all(bytes(row.tolist()) in text for row in first)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_slices_put_together_are_the_global_batch_at_any_world_size(tmp_path, world):
    corpus = _corpus(tmp_path, bytes(range(256)) * 20, bytes(range(256)))
    batch = train_windows(corpus, 8, 32, seed=0, step=11)
    assert torch.equal(torch.cat([rank_slice(batch, r, world) for r in range(world)]), batch)
    with pytest.raises(FSDPError, match="does not split evenly over 3 ranks"):
        rank_slice(batch, 0, 3)


def test_training_never_reads_the_held_out_bytes_and_validation_reads_the_same_windows(tmp_path):
    corpus = _corpus(tmp_path, b"abcdefghij" * 95, b"Z" * 50)  # the held-out 5 % is all 'Z'
    assert len(corpus.val) == 50 and ord("Z") not in corpus.train.tolist()
    for step in range(20):
        assert not (train_windows(corpus, 16, 8, seed=0, step=step) == ord("Z")).any()
    val = val_windows(corpus, 4, 8)
    assert (val == ord("Z")).all() and torch.equal(val, val_windows(corpus, 4, 8))
    with pytest.raises(FSDPError, match="held-out part of the corpus has 50 bytes"):
        val_windows(corpus, 4, 64)


def test_a_folder_is_read_in_sorted_order_hidden_files_left_out(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_bytes(b"two ")
    (tmp_path / "a.txt").write_bytes(b"one ")
    (tmp_path / ".hidden").write_bytes(b"secret")
    (tmp_path / "c.txt").write_bytes(b"three 3333333333333333333")
    corpus = load_corpus(tmp_path, val_fraction=0.2)
    assert [f.name for f in corpus_files(tmp_path)] == ["a.txt", "2.txt", "c.txt"] and corpus.files == 3
    assert bytes(torch.cat([corpus.train, corpus.val]).tolist()) == b"one two three 3333333333333333333"
    with pytest.raises(FSDPError, match="no such file or folder"):
        load_corpus(tmp_path / "nowhere")


def test_the_default_corpus_is_the_standard_librarys_own_python_files():
    files = default_corpus_files()
    assert files == sorted(files) and len(files) > 50 and all(f.suffix == ".py" for f in files)
    assert corpus_files(None) == files
    corpus = load_corpus()
    assert len(corpus.train) + len(corpus.val) == sum(f.stat().st_size for f in files)
    assert abs(len(corpus.val) / (len(corpus.train) + len(corpus.val)) - text_data.DEFAULT_VAL_FRACTION) < 1e-6


def test_the_model_gets_a_byte_vocabulary(tmp_path):
    builtin = byte_model("bench", "meta", layers=1)
    assert builtin.module.model.embed.num_embeddings == BYTE_VOCAB == builtin.module.model.lm_head.out_features
    assert zoo.CONFIGS["bench"].vocab != BYTE_VOCAB  # it was overridden, not already bytes
    config = tmp_path / "config.json"
    config.write_text(
        '{"model_type": "llama", "vocab_size": 32000, "hidden_size": 32, "intermediate_size": 64, '
        '"num_hidden_layers": 1, "num_attention_heads": 2, "pad_token_id": 31999, "bos_token_id": 1}'
    )
    hf = byte_model(f"hf:{config}", "meta")
    embed = hf.module.get_input_embeddings()
    assert hf.hugging_face and embed.num_embeddings == BYTE_VOCAB and embed.padding_idx is None
    assert hf.module.config.bos_token_id == 1  # ids that fit stay
    with pytest.raises(FSDPError, match="a factory builds a model with inputs of its own"):
        byte_model("tests.models:factory", "meta")


def test_the_progress_line_shows_mfu_only_where_the_peak_is_known():
    window = Window()
    window.add(seconds=0.5, tokens=4096, flops_per_rank=2e9)
    window.add(seconds=0.5, tokens=4096, flops_per_rank=2e9)
    on_cpu = progress_line(7, 2.5, 2.6, 0.8, 3e-3, window, peak_flops(torch.device("cpu"), torch.float32))
    assert on_cpu == "step    7  loss 2.5000  val 2.6000  grad norm 0.800  lr 3.0e-03  8,192 tok/s  500.0 ms/step"
    given = progress_line(7, 2.5, None, 0.8, 3e-3, window, peak_flops(torch.device("cpu"), torch.float32, 0.01))
    assert given.endswith("500.0 ms/step  MFU 40.0%") and "val" not in given  # 4e9 FLOP in 1 s of a 1e10 peak


# ----- the loop on gloo ranks -----

STEPS = ["--steps", "6", "--save-every", "4", "--eval-every", "2"]
TINY = ["--model", "tiny", "--layers", "1", "--seq", "64", "--global-batch", "8", "--accumulate", "1"]


@pytest.fixture(scope="module")
def runs(ranks, tmp_path_factory):
    """A 2-rank run of 6 steps on a 48 KB text sample (a checkpoint at step 4), the same resumed on 1 rank
    (evaluating every step), a resume with another seed, and 6 steps in float16 on 1 rank."""
    folder = tmp_path_factory.mktemp("loop")
    sample = b"".join(f.read_bytes() for f in default_corpus_files()[:8])[:48_000]
    (folder / "sample.txt").write_bytes(sample)
    common = [*TINY, "--data", str(folder / "sample.txt"), "--checkpoint-dir", str(folder / "ckpt")]
    uninterrupted = ranks(2).run(loop_cases.run_loop, [*common, *STEPS])
    resumed = ranks(1).run(loop_cases.run_loop, [*common, *STEPS[:4], "--eval-every", "1"])[0]
    other_seed = ranks(1).run(loop_cases.run_loop, [*common, *STEPS, "--seed", "1"])[0]
    float16 = ranks(1).run(loop_cases.run_loop, [*common[:-2], "--steps", "6", "--param-dtype", "float16"])[0]
    return uninterrupted, resumed, other_seed, float16


def test_the_loop_learns_a_text_sample_on_two_ranks(runs):
    (r0, _), *_ = runs
    run = r0["run"]  # losses averaged over the ranks: the same on both by construction, so rank 0's are read
    assert sorted(run.losses) == list(range(6)) and sorted(run.val_losses) == [0, 2, 4, 6]
    assert run.losses[5] < run.losses[0] - 0.15, run.losses  # 5.59 -> 5.31 when written
    assert run.val_losses[6] < run.val_losses[0] - 0.2, run.val_losses  # 5.68 -> 5.37
    lines = r0["lines"]
    assert "byte vocabulary" in lines[0] and "world size 2 (gloo, cpu)" in lines[0]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 7 and all("tok/s" in line and "ms/step" in line for line in steps[:6])
    assert "val" in steps[2] and "val" not in steps[1] and "MFU" not in "".join(lines)  # no MFU on the CPU
    summary = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("summary"))):])
    assert f"{run.losses[0]:.4f} -> {run.losses[5]:.4f}" in summary
    assert f"{run.val_losses[0]:.4f} -> {run.val_losses[6]:.4f}" in summary and "3,072 trained on" in summary


def test_the_steps_model_flops_are_its_matmuls_counted_in_the_trace(runs):
    """3 x the forward's matmuls: the tiny model's linears (q, k, v, o, gate, up, down in its one layer, the head)
    and its attention, on one rank's 4 x 64 tokens."""
    run = runs[0][0]["run"]
    cfg, layers, rows, seq = zoo.CONFIGS["tiny"], 1, 4, 64
    linear_weights = layers * (4 * cfg.d * cfg.d + 3 * cfg.d * cfg.hidden) + cfg.d * BYTE_VOCAB
    forward = 2 * linear_weights * rows * seq + layers * 4 * rows * seq * seq * cfg.d
    assert run.flops_per_rank_step == 3 * forward


def test_resumed_on_one_rank_it_goes_on_with_the_two_ranks_losses(runs):
    (r0, _), resumed, *_ = runs
    before, after = r0["run"], resumed["run"]
    assert any("resumed from" in line and "saved by 2 ranks" in line for line in resumed["lines"]), resumed["lines"]
    assert sorted(after.losses) == [4, 5] and sorted(after.val_losses) == [4, 5, 6]
    for step in after.losses:
        assert abs(after.losses[step] - before.losses[step]) <= TOL * before.losses[step], (after.losses, before.losses)
    for step in (4, 6):  # evaluating every step on the way did not change the training
        assert abs(after.val_losses[step] - before.val_losses[step]) <= TOL * before.val_losses[step]


def test_resuming_with_other_batches_is_refused(runs):
    error = runs[2]["error"]
    assert error is not None and "seed 0 then, 1 now" in error and "What to do" in error, error


def test_float16_scales_the_loss_and_skips_the_steps_that_overflow(runs):
    """fsdp_pass.GradScaler from 2**16: each skipped step halves the scale (no growth in 6 steps); the rest learn."""
    r = runs[3]
    run = r["run"]
    assert run.loss_scale == 2.0**16 / 2 ** len(run.skipped_steps), (run.loss_scale, run.skipped_steps)
    assert len(run.skipped_steps) < 6 and run.val_losses[6] < run.val_losses[0] - 0.1, run.val_losses
    assert "\n  float16    loss scale" in "\n".join(r["lines"]), r["lines"]


def test_counts_below_one_are_refused_before_anything_runs():
    with pytest.raises(FSDPError, match="--warmup 0: must be at least 1"):
        loop.arguments(["--warmup", "0"])
    assert loop.arguments([]).model == "bench"


def test_what_a_save_or_load_did_to_the_folder_is_a_line_of_the_loops_output():
    """checkpoint_notes says each CheckpointWarning (rank 0's: a rollback's checkpoints set aside, leftovers), also
    when the save or the load then raised; other warnings go on as warnings."""
    lines = []
    with pytest.raises(FSDPError), warnings.catch_warnings(record=True) as other:
        warnings.simplefilter("always")
        with loop.checkpoint_notes(lines.append):
            warnings.warn("ckpt/.step-00000012.partial is a save of step 12 that did not finish", CheckpointWarning)
            warnings.warn("something else", DeprecationWarning)
            raise FSDPError("The checkpoint ckpt/step-00000008 is damaged")
    assert lines == ["checkpoint: ckpt/.step-00000012.partial is a save of step 12 that did not finish"]
    assert [str(w.message) for w in other] == ["something else"]
    with pytest.raises(FSDPError, match="--resume-step 8 without a checkpoint folder"):
        loop.arguments(["--resume-step", "8"])
