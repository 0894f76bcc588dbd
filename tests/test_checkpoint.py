"""Damaged checkpoints never leave a run stuck: a fault-injection walk over every file of a
saved step (truncate, empty, delete, flip bytes), the one-line errors, and `inspect`.

The walk restores in this process through `Checkpointer.restore_latest`, the function a
training run resumes with. Each fault must end in a bitwise-exact state of a good step
(the damaged one when the damage cannot matter, else the previous one, with one warning
line), or in one CheckpointError line when no good step is left; never an exception
of another kind, never a good step lost. The multi-process checkpoint's walk is in
tests/test_multihost.py (it reuses the 4-process runs there), with the restores into
other layouts; here, a restore at another tensor size (another padded vocabulary).
"""
import json
import shutil
import subprocess
import sys

import jax
import pytest

from helpers import REPO, assert_same_state, damage, make_setup, walk_faults
from jaxptd.checkpoint import CheckpointError
from jaxptd.checkpoint.files import FILE_LIST, layout_metadata
from jaxptd.checkpoint.integrity import inspect
from jaxptd.checkpoint.store import Checkpointer

EXTRA = ("model.num_layers=2",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of distinct states, saved on one device: (directory, setup, states)."""
    setup = make_setup(extra=EXTRA)
    directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    ckpt = Checkpointer(str(directory), 1, 10, metadata=layout_metadata(setup.config, 1))
    first = setup.state_layout.init_state(1)
    states = {1: first, 2: jax.tree.map(lambda x: x * 2 if x.dtype.kind == "f" else x, first)}
    for step, state in states.items():
        ckpt.save(step, state)
    ckpt.close()
    return directory, setup, jax.device_get(states)


def restore_latest(setup, directory):
    ckpt = Checkpointer(str(directory), 0, 10)
    try:
        return ckpt.restore_latest(setup.state_layout.abstract_state(logical=True),
                                   setup.config.model.vocab_size)
    finally:
        ckpt.close()


@pytest.mark.slow
def test_every_fault_in_every_file_resumes_from_a_good_step(saved, tmp_path, capfd):
    directory, setup, states = saved
    outcomes = walk_faults(directory, 2, tmp_path, lambda d: restore_latest(setup, d),
                           states, capfd)
    # The files a restore reads must have been noticed when damaged, not only survived:
    assert outcomes[("state/_METADATA", "truncate")] == 1
    assert outcomes[("state/_METADATA", "delete")] == 1
    assert outcomes[("state/array_metadatas/process_0", "truncate")] == 1
    assert outcomes[("layout/metadata", "empty")] == 1
    assert outcomes[(FILE_LIST, "flip")] == outcomes[(FILE_LIST, "delete")] == 1
    assert all(outcomes[(rel, f)] == 1 for rel, f in outcomes if "/d/" in rel and f != "flip")


@pytest.mark.parametrize("rel", ["state/_METADATA", "layout/metadata", "state/manifest.ocdbt"])
def test_no_good_step_left_is_one_error_line(saved, tmp_path, rel):
    directory, setup, _ = saved
    work = tmp_path / "checkpoints"
    work.mkdir()
    shutil.copytree(directory / "2", work / "2")
    damage(work / "2" / rel, "truncate")
    with pytest.raises(CheckpointError) as raised:
        restore_latest(setup, work)
    message = str(raised.value)
    assert "\n" not in message and "step 2" in message and rel.split("/")[-1] in message
    assert (work / "2.corrupt").is_dir()  # moved aside, not deleted


def test_whole_checkpoint_of_another_model_is_a_different_model(saved):
    directory, _, _ = saved
    other = make_setup(extra=EXTRA + ("model.hidden_size=64",))
    with pytest.raises(CheckpointError, match="different model"):
        restore_latest(other, directory)
    assert (directory / "2").is_dir() and (directory / "1").is_dir()


@pytest.mark.parametrize("tensor", [pytest.param(1, marks=pytest.mark.slow),
                                    pytest.param(8, marks=pytest.mark.slow)])
def test_restore_at_another_tensor_size_is_the_state_initialised_there(tmp_path, tensor):
    """A fresh Llama state saved at tensor 2 (vocabulary 257 padded to 512; its untied head
    padded by columns) restores at tensor 1 (384: the padding cut) and 8 (1024: padded with
    zeros) bitwise as the state a run initialises there: the padding is zeros either way."""
    extra = (*EXTRA, "model.arch=llama", "model.vocab_size=257")
    source = make_setup(1, 1, 2, extra)
    ckpt = Checkpointer(str(tmp_path), 1, 10, metadata=layout_metadata(source.config, 1))
    ckpt.save(1, source.state_layout.init_state(0))
    ckpt.close()
    target = make_setup(1, 1, tensor, extra)
    state, step = restore_latest(target, tmp_path)
    assert step == 1 and state["params"]["head"]["w_head"].shape[1] == target.vocab
    assert_same_state(state, target.state_layout.init_state(0))


@pytest.mark.parametrize("context", [pytest.param(1, marks=pytest.mark.slow),
                                     pytest.param(4, marks=pytest.mark.slow)])
def test_restore_at_another_context_size_is_the_state_initialised_there(tmp_path, context):
    """A state saved at context 2 restores at context 1 and 4 as the state initialised
    there: nothing in a checkpoint depends on how the sequence is split."""
    source = make_setup(1, 1, 1, (*EXTRA, "parallel.context=2"))
    ckpt = Checkpointer(str(tmp_path), 1, 10, metadata=layout_metadata(source.config, 1))
    ckpt.save(1, source.state_layout.init_state(0))
    ckpt.close()
    target = make_setup(1, 1, 1, (*EXTRA, f"parallel.context={context}"))
    state, step = restore_latest(target, tmp_path)
    assert step == 1
    assert_same_state(state, target.state_layout.init_state(0))


def run_inspect(target):
    return subprocess.run([sys.executable, "-m", "jaxptd.checkpoint", "inspect", str(target)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_inspect_reports_damage_and_the_step_a_run_resumes_from(saved, tmp_path):
    """The listing, and the exit status scripts read: 0 all steps good, 1 a run resumes
    but a step is damaged, 2 nothing to resume from (no step passes, or none found)."""
    directory, setup, states = saved
    run = tmp_path / "run"
    shutil.copytree(directory, run / "checkpoints")
    clean = run_inspect(run)
    assert clean.returncode == 0 and "a run resumes from step 2" in clean.stdout, clean.stdout
    damage(run / "checkpoints" / "2" / "state" / "_METADATA", "truncate")
    statuses = {r["step"]: (r["status"], r["problem"]) for r in inspect(str(run / "checkpoints"))}
    assert statuses[1] == ("complete", None)
    assert statuses[2][0] == "damaged" and "state/_METADATA" in statuses[2][1]
    for target in (run, run / "checkpoints" / "1"):
        out = run_inspect(target)
        assert out.returncode == 1, out.stderr
        assert "a run resumes from step 1" in out.stdout, out.stdout
        assert "damaged (state/_METADATA" in out.stdout, out.stdout
    state, step = restore_latest(setup, run / "checkpoints")
    assert step == 1
    assert_same_state(state, states[1])
    damage(run / "checkpoints" / "1" / "layout" / "metadata", "empty")
    none = run_inspect(run)
    assert none.returncode == 2 and "none would restore" in none.stdout, none.stdout
    empty = run_inspect(tmp_path / "nothing")
    assert empty.returncode == 2 and empty.stderr.startswith("error: ")
    assert len(empty.stderr.strip().splitlines()) == 1


def test_a_step_without_its_file_list_is_damaged(saved, tmp_path):
    """files.json deleted: the step would restore without its files' check, so it is
    damaged (inspect says so, restore falls back); a step of a jaxptd from before file
    lists (no checksums in its layout either) is still read."""
    directory, setup, states = saved
    work = tmp_path / "checkpoints"
    shutil.copytree(directory, work)
    (work / "2" / FILE_LIST).unlink()
    assert {r["step"]: r["problem"] for r in inspect(str(work))}[2] == f"{FILE_LIST}: missing"
    state, step = restore_latest(setup, work)
    assert step == 1 and (work / "2.corrupt").is_dir()
    older = tmp_path / "older"
    shutil.copytree(directory / "1", older / "1")
    (older / "1" / FILE_LIST).unlink()
    layout = json.loads((older / "1" / "layout" / "metadata").read_text())
    del layout["checksums"]
    (older / "1" / "layout" / "metadata").write_text(json.dumps(layout))
    assert inspect(str(older))[0]["status"] == "complete"



def test_local_tier_restores_what_the_persistent_tier_does_and_skips_damage(tmp_path, capfd):
    """checkpoint/local.py in one process (no peer; the copies between processes are
    tests/test_faults.py's): steps saved at (data 2, tensor 2, ZeRO-1) to both tiers restore
    at (pipe 2, tensor 4) bitwise alike; a save killed before its rename is removed; a
    damaged local step (a flipped byte, a cut file) is one warning line and the next older
    step is taken (the skipped one removed), then the persistent tier's."""
    from jaxptd.checkpoint.local import LocalTier, restore_newest
    source = make_setup(2, 1, 2, (*EXTRA, "optimizer.zero1=true"))
    first = source.state_layout.init_state(1)
    states = {s: jax.tree.map(lambda x: x * s if x.dtype.kind == "f" else x + s, first)
              for s in (1, 2, 3)}
    ckpt = Checkpointer(str(tmp_path / "persistent"), 1, 10,
                        metadata=layout_metadata(source.config, 1))
    ckpt.save(1, states[1])
    ckpt.close()
    tier = LocalTier(str(tmp_path / "local-{process}"), 1, 2, "run")
    for step in (1, 2, 3):
        tier.save(step, states[step])
    tier.close()
    assert tier.steps() == [2, 3]  # checkpoint.local_keep
    (tmp_path / "local-0" / "process-0" / "4" / "own.partial-99").mkdir(parents=True)
    target = make_setup(1, 2, 4, EXTRA)
    abstract, vocab = target.state_layout.abstract_state(logical=True), 300
    persistent = Checkpointer(str(tmp_path / "persistent"), 0, 10)

    def newest():
        return restore_newest(LocalTier(str(tmp_path / "local-{process}"), 1, 2, "run"),
                              persistent, abstract, vocab)

    state, step, where = newest()
    assert step == 3 and where.startswith("the local tier")
    assert not (tmp_path / "local-0" / "process-0" / "4" / "own.partial-99").exists()
    local_one = LocalTier(str(tmp_path / "one-{process}"), 1, 2, "run")
    local_one.save(1, states[1])
    local_one.close()
    assert_same_state(local_one.restore_newer(abstract, vocab, 0)[0],
                      persistent.restore(abstract, 1, vocab))
    own = tmp_path / "local-0" / "process-0"
    blocks = own / "3" / "own" / "blocks.bin"
    blocks.write_bytes(bytes([blocks.read_bytes()[0] ^ 1]) + blocks.read_bytes()[1:])
    state, step, _ = newest()
    assert step == 2 and "local checkpoint" in capfd.readouterr().err
    assert tier.steps() == [2]  # the skipped step after it removed: an abandoned history
    blocks = own / "2" / "own" / "blocks.bin"
    blocks.write_bytes(blocks.read_bytes()[:-4])
    state, step, where = newest()
    assert step == 1 and where == persistent.directory
    assert_same_state(state, persistent.restore(abstract, 1, vocab))
    persistent.close()
